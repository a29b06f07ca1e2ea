"""The server recipe (ortmem.serve.server under gunicorn with uvicorn workers), over loopback only, and fork
safety: a session created before ``fork()`` keeps working in the children."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.ort.feeds import make_inputs
from ortmem.measure.synth import SynthConfig, cached_model
from tests.support.compare import assert_close_outputs
from tests.support.paths import REPO
from tests.support.reference import run_plain

CONFIG = SynthConfig.tiny(storage="external", name="serve")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(cached_model(CONFIG, tmp_path_factory.mktemp("synth")))


@pytest.mark.parametrize("engine", ["ort", "ortmem"])
def test_session_created_before_fork_works_in_children(model: str, engine: str) -> None:
    """gunicorn --preload forks after the app (and its session) exists: the children must get
    ORT's outputs, with ORT's intra-op thread pool (threads that do not survive a fork) in use."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if engine == "ort":
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    else:
        sess = ortmem.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    feeds = make_inputs(sess, {"dims": {"seq": 64}})
    expected = sess.run(None, feeds)
    children = []
    for _ in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover  (runs in the child)
            os.close(r)
            signal.alarm(30)  # a deadlocked thread pool must fail the test, not hang it
            ok = all(np.array_equal(a, b) for a, b in zip(sess.run(None, feeds), expected))
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        children.append((pid, r))
    for pid, r in children:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.read(r, 1) == b"1"
        os.close(r)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def _serving(model: str, log_path: Path, *, workers: int = 1, preload: bool = False,
             env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """The recipe (gunicorn, uvicorn workers) on a free loopback port, answering ``/info``; stopped
    (the master stops its workers) on the way out. Its stdout and stderr go to ``log_path``."""
    pytest.importorskip("gunicorn")
    pytest.importorskip("uvicorn_worker")
    pytest.importorskip("starlette")
    port = _free_port()
    cmd = [sys.executable, "-m", "gunicorn", "-w", str(workers), "-k", "uvicorn_worker.UvicornWorker",
           "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "5", "ortmem.serve.server:app"]
    if preload:
        cmd.insert(-1, "--preload")
    full_env = {**os.environ, "ORTMEM_SERVE_MODEL": model, "ORTMEM_SERVE_THREADS": "1", **(env or {})}
    with open(log_path, "w+b") as log:
        server = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(url + "/info")
                break
            except OSError:
                assert server.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "server did not answer in 60 s"
                time.sleep(0.2)
        yield url, server
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the master stops its workers
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.slow
@pytest.mark.parametrize("preload", [False, True], ids=["per-worker", "preload"])
def test_gunicorn_uvicorn_workers_serve_what_ort_computes(model: str, preload: bool, tmp_path: Path) -> None:
    from ortmem.serve.server import decode, encode

    with _serving(model, tmp_path / "gunicorn.log", workers=2, preload=preload) as (url, server):
        ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        feeds = make_inputs(ref, {"dims": {"seq": 5}})
        expected = ref.run(None, feeds)
        body = {"inputs": {k: encode(v) for k, v in feeds.items()}}

        def one(_: int) -> tuple[int, bool]:
            got = _post(url + "/run", body)
            outs = [decode(got["outputs"][o.name]) for o in ref.get_outputs()]
            return got["pid"], all(np.array_equal(a, b) for a, b in zip(outs, expected))

        pids: set[int] = set()
        # Until two workers have answered: the kernel picks the acceptor, and a worker that is still
        # creating its session (waiting on the entry another worker converts and packs) accepts nothing.
        answer_by = time.monotonic() + 60
        with ThreadPoolExecutor(8) as pool:
            while len(pids) < 2 and time.monotonic() < answer_by:
                results = list(pool.map(one, range(8)))
                assert all(ok for _, ok in results)
                pids |= {pid for pid, _ in results}
                if len(pids) < 2:
                    time.sleep(0.2)
        assert len(pids) >= 2, f"only worker(s) {pids} answered"
        info = _get(url + "/info")
        assert info["engine"] == "ortmem"
        if preload:  # created once in the master, before fork
            assert info["created_pid"] == server.pid != info["pid"]
        else:
            assert info["created_pid"] == info["pid"]


# -- client errors ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A quantized embedding: ortmem's conversion gathers it with GatherBlockQuantized (behind an
    index check), and the server refuses an out-of-range id before running anything."""
    config = SynthConfig.tiny(storage="external", name="serve-q", embedding="quantized")
    return str(cached_model(config, tmp_path_factory.mktemp("synth-q")))


def _send(url: str, data: bytes, headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, dict]:
    """POST raw bytes to ``/run``; the status and the JSON answer, whatever the status."""
    req = urllib.request.Request(url + "/run", data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:  # Starlette's own 500 is text
        return status, {"text": raw[:200].decode(errors="replace")}


def _ids(values: Any, dtype: str = "<i8", shape: Any = None) -> dict:
    a = np.asarray(values, dtype=np.dtype(dtype))
    return {"dtype": dtype, "shape": list(a.shape) if shape is None else shape,
            "b64": base64.b64encode(a.tobytes()).decode()}


def _body(**inputs: Any) -> bytes:
    return json.dumps({"inputs": inputs}).encode()


#: (case, raw body, status, a piece of the reason): each a client's mistake, none a 500.
MALFORMED: list[tuple[str, bytes, int, str]] = [
    ("invalid JSON", b'{"inputs": ', 400, "not JSON"),
    ("empty body", b"", 400, "empty body"),
    ("not UTF-8", b'{"inputs": {"\xff\xfe": 1}}', 400, "not UTF-8"),
    ("body a list", b"[1, 2]", 400, "JSON object"),
    ("body a string", b'"input_ids"', 400, "JSON object"),
    ("no inputs", b'{"input_ids": 1}', 400, 'no "inputs"'),
    ("inputs a list", b'{"inputs": [[1, 2]]}', 400, '"inputs" must be an object'),
    ("inputs a string", b'{"inputs": "input_ids"}', 400, '"inputs" must be an object'),
    ("tensor a list", _body(input_ids=[[1, 2]]), 400, '"dtype", "shape", "b64"'),
    ("no b64", json.dumps({"inputs": {"input_ids": {"dtype": "<i8", "shape": [1, 1]}}}).encode(), 400, "b64"),
    ("bad base64", _body(input_ids={**_ids([[1]]), "b64": "%%%"}), 400, "not base64"),
    ("bytes short of the shape", _body(input_ids=_ids([[1, 2]], shape=[1, 3])), 400, "which takes 24"),
    ("wrong dtype", _body(input_ids=_ids([[1, 2]], "<i4")), 422, "takes int64"),
    ("object dtype", _body(input_ids={**_ids([[1]]), "dtype": "O"}), 422, "takes int64"),
    ("dtype not numpy's", _body(input_ids={**_ids([[1]]), "dtype": "nonsense"}), 400, "not a numpy dtype"),
    ("dtype a number", _body(input_ids={**_ids([[1]]), "dtype": 8}), 400, '"dtype" must be'),
    ("wrong rank", _body(input_ids=_ids([[[1, 2]]])), 422, "rank 3"),
    ("negative dim", _body(input_ids=_ids([[1]], shape=[1, -1])), 400, '"shape" must be'),
    ("shape a string", _body(input_ids=_ids([[1]], shape="1,1")), 400, '"shape" must be'),
    ("extra input", _body(input_ids=_ids([[1]]), attention_mask=_ids([[1]])), 400, "unknown input(s) ['attention_mask']"),
    ("missing input", _body(), 400, "missing input(s) ['input_ids']"),
    ("unknown output", json.dumps({"inputs": {"input_ids": _ids([[1]])}, "outputs": ["probs"]}).encode(), 400,
     "unknown output(s) ['probs']"),
    ("id = vocabulary", _body(input_ids=_ids([[1, 1000]])), 422, "index 1000 is outside [-1000, 999]"),
    ("id < -vocabulary", _body(input_ids=_ids([[-1001, 1]])), 422, "index -1001 is outside"),
    ("id = 2**62", _body(input_ids=_ids([[2**62]])), 422, "is outside"),
    ("deeply nested JSON", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),
    ("5000-digit integer", b'{"inputs": {"input_ids": {"dtype": "<i8", "shape": [1, ' + b"9" * 5000 + b'], "b64": ""}}}',
     400, "not JSON"),
    ("one input over max_input_elements", _body(input_ids={**_ids([[1]]), "shape": [1, 2**23 + 1]}), 413,
     "per input"),
    ("all inputs over max_total_elements", _body(input_ids=_ids(np.ones((1, 150_000)))), 413, "in all"),
    ("[64, 512]: its logits over max_output_elements", _body(input_ids=_ids(np.ones((64, 512)))), 413,
     "outputs would hold 32768000 elements"),
    ("body over max_body_bytes", json.dumps({"inputs": {}, "pad": "x" * (4 << 20)}).encode(), 413, "over the limit"),
]


def test_malformed_requests_are_answered_4xx_with_the_reason_and_no_traceback(quantized_model: str,
                                                                            tmp_path: Path) -> None:
    """Every mistake of a client gets its 4xx and a reason from a live server, no traceback in the log,
    before ORT runs anything (the [64, 512] request ran 37 s and kept 2.4 GiB before); the server
    still answers a valid request with ORT's outputs after them."""
    from ortmem.serve.server import decode, encode

    log = tmp_path / "gunicorn.log"
    env = {"ORTMEM_SERVE_MAX_BODY_BYTES": "4MiB", "ORTMEM_SERVE_MAX_TOTAL_ELEMENTS": "100000"}
    with _serving(quantized_model, log, env=env) as (url, _):
        wrong = []
        for case, data, status, reason in MALFORMED:
            t0 = time.monotonic()
            try:
                got, answer = _send(url, data, timeout=10)
            except OSError as exc:  # a timeout, a reset
                wrong.append(f"{case}: {exc!r}")
                continue
            if got != status or reason not in answer.get("error", ""):
                wrong.append(f"{case}: {got} {answer} (want {status}, {reason!r})")
            elif time.monotonic() - t0 > 5:
                wrong.append(f"{case}: took {time.monotonic() - t0:.1f} s")
        # A Content-Length over the limit is refused before the body is read.
        try:
            got, answer = _send(url, b"{}", headers={"Content-Length": str(10**12)}, timeout=10)
            if got != 413:
                wrong.append(f"Content-Length 10**12: {got} {answer}")
        except OSError as exc:
            wrong.append(f"Content-Length 10**12: {exc!r}")
        assert not wrong, "\n".join(wrong)
        feeds = {"input_ids": np.array([[1, 999, -1000]], np.int64)}
        got, answer = _send(url, _body(**{k: encode(v) for k, v in feeds.items()}))
        assert got == 200
        assert_close_outputs([decode(answer["outputs"]["logits"])], run_plain(quantized_model, feeds)[:1],
                             rtol=1e-5, atol=1e-3)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]


def test_ort_refusing_the_inputs_is_the_clients_422_anything_else_the_servers(model: str) -> None:
    """An ``INVALID_ARGUMENT`` from a real run (an id past ORT's Gather table) is the client's
    mistake; any other exception is not, so the server answers it 500 and logs it."""
    from ortmem.serve.request_checks import ort_client_error

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as err:
        sess.run(None, {"input_ids": np.array([[1000]], np.int64)})
    rejected = ort_client_error(err.value)
    assert rejected is not None and rejected.status == 422 and "out of data bounds" in str(rejected)
    assert ort_client_error(MemoryError()) is None
    assert ort_client_error(RuntimeError("x")) is None


@pytest.mark.slow
def test_random_malformed_requests_never_get_a_500(quantized_model: str) -> None:
    """``python -m bench.fuzz_serve``'s mutations (truncated and flipped bytes, values swapped anywhere,
    dtypes, shapes, names, ids, nesting, limits), fewer of them, against the live server it starts."""
    run = subprocess.run([sys.executable, "-m", "bench.fuzz_serve", "--model", quantized_model, "--requests", "1000",
                          "--seed", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "0 failures" in run.stdout


def test_nested_list_inputs_are_checked_not_cast() -> None:
    """The Ray deployment's wire format (nested lists) goes through the same checks: numpy alone
    would truncate 1.5 to 1, wrap 2**63 and take a ragged list as objects."""
    from ortmem.serve.request_checks import Limits, RequestRejected, TensorSpec, list_tensor

    spec = TensorSpec("input_ids", np.dtype(np.int64), ("batch", "seq"))
    limits = Limits(max_input_elements=6)
    ok = list_tensor("input_ids", [[1, 2, 3]], spec, limits)
    assert ok.dtype == np.int64 and ok.tolist() == [[1, 2, 3]]
    for value, status in [([[1.5]], 422), ([[2**63]], 422), ([[1], [1, 2]], 422), ([["a"]], 422), ([[None]], 422),
                          ([1, 2], 422), ([[1] * 7], 413)]:
        with pytest.raises(RequestRejected) as err:
            list_tensor("input_ids", value, spec, limits)
        assert err.value.status == status, (value, err.value)
