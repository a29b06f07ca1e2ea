"""The server recipe (ortmem.serve under gunicorn with uvicorn workers), over loopback only, and fork
safety: a session created before ``fork()`` keeps working in the children."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.measure.inputs import make_inputs
from ortmem.synth import SynthConfig, cached_model

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


@pytest.mark.slow
@pytest.mark.parametrize("preload", [False, True], ids=["per-worker", "preload"])
def test_gunicorn_uvicorn_workers_serve_what_ort_computes(model: str, preload: bool, tmp_path: Path) -> None:
    pytest.importorskip("gunicorn")
    pytest.importorskip("uvicorn_worker")
    pytest.importorskip("starlette")
    from ortmem.serve import decode, encode

    port = _free_port()
    workers = 2
    cmd = [sys.executable, "-m", "gunicorn", "-w", str(workers), "-k", "uvicorn_worker.UvicornWorker",
           "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "5", "ortmem.serve:app"]
    if preload:
        cmd.insert(-1, "--preload")
    env = {**os.environ, "ORTMEM_SERVE_MODEL": model, "ORTMEM_SERVE_THREADS": "1"}
    log = open(tmp_path / "gunicorn.log", "w+b")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                info = _get(url + "/info")
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "gunicorn.log").read_text()
                assert time.monotonic() < deadline, "server did not answer in 60 s"
                time.sleep(0.2)
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
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the master stops its workers
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
