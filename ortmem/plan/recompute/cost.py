"""Which ops may be recomputed and what they cost: the allow-list by cost class, FLOPs per node.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

import math


from ortmem.ort import graph_index as og
from ortmem.plan.estimate.liveness import Context


FREE_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Size"}
CHEAP_OPS = {
    # element-wise math
    "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Reciprocal", "Sqrt", "Exp", "Log", "Erf", "Sin", "Cos", "Tan",
    "Tanh", "Sigmoid", "HardSigmoid", "Relu", "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign", "Gelu", "Clip",
    "Min", "Max", "Floor", "Ceil", "Round", "Sign", "Mod", "Sum", "Mean",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "Where", "IsNaN", "IsInf",
    # construction and data movement
    "Cast", "CastLike", "Expand", "Tile", "Range", "ConstantOfShape", "Trilu", "Concat", "Slice", "Gather",
    "GatherElements", "Transpose", "Split", "Pad", "EyeLike", "OneHot", "Dropout",
}
#: com.microsoft ops (ORT's contrib kernels) of the same classes
CHEAP_CONTRIB = {"Gelu", "FastGelu", "QuickGelu", "BiasGelu"}
EXPENSIVE_OPS = {
    "MatMul", "Gemm", "Softmax", "LogSoftmax", "LayerNormalization", "ReduceMean", "ReduceSum", "ReduceMax",
    "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "CumSum",
    "Conv", "ConvTranspose", "Einsum", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
}
EXPENSIVE_CONTRIB = {"FusedMatMul", "FusedConv", "MatMulNBits", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                     "SkipSimplifiedLayerNormalization"}
CLASS_RANK = {"free": 0, "cheap": 1, "expensive": 2}


def cost_class(node: og.OrtNode) -> str | None:
    """``free``, ``cheap``, ``expensive``, or None when the node must never be recomputed (not on the
    allow-list, has subgraphs, or is not deterministic, e.g. Dropout with a training-mode input)."""
    if node.subgraphs:
        return None
    op, dom = node.op_type, node.domain
    if dom in ("", "ai.onnx"):
        if op == "Dropout" and len(node.inputs) > 2 and node.inputs[2]:
            return None
        if op in FREE_OPS:
            return "free"
        if op in CHEAP_OPS:
            return "cheap"
        if op in EXPENSIVE_OPS:
            return "expensive"
        return None
    if dom == "com.microsoft":
        if op in CHEAP_CONTRIB:
            return "cheap"
        if op in EXPENSIVE_CONTRIB:
            return "expensive"
    return None


def _numel(ctx: Context, name: str) -> int:
    s = ctx.shapes.get(ctx.root, name)
    if s is None or not s.known:
        return 0
    return math.prod(s.dims)  # type: ignore[arg-type]


def node_flops(ctx: Context, node: og.OrtNode) -> int:
    """Extra work of running ``node`` once more, in FLOPs (element operations for data movement)."""
    cls = cost_class(node)
    if cls == "free" or cls is None:
        return 0
    out = sum(_numel(ctx, o) for o in node.outputs if o)
    op = node.op_type
    if op in ("MatMul", "Gemm", "FusedMatMul", "MatMulNBits"):
        a = ctx.shapes.get(ctx.root, node.inputs[0])
        k = int(a.dims[-1]) if a is not None and a.known and a.dims else 0  # type: ignore[index]
        if op == "Gemm" and any(at.name == "transA" and at.i for at in node.proto.attribute) and a is not None \
                and a.known and len(a.dims) == 2:
            k = int(a.dims[0])  # type: ignore[index]
        return 2 * out * k
    if op in ("Conv", "ConvTranspose"):
        w = ctx.shapes.get(ctx.root, node.inputs[1])
        per = math.prod(w.dims[1:]) if w is not None and w.known else 1  # type: ignore[arg-type]
        return 2 * out * int(per)
    if op in ("Softmax", "LogSoftmax"):
        return 5 * out
    if "Normalization" in op:
        return 8 * out
    if op.startswith("Reduce") or op == "CumSum":
        return _numel(ctx, node.inputs[0])
    if op in ("Exp", "Log", "Erf", "Sin", "Cos", "Tan", "Tanh", "Sigmoid", "Gelu", "FastGelu", "QuickGelu",
              "BiasGelu", "Pow", "Softplus", "Elu", "Selu"):
        return 4 * out
    return out


