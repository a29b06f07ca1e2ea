"""``ortmem.errors.resource_failure``: ORT running out of memory, threads or descriptors is told apart from
ORT refusing what it was given, on ORT's own messages (live where a test can provoke them safely, else
as onnxruntime 1.32.0 words them under ``ulimit -v``: tests/store/test_finished_resources.py provokes
those in fresh processes)."""
from __future__ import annotations

import errno
import os
import resource
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ortmem.errors import CacheError, resource_failure
from tests.support.builders import matmul_chain, save

CPU = ["CPUExecutionProvider"]

#: onnxruntime 1.32.0's words for failures of resources (an address-space limit: creation, and its
#: thread pool; the text as ORT raises it).
RECORDED = [
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: std::bad_alloc",
    "/onnxruntime_src/onnxruntime/core/platform/posix/env.cc:327 onnxruntime::{anonymous}::PosixThread::PosixThread("
    "const char*, int, unsigned int (*)(int, Eigen::ThreadPoolInterface*), Eigen::ThreadPoolInterface*, const "
    "onnxruntime::ThreadOptions&) pthread_create failed, error code: 12 error msg: Cannot allocate memory",
    "[ONNXRuntimeError] : 1 : FAIL : Load model from m.onnx failed:system error number 24",
    "can't start new thread",
]


def _ort_error(model: object) -> Exception:
    with pytest.raises(Exception) as info:  # noqa: PT011 - ORT raises its own pybind types
        ort.InferenceSession(model, providers=CPU)
    return info.value


@pytest.fixture
def external_model(tmp_path) -> Path:
    return save(matmul_chain(np.random.default_rng(0), [64, 64, 64]), tmp_path / "m.onnx", external=True)


def test_what_ort_refuses_a_model_for_is_not_a_resource_failure(tmp_path, external_model):
    model = matmul_chain(np.random.default_rng(0), [8, 8])
    model.graph.node[0].op_type = "NoSuchOp"
    refusals = [_ort_error(model.SerializeToString()), _ort_error(b"\x08\x07not a model at all")]
    (tmp_path / "m.onnx.data").unlink()  # a missing weights file: an OS error, but no shortage
    refusals.append(_ort_error(str(external_model)))
    assert "NoSuchOp" in str(refusals[0]) and "m.onnx" in str(refusals[2])
    assert [resource_failure(e) for e in refusals] == [False, False, False]
    assert not resource_failure(str(refusals[2])) and not resource_failure(OSError(errno.ENOENT, "gone"))


@pytest.mark.parametrize("message", RECORDED)
def test_orts_words_for_a_shortage_are_resource_failures(message):
    assert resource_failure(message)
    assert resource_failure(RuntimeError(message))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NOFILE as Linux applies it")
def test_no_file_descriptor_left_is_a_resource_failure(external_model):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert resource_failure(exc)  # Python's own EMFILE
        failure = _ort_error(str(external_model))  # ORT names only the number
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert resource_failure(failure), failure


def test_a_shortage_behind_ortmems_own_error_is_found():
    try:
        try:
            raise MemoryError()
        except MemoryError as exc:
            raise CacheError("could not save the prepared model", file="m.onnx") from exc
    except CacheError as wrapped:
        assert resource_failure(wrapped)
    assert not resource_failure(CacheError("content changed", file="m.onnx"))
    assert not resource_failure(onnx.checker.ValidationError("bad graph"))
