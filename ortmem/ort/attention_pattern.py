"""``AttentionPatternCache`` (``core/optimizer/matmul_add_fusion.cc``), replayed: the N-D MatMul+Add
pairs of an attention block that Level-1 ``MatMulAddFusion`` leaves for ``AttentionFusion``.

Why it matters to ortmem: a MatMul kept out of MatMulAddFusion here is not turned into a Gemm, so
its bias is folded (or not) by Level-2 ``MatMulNBitsFusion`` instead, which changes the fused node's
name and inputs (``docs/ort-fusion-rules.md`` section 3). ORT 1.31.1 has no
``IsAttentionProjectionInput`` test yet (newer sources do; measured).
"""
from __future__ import annotations

from ortmem.ort.fusion_graph import FusionGraph


def attention_add(g: FusionGraph, ln_idx: int) -> int | None:
    """``IsAttentionPattern``'s test on a LayerNormalization: it feeds exactly 3 MatMuls and 1 Add
    (all other edges go to Shape nodes), and that Add's other input comes from an Add. Returns that
    other Add (``attn_add_node``) or None."""
    ln = g.nodes[ln_idx]
    if ln.op_type != "LayerNormalization" or not ln.output:
        return None
    ln_out = ln.output[0]
    cons = g.consumers(ln_out)
    kinds = [g.nodes[i].op_type for i, _ in cons]
    if kinds.count("Add") != 1 or kinds.count("MatMul") != 3 or kinds.count("Shape") != g.node_edges(ln_idx) - 4:
        return None
    ln_add = next(i for i, _ in cons if g.nodes[i].op_type == "Add")
    ins = g.nodes[ln_add].input
    other = ins[1] if ins[0] == ln_out else ins[0]
    prod = g.computed_by(other)
    return prod if prod is not None and g.nodes[prod].op_type == "Add" else None


def is_attention_pattern(g: FusionGraph, mm_idx: int, add_idx: int) -> bool:
    """Whether MatMulAddFusion keeps this N-D MatMul+Add for AttentionFusion: the Q/K/V MatMuls reading
    such a LayerNormalization, and the MatMul whose Add is the ``attn_add_node`` of one (the output
    projection). Only consulted when A is not 2-D."""
    parent = g.computed_by(g.nodes[mm_idx].input[0])
    if parent is not None and attention_add(g, parent) is not None:
        return True
    if g.attn_adds is None:
        g.attn_adds = {a for i, n in enumerate(g.nodes) if n.op_type == "LayerNormalization"
                       for a in [attention_add(g, i)] if a is not None}
    return add_idx in g.attn_adds
