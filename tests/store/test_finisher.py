"""The background finisher (:mod:`ortmem.store.finisher`) as a session starts it: once, after the session's
first run, whatever that finisher's fate.

A finisher that fails publishes nothing and lets go of the entry's lock, so a session that started it
again on a later run would start one more process per ``run()`` (each importing onnxruntime and onnx
at the user's expense). The work left for after the first run is taken once: later runs start none.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortmem
from ortmem.onnxfile import scan
from ortmem.ort.release import capabilities
from ortmem.store import finisher
from ortmem.store.cache import Cache
from tests.support.builders import make_model
from tests.support.compare import assert_same_outputs
from tests.support.reference import CPU, run_plain

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")

FEEDS = {"x": np.random.default_rng(7).standard_normal((2, 256)).astype(np.float32)}


def _mlp(path: Path) -> Path:
    """Two fp32 MatMuls with their weights embedded in the one file (ORT packs them: worth preparing)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((256, 256)) * 0.05).astype(np.float32), f"w{i}")
             for i in range(2)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w1"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save_model(make_model(graph), str(path))
    return path


def test_a_failed_background_packing_is_started_once_not_on_every_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The model file is removed once the session exists (a deployment replacing it): the finisher the
    first run starts cannot read it and fails. Later runs, each after that finisher has exited, start
    none, and the session's outputs stay ORT's."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")  # a prepared entry for this small model too
    model = _mlp(tmp_path / "mlp.onnx")
    expected = run_plain(model, FEEDS)
    cache = tmp_path / "cache"
    session = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert session.ortmem_handoff.later is not None  # a miss ORT gets unconverted: prepared after its first run
    model.unlink()
    before = len(finisher.started_finishers())
    for _ in range(4):
        assert_same_outputs(session.run(None, FEEDS), expected)
        assert finisher.wait_background(120)  # the finisher has exited: its lock is free again
    assert len(finisher.started_finishers()) == before + 1
    assert list(Cache(cache).entries()) == []  # it failed: nothing published
