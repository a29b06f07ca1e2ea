"""ortmem.ort.value_types: the fusion rules' value types come from the installed ORT's own
Graph::Resolve, without weight bytes, and from onnx only where ORT cannot answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnx.shape_inference
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortmem.ort.value_types import TypeInfo, ValueTypes, onnx_inferred_types
from ortmem.passes.rules.dq_matmul_match import dq_matmul_match
from ortmem.measure.synth import SynthConfig, build_model
from tests.support.paths import REPO

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opsets=(("", 17), ("com.microsoft", 1))) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=8)


def _ort_output_types(model: onnx.ModelProto, names: list[str]) -> dict[str, TypeInfo]:
    """What an initialized ORT session reports for ``names`` made graph outputs (the reference)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in names:
        m.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    out = {}
    for o in sess.get_outputs():
        elem = {"tensor(float)": F, "tensor(float16)": TensorProto.FLOAT16}[o.type]
        out[o.name] = TypeInfo(elem, [("v", d) if isinstance(d, int) else ("p", d) if d else ("?", None)
                                      for d in o.shape])
    return out


def _contrib_model() -> onnx.ModelProto:
    """X -> MatMul -> com.microsoft.FastGelu -> MatMul: FastGelu's output is typed by ORT's contrib
    schema, which onnx does not have; dim 1 of X has neither a value nor a name."""
    w1 = numpy_helper.from_array(np.ones((4, 8), np.float32), "W1")
    w2 = numpy_helper.from_array(np.ones((8, 3), np.float32), "W2")
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["H"]),
             helper.make_node("FastGelu", ["H"], ["G"], domain="com.microsoft"),
             helper.make_node("MatMul", ["G", "W2"], ["Y"])]
    x = helper.make_tensor_value_info("X", F, ["batch", None, 4])
    return _model(nodes, [x], [helper.make_tensor_value_info("Y", F, None)], [w1, w2])


def test_main_graph_types_are_the_ones_ort_reports() -> None:
    model = _contrib_model()
    types = ValueTypes(model)
    reference = _ort_output_types(model, ["H", "G"])
    for name in ("H", "G", "Y"):
        assert types.get("", name) == reference[name], name
    # ORT's contrib schema types FastGelu's output; onnx cannot, and names unknown dims "unk__N"
    assert types.get("", "G") == TypeInfo(F, [("p", "batch"), ("?", None), ("v", 8)])
    by_onnx = onnx_inferred_types(model)[""]
    assert by_onnx.get("G") is None or by_onnx["G"].shape is None
    assert by_onnx["H"].shape[1][0] == "p" and by_onnx["H"].shape[1][1].startswith("unk__")


def test_a_model_without_subgraphs_never_runs_onnx_inference(monkeypatch) -> None:
    """The fusion matcher's shape questions (MatMulAddFusion on every residual Add of a decoder) are
    answered by ORT alone: onnx's schema registry, never freed, is not built for them."""
    calls = []
    real = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = build_model(SynthConfig.tiny())
    result = dq_matmul_match(model)
    assert result.candidates and not calls
    # and the answers are the same as onnx's inference gave on this model
    monkeypatch.setattr("ortmem.ort.value_types.ort_resolved_types", lambda m: None)
    assert dq_matmul_match(model) == result and calls


def test_subgraph_values_and_big_subgraph_tensors() -> None:
    """A big initializer inside an If branch moves up for ORT (its checker refuses it without bytes);
    the main graph is still typed by ORT, the branch's own values by onnx."""
    big = numpy_helper.from_array(np.ones((8, 256), np.float32), "BW")  # 8 KiB: a stand-in without bytes
    then = helper.make_graph([helper.make_node("MatMul", ["G", "BW"], ["T"])], "then", [],
                             [helper.make_tensor_value_info("T", F, None)], [big])
    other = helper.make_graph([helper.make_node("MatMul", ["G", "BW2"], ["E"])], "else", [],
                              [helper.make_tensor_value_info("E", F, None)],
                              [numpy_helper.from_array(np.ones((8, 256), np.float32), "BW2")])
    model = _contrib_model()
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    model.graph.node.append(helper.make_node("If", ["cond"], ["O"], then_branch=then, else_branch=other))
    model.graph.output.append(helper.make_tensor_value_info("O", F, None))
    types = ValueTypes(model)
    assert types.get("", "G") == TypeInfo(F, [("p", "batch"), ("?", None), ("v", 8)])  # ORT's answer
    assert types.get("", "O").elem_type == F
    assert types.get("If#3/then_branch", "T") is not None  # the branch's value, from onnx


def test_models_ort_refuses_fall_back_to_onnx() -> None:
    """An op domain ORT knows only through a custom-op library: onnx's inference and the declared types."""
    model = _contrib_model()
    model.opset_import.append(helper.make_opsetid("my.ops", 1))
    model.graph.node.append(helper.make_node("Mystery", ["Y"], ["Z"], domain="my.ops"))
    model.graph.value_info.append(helper.make_tensor_value_info("Z", F, [2, 3]))
    types = ValueTypes(model)
    assert types.get("", "Z") == TypeInfo(F, [("v", 2), ("v", 3)])  # declared
    by_onnx = onnx_inferred_types(model)[""]["H"]
    assert types.get("", "H") == by_onnx and by_onnx.shape[1][1].startswith("unk__")  # onnx's naming


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_weight_bytes_are_never_copied() -> None:
    """128 MiB embedded in the model: resolving its types raises the process's peak by far less."""
    code = textwrap.dedent("""
        import json, numpy as np
        from onnx import TensorProto, helper, numpy_helper
        from ortmem.base import procfs
        from ortmem.ort.value_types import ValueTypes
        w = numpy_helper.from_array(np.ones((4096, 8192), np.float32), "W")
        g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("Relu", ["H"], ["Y"])],
                              "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", 4096])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [w])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        del w
        before = procfs.read_status("self")["VmRSS"]
        ok = procfs.reset_hwm()
        t = ValueTypes(m).get("", "H")
        print(json.dumps({"ok": ok, "rise": procfs.read_status("self")["VmHWM"] - before, "shape": t.shape}))
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    env=env).stdout.splitlines()[-1])
    if not out["ok"]:
        pytest.skip("this kernel does not reset VmHWM")
    assert out["shape"] == [["p", "b"], ["v", 8192]]
    assert out["rise"] < 32 << 20, out  # ORT's environment and the copy: MiBs, never the 128 MiB weight
