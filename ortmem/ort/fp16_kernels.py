"""What the installed ORT build's CPU EP does with fp16: which ops have fp16 kernels, and whether
the MatMulNBits ORT fuses from an fp16 DQ+MatMul runs in fp32.

Why in ``ortmodel``: the answers depend on the build and the CPU (x86-64 has no ``MatMul<MLFloat16>``
on the CPU EP; ARM64 builds with fp16 vector intrinsics do), not on the model, so they are asked of
the installed ORT itself, once per process, beside the other knowledge of the installed release.
:mod:`ortmem.passes.rules.dq_matmul` uses them to emit a fused fp16 node as ORT's own session ends up
with it.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@functools.lru_cache(maxsize=None)
def runs_fp16_matmulnbits_in_fp32(op: str = "MatMul") -> bool:
    """Does this ORT build run the MatMulNBits it fuses from an fp16 DQ+``op`` in fp32 on the CPU EP?

    Why it can: partitioning (``InferenceSession::TransformGraph``) runs *before* the Level-2
    ``DQMatMulToMatMulNBits``. When the CPU EP has no fp16 kernel for ``op`` (x86-64: no
    ``MatMul<MLFloat16>``), the fp16 MatMul stays unassigned, the fused MatMulNBits inherits that,
    and ``InsertCastTransformer`` (``onnxruntime/core/optimizer/insert_cast_transformer.cc``,
    ``NeedInsertCast``: fp16 input and no EP) wraps it in ``InsertedPrecisionFreeCast_*`` Casts and
    assigns it to CPU, where the *fp32* kernel runs. ``FuseInitializersTransformer``
    (``core/optimizer/fuse_initializers_transformer.cc``) then turns the Cast of the fp16 scale
    initializer into an fp32 initializer ``FusedBack_<scales>``, and ``RemoveDuplicateCastTransformer``
    (same file as InsertCast) drops Cast pairs such as the model's fp32->fp16 Cast followed by the
    inserted fp16->fp32 one (it treats float and float16 as one type group, so no precision loss is
    assumed). An fp16 MatMulNBits written into the model instead is claimed by the CPU EP's own
    ``MatMulNBits<MLFloat16>`` kernel (``contrib_ops/cpu/quantization/matmul_nbits.cc``) and computes
    in fp16: different numbers. Where the CPU EP has an fp16 ``op`` kernel (ARM64 builds with fp16
    vector intrinsics), the fused node is assigned to CPU and keeps fp16.

    Rather than mirror kernel registries per build and CPU, this asks ORT: it optimizes a tiny fp16
    DQ+``op`` model and looks at the scales input of the MatMulNBits it produced. Cached per process.
    """
    import tempfile

    import onnxruntime as ort

    k, n, bs = 32, 16, 16
    codes = np.zeros(k * n // 2, np.uint8)
    inits = [helper.make_tensor("W", TensorProto.INT4, [k, n], codes.tobytes(), raw=True),
             numpy_helper.from_array(np.full((k // bs, n), 0.5, np.float16), "S")]
    nodes = [helper.make_node("DequantizeLinear", ["W", "S"], ["Wd"], axis=0, block_size=bs),
             helper.make_node(op, ["X", "Wd"], ["Y"])]
    g = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("X", TensorProto.FLOAT16, [2, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [2, n])], inits)
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    with tempfile.TemporaryDirectory(prefix="ortmem-fp16-probe-") as tmp:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.optimized_model_filepath = os.path.join(tmp, "opt.onnx")
        try:
            ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - cannot tell: keep what the model says (fp16)
            return False
        opt = onnx.load(so.optimized_model_filepath, load_external_data=False)
    types = {t.name: t.data_type for t in opt.graph.initializer}
    producers = {o: nd for nd in opt.graph.node for o in nd.output}
    for nd in opt.graph.node:
        if nd.op_type == "MatMulNBits" and len(nd.input) > 2:
            scale = nd.input[2]
            if scale in types:
                return types[scale] == TensorProto.FLOAT
            cast = producers.get(scale)
            return bool(cast is not None and cast.op_type == "Cast"
                        and any(a.name == "to" and a.i == TensorProto.FLOAT for a in cast.attribute))
    return False


@functools.lru_cache(maxsize=None)
def cpu_fp16_ops() -> frozenset[tuple[str, str]]:
    """(domain, op) of every op ORT's CPU EP has some fp16 kernel for (ORT's own kernel registry)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    return frozenset((d.domain or "", d.op_name) for d in C.get_all_opkernel_def()
                     if d.provider == "CPUExecutionProvider"
                     and any("tensor(float16)" in v for v in d.type_constraints.values()))


def fp16_sentinel_op() -> Optional[str]:
    """An op that is an exact copy with one input and that the CPU EP has no fp16 kernel for, so an
    fp16 instance stays unassigned at partitioning like ORT's own fused fp16 MatMulNBits; None when
    this build has one."""
    return None if ("", "Sum") in cpu_fp16_ops() else "Sum"


def may_be_isolated(n: onnx.NodeProto) -> bool:
    """Could ORT's IsIsolatedFp16NodeOnCpu force this neighbour of a fused fp16 node to fp32? Only a
    CPU node that has an fp16 kernel (else it is unassigned and cast anyway), no subgraph, and is not
    a Cast (a Cast's output is not fp16 where it converts from fp16, so it never qualifies)."""
    if n.op_type == "Cast" or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
        return False
    return (n.domain if n.domain != "ai.onnx" else "", n.op_type) in cpu_fp16_ops()
