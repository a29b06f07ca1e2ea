"""Level-1 ``MatMulAddFusion`` (``core/optimizer/matmul_add_fusion.cc``), replayed: which ``MatMul ->
Add`` pairs ORT turns into one ``Gemm`` before its Level-2 QDQ rules look at them.

Why it matters to ortmem: the DQ+MatMul matcher (``ortmem.passes.rules.dq_matmul_match``) must judge the
node ORT's ``DQMatMulToMatMulNBits`` sees, and after this transformer that is a Gemm with the Add's
other input as its bias (ORT names it ``"<matmul>/MatMulAddFusion"``); a Gemm whose bias is not
``[N]`` then fails the rule altogether (``docs/ort-fusion-rules.md`` section 3, all cases tested).
"""
from __future__ import annotations

from dataclasses import dataclass

from onnx import TensorProto

from ortmem.ort.attention_pattern import is_attention_pattern
from ortmem.ort.fusion_graph import LEVEL_BASIC, FusionGraph, dim_eq
from ortmem.ort.settings import OrtSettings
from ortmem.ort.value_types import Dim

#: Add's schema versions; the transformer takes 7, 13 and 14 (IsSupportedOptypeVersionAndDomain).
ADD_VERSIONS = (1, 6, 7, 13, 14)
FUSED_ADD_VERSIONS = (7, 13, 14)


@dataclass
class AddFusion:
    """The Add a MatMul is fused with: its index, the bias (the Add's other input), and whether ORT
    wraps the Gemm in Reshapes (A is not 2-D)."""

    add_idx: int
    bias: str
    need_reshape: bool


def matmul_add_fusion(g: FusionGraph, mm_idx: int, settings: OrtSettings) -> AddFusion | None:
    """Would MatMulAddFusion turn MatMul ``mm_idx`` and its Add into a Gemm?

    The transformer walks the graph in ORT's topological order, so when an Add sums two MatMuls that both
    qualify, the one ORT visits first becomes the Gemm and the other one stays a MatMul feeding its bias.
    """
    if settings.graph_optimization_level < LEVEL_BASIC or not settings.enabled("MatMulAddFusion"):
        return None
    mine = _fusion_alone(g, mm_idx)
    if mine is None:
        return None
    rival = g.computed_by(mine.bias)
    if rival is not None and rival != mm_idx and g.nodes[rival].op_type == "MatMul":
        theirs = _fusion_alone(g, rival)
        if theirs is not None and theirs.add_idx == mine.add_idx and g.topo_position(rival) < g.topo_position(mm_idx):
            return None
    return mine


def _fusion_alone(g: FusionGraph, mm_idx: int) -> AddFusion | None:
    """The transformer's conditions on one MatMul, ignoring a rival MatMul on the same Add."""
    node = g.nodes[mm_idx]
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    out = node.output[0]
    # node.GetOutputEdgesCount() != 1 || graph.NodeProducesGraphOutput(node) -> skip
    if g.edges(out) != 1 or out in g.outputs:
        return None
    cons = g.consumers(out)
    if len(cons) != 1:
        return None
    add_idx, slot = cons[0]
    add = g.nodes[add_idx]
    # IsSupportedOptypeVersionAndDomain(next_node, "Add", {7, 13, 14})
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or g.op_since(ADD_VERSIONS) not in FUSED_ADD_VERSIONS:
        return None
    a_t, add0_t = g.type_of(node.input[0]), g.type_of(add.input[0])
    if a_t is None or add0_t is None or a_t.elem_type != add0_t.elem_type:
        return None
    if a_t.elem_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
        return None
    b_t = g.type_of(node.input[1])
    if a_t.shape is None or b_t is None or b_t.shape is None or len(b_t.shape) != 2:
        return None
    need_reshape = len(a_t.shape) != 2
    dim_n = b_t.shape[1]
    if need_reshape:
        if is_attention_pattern(g, mm_idx, add_idx):
            return None
        if any(k != "v" for k, _ in a_t.shape):  # a_shape.Size() == -1: dynamic
            return None
        if b_t.shape[0][0] != "v" or dim_n[0] != "v":
            return None
    bias = add.input[1 - slot] if slot in (0, 1) else None
    if not bias:
        return None
    bias_t = g.type_of(bias)
    if bias_t is None or bias_t.shape is None:
        return None
    bs = bias_t.shape

    def one(d: Dim) -> bool:
        return d == ("v", 1)

    valid = ((len(bs) == 1 and dim_eq(bs[0], dim_n))
             or (not need_reshape and len(bs) == 2 and one(bs[0]) and dim_eq(bs[1], dim_n))
             or (not need_reshape and len(bs) == 2 and dim_eq(bs[0], a_t.shape[0])
                 and (one(bs[1]) or dim_eq(bs[1], dim_n))))
    if not valid:
        return None
    return AddFusion(add_idx, bias, need_reshape)
