"""Which of ORT's CPU kernels write their output into a dying input, and which take scratch from the arena.

    python -m bench.recompute.inplace

One op on a fresh 4 MiB activation (``Relu(x)``, static shapes, ``ORT_DISABLE_ALL``, memory patterns
off), ORT's profiler per node: ``mem_bytes_in_use`` after the op minus after the fresh tensor is 0 when
the op wrote in place and 4 MiB when it allocated; ``mem_in_use_peak`` above ``mem_bytes_in_use`` is
scratch the kernel took and gave back while it ran. The results are
``ortmem.plan.estimate.activations.ORT_CPU_INPLACE_OPS`` and ``kernel_temporaries`` (onnxruntime 1.31.1:
activations and Softmax in place; binary element-wise ops, Neg/Sqrt/Exp/Log/Erf/Abs/Floor/Ceil/
Reciprocal, Gelu variants, Dropout not; Where takes 2x its output as scratch).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as H
from onnx import numpy_helper as nh

N = 1 << 20  # floats: 4 MiB
MiB = 1 << 20


def measure(op: str, *, extra: tuple[str, ...] = (), second: bool = False, attrs: dict | None = None,
            out_type: int = T.FLOAT, domain: str = "") -> tuple[float, float]:
    """(MiB allocated by the op's output, MiB of scratch while it ran)."""
    nodes = [H.make_node("Relu", ["x"], ["a"], name="fresh")]
    ins = ["a", *extra]
    if second:
        nodes.append(H.make_node("Relu", ["x"], ["b"], name="fresh2"))
        ins = ["a", "b"]
    nodes += [H.make_node(op, ins, ["y"], name="op", domain=domain, **(attrs or {})),
              H.make_node("Identity", ["y"], ["z"], name="out")]
    inits = [nh.from_array(np.array(2.0, np.float32), "c"), nh.from_array(np.array(0.0, np.float32), "zero")]
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", T.FLOAT, [N])],
                     [H.make_tensor_value_info("z", out_type, None)], [i for i in inits if i.name in ins])
    opsets = [H.make_opsetid("", 17)] + ([H.make_opsetid("com.microsoft", 1)] if domain else [])
    m = H.make_model(g, opset_imports=opsets, ir_version=10)
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "p")
        so.enable_mem_pattern = False
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        s.run(None, {"x": np.random.default_rng(0).standard_normal(N).astype(np.float32)})
        with open(s.end_profiling()) as f:
            ev = {e["name"]: e["args"] for e in json.load(f) if e.get("cat") == "Node"}
    before = int(ev["fresh2_kernel_time" if second else "fresh_kernel_time"]["mem_bytes_in_use"])
    after = ev["op_kernel_time"]
    return (int(after["mem_bytes_in_use"]) - before) / MiB, \
        (int(after["mem_in_use_peak"]) - int(after["mem_bytes_in_use"])) / MiB


CASES = [
    ("Add", dict(extra=("c",))), ("Add", dict(second=True)), ("Sub", dict(extra=("c",))), ("Mul", dict(extra=("c",))),
    ("Div", dict(extra=("c",))), ("Pow", dict(extra=("c",))), ("Sum", dict(second=True)), ("Max", dict(second=True)),
    ("Neg", {}), ("Sqrt", {}), ("Exp", {}), ("Log", {}), ("Erf", {}), ("Abs", {}), ("Floor", {}), ("Ceil", {}),
    ("Reciprocal", {}), ("Dropout", {}), ("Relu", {}), ("LeakyRelu", {}), ("Sigmoid", {}), ("Tanh", {}),
    ("Softplus", {}), ("Softsign", {}), ("Elu", {}), ("Selu", {}), ("Celu", {}), ("HardSigmoid", {}),
    ("ThresholdedRelu", {}), ("Shrink", {}), ("Clip", {}), ("Softmax", {}), ("LogSoftmax", {}),
    ("Cast", dict(attrs={"to": T.DOUBLE}, out_type=T.DOUBLE)),
    ("Gelu", dict(domain="com.microsoft")), ("FastGelu", dict(domain="com.microsoft")),
    ("QuickGelu", dict(domain="com.microsoft")),
]


def where_scratch() -> tuple[float, float]:
    """Where(x > 0, x, 0) on 4 MiB: (output MiB, scratch MiB)."""
    nodes = [H.make_node("Greater", ["x", "zero"], ["b"], name="gt"),
             H.make_node("Where", ["b", "x", "zero"], ["y"], name="where")]
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", T.FLOAT, [N])], [H.make_tensor_value_info("y", T.FLOAT, [N])],
                     [nh.from_array(np.array(0.0, np.float32), "zero")])
    m = H.make_model(g, opset_imports=[H.make_opsetid("", 17)], ir_version=10)
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "p")
        so.enable_mem_pattern = False
        so.log_severity_level = 3
        s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        s.run(None, {"x": np.random.default_rng(0).standard_normal(N).astype(np.float32)})
        with open(s.end_profiling()) as f:
            ev = {e["name"]: e["args"] for e in json.load(f) if e.get("cat") == "Node"}
    a, w = ev["gt_kernel_time"], ev["where_kernel_time"]
    return (int(w["mem_bytes_in_use"]) - int(a["mem_bytes_in_use"])) / MiB, \
        (int(w["mem_in_use_peak"]) - int(w["mem_bytes_in_use"])) / MiB


def main() -> int:
    print(f"onnxruntime {ort.__version__}; output MiB (4 = new buffer, 0 = in place), scratch MiB")
    for op, kw in CASES:
        try:
            out, scratch = measure(op, **kw)
            print(f"{op:16} {str(kw)[:44]:44} output {out:5.2f}  scratch {scratch:5.2f}")
        except Exception as e:  # noqa: BLE001 - an op this build lacks
            print(f"{op:16} not measured: {str(e)[:80]}")
    out, scratch = where_scratch()
    print(f"{'Where':16} {'(x > 0, x, 0)':44} output {out:5.2f}  scratch {scratch:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
