"""ortmem.plan.estimate.liveness: live bytes per step over ORT's two orders, the peak, what is alive across it;
numbers worked out by hand on small graphs, and the replay checked against ORT's own profile."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ortmem.plan.estimate import activations as act
from ortmem.plan.estimate.liveness import by_order, context, liveness, render
from tests.support.planner_graphs import N, graph_model, i64, long_cast, two_branches

F, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64


def diamond() -> onnx.ModelProto:
    """a = Neg(x), b = Neg(a), c = Add(a, b), y = Neg(c): every tensor 4 KiB."""
    return graph_model([helper.make_node("Neg", ["x"], ["a"], name="a"),
                        helper.make_node("Neg", ["a"], ["b"], name="b"),
                        helper.make_node("Add", ["a", "b"], ["c"], name="c"),
                        helper.make_node("Neg", ["c"], ["y"], name="y")],
                       [helper.make_tensor_value_info("x", F, [N])], [helper.make_tensor_value_info("y", F, [N])])


def test_diamond_by_hand(tmp_path):
    path = tmp_path / "d.onnx"
    onnx.save(diamond(), path)
    for order in ("DEFAULT", "PRIORITY_BASED"):
        lv = liveness(path, order=order)
        assert [s.node for s in lv.steps] == ["a", "b", "c", "y"]
        # a; a+b; a+b+c (a and b die at c); c+y (y is a graph output, alive to the end)
        assert [s.live_bytes for s in lv.steps] == [4096, 8192, 12288, 8192]
        assert lv.peak_bytes == 12288 and lv.peak_node == "c"
        assert sorted(t.name for t in lv.alive_at_peak) == ["a", "b", "c"]
        assert lv.across_peak == []  # the peak node reads everything alive at it
        y = next(t for t in lv.tensors if t.name == "y")
        assert y.end == len(lv.steps)  # graph outputs live to the end of the run


def test_long_lived_cast_is_alive_across_the_peak(tmp_path):
    path = tmp_path / "c.onnx"
    onnx.save(long_cast(), path)
    lv = liveness(path)
    assert [s.node for s in lv.steps] == ["cast", "sin", "tile", "slice", "add"]
    # c 8K; c+p 16K; c+p+big 80K; c+big+q 80K; c+q+y 24K
    assert [s.live_bytes // 1024 for s in lv.steps] == [8, 16, 80, 80, 24]
    assert lv.peak_bytes == 80 * 1024 and lv.peak_position == 2
    across = lv.across_peak
    assert [t.name for t in across] == ["c"] and across[0].nbytes == 8 * N
    assert across[0].consumers == [1, 4] and across[0].dims == [N]
    assert "alive across the peak" in render(lv)


def test_orders_differ_and_both_are_reported(tmp_path):
    m = two_branches()
    path = tmp_path / "o.onnx"
    onnx.save(m, path)
    lv = by_order(context(path))
    assert [s.node for s in lv["PRIORITY_BASED"].steps] == ["q1", "q2", "p1", "p2", "y"]
    assert [s.node for s in lv["DEFAULT"].steps] == ["p1", "p2", "q1", "q2", "y"]
    # PRIORITY: q1 32K; q1+q2 36K; q2+p1 20K; ...   DEFAULT: p1 16K; p1+p2 20K; p2+q1 36K; q1+q2+p2 40K
    assert lv["PRIORITY_BASED"].peak_bytes == 36 * 1024
    assert lv["DEFAULT"].peak_bytes == 40 * 1024


def test_inplace_follows_ort_cpu(tmp_path):
    # Relu writes in place (MayInplace on ORT's CPU EP) when ORT can prove the shapes equal; Add never
    r = graph_model([helper.make_node("Neg", ["x"], ["a"], name="a"), helper.make_node("Relu", ["a"], ["b"], name="b"),
                     helper.make_node("Neg", ["b"], ["y"], name="y")],
                    [helper.make_tensor_value_info("x", F, [N])], [helper.make_tensor_value_info("y", F, [N])])
    path = tmp_path / "r.onnx"
    onnx.save(r, path)
    assert [s.live_bytes for s in liveness(path).steps] == [4096, 4096, 8192]
    # symbolic dim: "n" is named, so still provably equal
    r.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    r.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "n"
    onnx.save(r, path)
    assert [s.live_bytes for s in liveness(path, {"n": N}).steps] == [4096, 4096, 8192]
    assert "Add" not in act.ORT_CPU_INPLACE_OPS and "Relu" in act.ORT_CPU_INPLACE_OPS


def test_where_scratch_is_counted(tmp_path):
    # ORT's CPU Where selects into two temporaries of the output's size (measured: +2x output)
    m = graph_model([helper.make_node("Greater", ["x", "zero_f"], ["b"], name="gt"),
                     helper.make_node("Where", ["b", "x", "zero_f"], ["y"], name="where")],
                    [helper.make_tensor_value_info("x", F, [N])], [helper.make_tensor_value_info("y", F, [N])],
                    [numpy_helper.from_array(np.array(0, np.float32), "zero_f")])
    path = tmp_path / "w.onnx"
    onnx.save(m, path)
    lv = liveness(path)
    assert lv.steps[1].workspace_bytes == 2 * 4096
    assert lv.steps[1].live_bytes == 1024 + 4096 + 2 * 4096


def test_replay_matches_ort_profile(tmp_path):
    """Our order and live bytes against ORT's profiler (ORT_DISABLE_ALL, arena on, patterns off)."""
    path = tmp_path / "c.onnx"
    onnx.save(long_cast(), path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_mem_pattern = False
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    sess.run(None, {"x": np.ones(N, np.float32)})
    with open(sess.end_profiling()) as f:
        ev = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    if ev and "mem_bytes_in_use" not in ev[0]["args"]:
        pytest.skip(f"onnxruntime {ort.__version__}'s profiler reports no mem_bytes_in_use per node")
    lv = liveness(path)
    assert [e["name"][:-len("_kernel_time")] for e in ev] == [s.node for s in lv.steps]
    peak_in_use = max(int(e["args"]["mem_bytes_in_use"]) for e in ev) - \
        (int(ev[0]["args"]["mem_bytes_in_use"]) - int(ev[0]["args"]["mem_in_use_delta"]))
    assert abs(peak_in_use - lv.peak_bytes) <= 8 * 1024  # ORT frees a node's dead inputs one step later


def test_unknown_dims_are_reported(tmp_path):
    m = long_cast()
    for vi in (m.graph.input[0], m.graph.output[0]):
        vi.type.tensor_type.shape.dim[0].dim_param = "n"
    path = tmp_path / "u.onnx"
    onnx.save(m, path)
    lv = liveness(path)  # n not given
    assert lv.unknown and lv.peak_bytes < 80 * 1024
    assert liveness(path, {"n": N}).peak_bytes == 80 * 1024
