"""ortmem's DQ+Gather -> GatherBlockQuantized rewrite never changes whether a run is valid.

ORT's Gather fails a run with ``INVALID_ARGUMENT`` for an index outside ``[-n, n)``; its
GatherBlockQuantized kernel writes a row of zeros instead. The rewrite therefore passes the indices
through an ONNX Gather over ``arange(n)`` first (``ortmem.passes.rules.dq_gather``). These tests hold
ortmem's sessions, in memory (``cache=False``) and from a cache entry, to plain ORT on the original
QDQ model: the same exception type where ORT raises, bit-identical outputs where it does not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as H
from onnx import numpy_helper as nh

import ortmem
from ortmem.store.cache import Cache
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.compare import assert_same_outputs
from tests.support.dq_graphs import GATHER_VARIANTS
from tests.support.release_expect import gather_refusal

Outcome = tuple[str, object]  # ("raised", exception type) or ("ran", outputs)


def boundary_ids(n: int) -> list[int]:
    """The last row, one past it, the most negative valid index, one below it, and a huge id."""
    return [n - 1, n, -n, -n - 1, 2**40]


def outcome(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> Outcome:
    try:
        return "ran", sess.run(None, feeds)
    except Exception as exc:  # the type is what is compared
        return "raised", type(exc)


def assert_same_outcome(got: Outcome, want: Outcome, what: str) -> None:
    assert got[0] == want[0], f"{what}: ortmem {got[0]}, plain ORT {want[0]}"
    if want[0] == "raised":
        assert got[1] is want[1], f"{what}: ortmem raised {got[1]}, plain ORT {want[1]}"
    else:
        assert_same_outputs(got[1], want[1])


def ortmem_sessions(path: Path, cache: Path) -> dict[str, ort.InferenceSession]:
    """The two ways ortmem hands a converted model to ORT: in memory, and from a cache entry."""
    return {"memory": ortmem.InferenceSession(path, cache=False), "cache": ortmem.InferenceSession(path, cache=cache)}


def gbq_count(sessions: dict[str, ort.InferenceSession], cache: Path) -> dict[str, int]:
    """How many GatherBlockQuantized nodes each session's converted graph holds."""
    (entry,) = Cache(cache).entries()
    graphs = {"memory": onnx.load_from_string(sessions["memory"].ortmem_handoff.memory.skeleton),
              "cache": onnx.load(str(entry.model_path), load_external_data=False)}
    return {k: sum(n.op_type == "GatherBlockQuantized" for n in g.graph.node) for k, g in graphs.items()}


@pytest.mark.usefixtures("no_temp_folder")
@pytest.mark.parametrize("variant", sorted(GATHER_VARIANTS))
def test_gbq_out_of_range_ids_fail_as_in_plain_ort(tmp_path: Path, variant: str) -> None:
    kw = GATHER_VARIANTS[variant]
    config = SynthConfig.tiny(embedding="quantized", **kw)
    (tmp_path / "m").mkdir()
    path = write_model(config, tmp_path / "m" / "model.onnx")
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sessions = ortmem_sessions(path, tmp_path / "cache")
    refused = gather_refusal(kw.get("weight_type", "int4"), bool(kw.get("zero_points")), "float32")
    assert gbq_count(sessions, tmp_path / "cache") == {"memory": 0 if refused else 1, "cache": 0 if refused else 1}
    for bad in boundary_ids(config.vocab):
        feeds = {"input_ids": np.array([[1, bad, 3]], np.int64)}
        want = outcome(plain, feeds)
        for how, sess in sessions.items():
            assert_same_outcome(outcome(sess, feeds), want, f"{variant}, {how}, id {bad}")
    assert [outcome(plain, {"input_ids": np.array([[i]], np.int64)})[0] for i in boundary_ids(config.vocab)] == \
        ["ran", "raised", "ran", "raised", "raised"]  # the boundaries are where ORT says they are


def dq_gather_model(idx_type: int, gather_axis: int, rows: int = 12, cols: int = 48) -> onnx.ModelProto:
    """DQ(int4 [rows, cols], blocks of 16 along axis 1) -> Gather(axis): the smallest graph the
    rewrite takes, with int32 or int64 indices, gathering rows or columns."""
    rng = np.random.default_rng(20 + idx_type + gather_axis)
    import ml_dtypes  # onnx's own dependency

    table = nh.from_array(rng.integers(-8, 8, (rows, cols)).astype(ml_dtypes.int4), "W")
    scales = nh.from_array((rng.random((rows, cols // 16)) + 0.5).astype(np.float32), "S")
    nodes = [H.make_node("DequantizeLinear", ["W", "S"], ["Wd"], name="dq", axis=1, block_size=16),
             H.make_node("Gather", ["Wd", "ids"], ["Y"], name="gather", axis=gather_axis)]
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("ids", idx_type, None)],
                         [H.make_tensor_value_info("Y", T.FLOAT, None)], [table, scales])
    return H.make_model(graph, ir_version=10, opset_imports=[H.make_opsetid("", 21)])


@pytest.mark.usefixtures("no_temp_folder")
@pytest.mark.parametrize("idx_type", [T.INT32, T.INT64], ids=["int32", "int64"])
@pytest.mark.parametrize("gather_axis", [0, 1], ids=["rows", "columns"])
def test_gbq_bounds_follow_index_type_and_axis(tmp_path: Path, idx_type: int, gather_axis: int) -> None:
    """int32 indices, and a Gather along the columns (bounded by the column count, not the rows)."""
    m = dq_gather_model(idx_type, gather_axis)
    path = tmp_path / "m" / "model.onnx"
    path.parent.mkdir()
    onnx.save(m, path)
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sessions = ortmem_sessions(path, tmp_path / "cache")
    assert gbq_count(sessions, tmp_path / "cache") == {"memory": 1, "cache": 1}
    n = [int(d) for d in m.graph.initializer[0].dims][gather_axis]
    np_type = np.int32 if idx_type == T.INT32 else np.int64
    for bad in boundary_ids(n)[:4] + ([2**31 - 1] if idx_type == T.INT32 else [2**40]):
        feeds = {"ids": np.array([[0, bad], [bad, n // 2]], np_type)}
        want = outcome(plain, feeds)
        for how, sess in sessions.items():
            assert_same_outcome(outcome(sess, feeds), want, f"axis {gather_axis}, {how}, id {bad}")
