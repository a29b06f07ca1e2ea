"""A cold start's conversion in a helper process (:mod:`ortmem.session.cold_start_child`), on real
files, in fresh processes (the test process has onnx imported already): the session's process imports
no onnx, its outputs are bit-identical to ORT's on the original model, a second start finds the
entry, and every outcome the helper does not publish is the in-process start's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortmem.onnxfile.scan import (HELPER_MIN_BYTES_ENV, INLINE_MAX_BYTES, MIN_HELPER_BYTES, min_helper_bytes, model_files_bytes)
from ortmem.ort.release import capabilities
from tests.support.builders import int4_model, make_model, save
from tests.support.compare import assert_same_outputs

CHILD = """
import json, sys
import numpy as np
import ortmem
s = ortmem.InferenceSession(sys.argv[1])
x = np.random.default_rng(7).standard_normal((1, 256), dtype=np.float32)
out = s.run(None, {"x": x})[0]
h = s.ortmem_handoff
print(json.dumps({"action": s.ortmem_action, "in_helper": h.converted_in_helper,
                  "converted": h.report.converted if h.report is not None else None,
                  "packs_later": h.later is not None, "onnx": "onnx" in sys.modules,
                  "out": out.tolist()}))
"""


def _start(model: Path, cache: Path, tmp: Path, **env: str) -> dict:
    # The release's probe answers are kept (in the run's probe folder, which children inherit) before a
    # child starts: a child that probed would first look for them in its per-user folder in ``tmp``.
    capabilities()
    done = subprocess.run([sys.executable, "-c", CHILD, str(model)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ORTMEM_CACHE_DIR": str(cache), "TMPDIR": str(tmp), **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


#: The names a temporary file or folder of ortmem's own can have: every one ortmem makes starts with
#: "ortmem", and one made without a name (``tempfile``'s default prefix) by what the helper runs would
#: be its leftover too. What onnxruntime writes there itself is not (a ``.ses`` file on import;
#: 1.30.0's ``mat-debug-<pid>.log``), and differs by release.
OWN_PREFIXES = ("ortmem", tempfile.gettempprefix())


def _ortmem_leftovers(tmp: Path) -> list[str]:
    """What ortmem left in ``tmp`` (see :data:`OWN_PREFIXES`)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(OWN_PREFIXES))


def _ort_output(model: Path) -> np.ndarray:
    x = np.random.default_rng(7).standard_normal((1, 256), dtype=np.float32)
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture
def qdq_file(tmp_path: Path) -> Path:
    return save(int4_model(np.random.default_rng(0)), tmp_path / "model" / "model.onnx")


def test_a_cold_start_converts_in_a_helper_and_imports_no_onnx(qdq_file: Path, tmp_path: Path) -> None:
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    cold = _start(qdq_file, cache, tmp, **{HELPER_MIN_BYTES_ENV: "0"})
    assert cold["action"] == "converted" and cold["in_helper"] and cold["converted"] == 1, cold
    assert not cold["onnx"]
    assert_same_outputs([np.array(cold["out"], np.float32)], [_ort_output(qdq_file)])
    second = _start(qdq_file, cache, tmp, **{HELPER_MIN_BYTES_ENV: "0"})
    assert second["action"] in ("cache-hit", "finished") and not second["in_helper"], second
    assert second["out"] == cold["out"]
    assert _ortmem_leftovers(tmp) == []  # nothing of the helper's left in the temporary folder


def test_below_the_size_threshold_the_conversion_stays_in_the_sessions_process(qdq_file: Path, tmp_path: Path) -> None:
    assert model_files_bytes(qdq_file) < MIN_HELPER_BYTES
    cold = _start(qdq_file, tmp_path / "cache", tmp_path)
    assert cold["action"] == "converted" and not cold["in_helper"] and cold["onnx"], cold
    assert_same_outputs([np.array(cold["out"], np.float32)], [_ort_output(qdq_file)])


def test_what_the_helper_does_not_publish_the_start_does_itself(tmp_path: Path) -> None:
    """DequantizeLinear feeding an Add: nothing ORT would fuse, so the helper publishes nothing and
    the session's process hands the model over as an in-process start does (and leaves nothing behind:
    the weight is embedded above the inline limit, so each process hands over a skeleton it writes
    into a temporary folder of its own, removed once it is done)."""
    rng = np.random.default_rng(1)
    codes = rng.integers(-8, 8, (32, 256), dtype=np.int8)
    assert codes.nbytes > INLINE_MAX_BYTES
    w = helper.make_tensor("Wq", TensorProto.INT8, list(codes.shape), codes.tobytes(), raw=True)
    s = helper.make_tensor("Ws", TensorProto.FLOAT, [], [0.05])
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Wq", "Ws"], ["W"]), helper.make_node("Add", ["x", "W"], ["y"])],
        "dq-add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(codes.shape))], [w, s])
    model = save(make_model(graph), tmp_path / "m" / "model.onnx")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with_helper = _start(model, tmp_path / "cache-a", tmp, **{HELPER_MIN_BYTES_ENV: "0"})
    in_process = _start(model, tmp_path / "cache-b", tmp)
    assert with_helper["action"] == in_process["action"] and not with_helper["in_helper"], (with_helper, in_process)
    assert with_helper["out"] == in_process["out"]
    assert_same_outputs([np.array(with_helper["out"], np.float32)], [_ort_output(model)])
    assert _ortmem_leftovers(tmp) == []


def test_concurrent_cold_starts_share_one_entry(qdq_file: Path, tmp_path: Path) -> None:
    """Two processes starting at once: their helpers meet at the entry's creator lock, one builds and
    the other's start loads what it built."""
    cache = tmp_path / "cache"
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(cache), HELPER_MIN_BYTES_ENV: "0"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(qdq_file)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    actions = sorted(r["action"] for r in results)
    assert "converted" in actions and set(actions) <= {"converted", "cache-hit", "finished"}, actions
    assert results[0]["out"] == results[1]["out"]
    assert len([e for e in (cache / "converted").iterdir() if e.is_dir() and len(e.name) == 32]) == 1


def test_the_size_counts_the_model_and_the_data_named_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model.onnx").write_bytes(b"x" * 100)
    (tmp_path / "model.onnx.data").write_bytes(b"x" * 1000)
    (tmp_path / "other.bin").write_bytes(b"x" * 10000)
    assert model_files_bytes(tmp_path / "model.onnx") == 1100
    monkeypatch.setenv(HELPER_MIN_BYTES_ENV, "1 KiB")
    assert min_helper_bytes() == 1024
    monkeypatch.setenv(HELPER_MIN_BYTES_ENV, "lots")
    assert min_helper_bytes() == MIN_HELPER_BYTES


def _converts_here_after_one_warning(qdq_file: Path, cache: Path, caplog: pytest.LogCaptureFixture,
                                     warned: str) -> None:
    """A cold start whose helper failed: converted in this process, ``warned`` logged once, ORT's outputs."""
    import logging

    import ortmem

    with caplog.at_level(logging.WARNING, logger="ortmem"):
        s = ortmem.InferenceSession(str(qdq_file), cache=str(cache))
    assert s.ortmem_action == "converted" and not s.ortmem_handoff.converted_in_helper
    assert len([r for r in caplog.records if warned in r.getMessage()]) == 1
    x = np.random.default_rng(7).standard_normal((1, 256), dtype=np.float32)
    assert_same_outputs(s.run(None, {"x": x}), [_ort_output(qdq_file)])


def test_a_helper_that_does_not_answer_in_time_leaves_the_start_to_convert_itself(
        qdq_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The wait for a helper is bounded: past it the helper is killed, one warning says so, and the
    start converts in its own process (outputs ORT's)."""
    from ortmem.session import cold_start_child

    monkeypatch.setenv(HELPER_MIN_BYTES_ENV, "0")
    monkeypatch.setattr(cold_start_child, "helper_timeout", lambda model_bytes: 0.01)
    _converts_here_after_one_warning(qdq_file, tmp_path / "cache", caplog, "did not answer")


def test_a_helper_that_cannot_start_leaves_the_start_to_convert_itself(
        qdq_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No interpreter to start (an embedding host's ``sys.executable``): one warning, and the start
    converts in its own process; no OSError reaches the caller."""
    from types import SimpleNamespace

    from ortmem.session import cold_start_child

    monkeypatch.setenv(HELPER_MIN_BYTES_ENV, "0")
    monkeypatch.setattr(cold_start_child, "sys", SimpleNamespace(executable=str(tmp_path / "no-python")))
    _converts_here_after_one_warning(qdq_file, tmp_path / "cache", caplog, "could not start the conversion helper")


HELPER_RECORDING = """
import sys
import ortmem.passes.engine as engine
import ortmem.store.writer as writer
real = engine.write_weights
def recording(*a, threads=None, **k):
    sys.stderr.write(f"threads={threads}\\n")
    return real(*a, threads=threads, **k)
writer.write_weights = recording
from ortmem.session.cold_start_child import main
main()
"""


def test_the_helper_converts_on_the_caller_s_intra_op_threads(qdq_file: Path, tmp_path: Path) -> None:
    """The helper process, given a job as the session's process pickles it, converts on the thread
    count the caller's intra_op_num_threads asks for (as ORT's own fusion would), and publishes."""
    import pickle

    from ortmem.session.cold_start_child import Job, Published
    from ortmem.ort.settings import session_settings

    cache = tmp_path / "cache" / "converted"
    job = Job(str(qdq_file), str(cache), "full", session_settings(), None, 3)
    done = subprocess.run([sys.executable, "-c", HELPER_RECORDING], input=pickle.dumps(job), capture_output=True,
                          timeout=300, env={**os.environ, "ORTMEM_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert "threads=3" in done.stderr.decode().split(), done.stderr
    answer = pickle.loads(done.stdout)
    assert isinstance(answer, Published) and (cache / answer.key / "weights.bin").is_file()
