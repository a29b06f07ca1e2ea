"""Which ``DequantizeLinear -> Gather`` pairs ortmem can turn into one ``com.microsoft.GatherBlockQuantized``, and why not.

Why this exists: ORT 1.31.1 has no DQ+Gather fusion (measured: the optimized model keeps DQ and Gather at
every level), so a DQ before an embedding Gather dequantizes the whole table on every run. The rewrite
is ortmem's own, so the authority here is the op's schema and its CPU kernel
(``contrib_ops/cpu/quantization/gather_block_quantized.cc``), cited at each check; the constraints and
how each DQ form maps onto the op are ``docs/ort-fusion-rules.md`` section 9, and
``tests/passes/rules/test_dq_matmul_match.py`` runs every candidate form against ORT's own DQ+Gather. Pure and
metadata-only, like :mod:`.dq_matmul_match`; the conversion half is :mod:`.dq_gather`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from onnx import ModelProto, NodeProto, TensorProto

from ortmem.base.records import record
from ortmem.ort.fusion_graph import FusionGraph, attribute, fusion_graphs, tensor_type_name
from ortmem.passes.rules.dq_match import (INT2, MIN_BLOCK, SCALE_TYPES, UINT2, Reject, Rejected, dequantize_nodes, is_onnx_domain, is_pow2)

__all__ = ["GatherCandidate", "GatherMatchResult", "dq_gather_match"]

ScaleAction = Literal["as-is", "reshape", "expand"]
ZeroPointAction = Literal["as-is", "reshape", "expand", "zeros", "repack", "none"]


@dataclass(frozen=True)
class GatherCandidate:
    """A DQ -> Gather that ortmem can express as one ``com.microsoft.GatherBlockQuantized``.

    The CPU kernel (contrib_ops/cpu/quantization/gather_block_quantized.cc) reads ``data`` in the DQ
    weight's own layout, so ``weight`` is reused byte for byte. ``data_dtype``/``bits`` are the GBQ
    ``T1`` type and ``bits`` attribute (uint2 weights travel as uint8 with bits=2, same bytes).
    ``scale_action`` / ``zp_action`` say what ortmem must do to scales / zero points:
    ``cast``/``cast_to``: the pattern was ``DQ -> Cast(to) -> Gather`` (fp16 tables read as float); the GBQ
    then produces the scale dtype and the Cast moves behind it, onto the gathered rows only.
    ``"as-is"`` (same tensor), ``"reshape"`` (same bytes, new dims ``scales_shape``), ``"expand"``
    (materialize ``scales_shape`` by broadcasting; small), ``"zeros"`` (add an explicit all-zero zero
    point, because GBQ's uint8 default is 2**(bits-1) while DQ's is 0), ``"repack"`` (pack 2-bit
    zero points along the last axis), ``"none"``. ``dq_kept``: the DQ has other consumers (e.g. a tied
    lm_head) or is a graph output, so it stays for them.
    """

    graph_path: str
    node: str
    node_index: int
    dq_node: str
    dq_index: int
    weight: str
    scale: str
    zero_point: str | None
    weight_dtype: int
    data_dtype: int
    bits: int
    signed: bool
    gather_axis: int
    quantize_axis: int
    block_size: int
    kind: Literal["blockwise", "per-row", "per-column", "per-tensor"]
    scale_dtype: int
    has_zp: bool
    scales_shape: tuple[int, ...]
    scale_action: ScaleAction
    zp_action: ZeroPointAction
    indices: str
    output: str
    dq_kept: bool
    cast: str | None = None
    cast_to: int | None = None
    notes: tuple[str, ...] = ()


@record
class GatherMatchResult:
    candidates: list[GatherCandidate]
    rejected: list[Rejected]


@record
class Layout:
    """How the DQ's scales and zero points map onto GBQ's."""

    kind: str
    quantize_axis: int
    block_size: int
    scales_shape: tuple[int, ...]
    scale_action: ScaleAction
    zp_action: ZeroPointAction


def _next_pow2_block(n: int) -> int:
    """Smallest power of two >= n and >= 16: one block spans the whole axis (GBQ has no upper bound)."""
    b = MIN_BLOCK
    while b < n:
        b *= 2
    return b


# -- the checks, in the order the matcher makes them ----------------------------------------------------

def data_type(w_name: str, w_type: int) -> tuple[int, int]:
    """(GBQ ``T1``, ``bits``) for a table of DQ weight type ``w_type``. GBQ T1 (schema): int4, uint4,
    uint8 (+ float8/float4, which DQ weights rarely are)."""
    if w_type in (TensorProto.INT4, TensorProto.UINT4):
        return w_type, 4
    if w_type == TensorProto.UINT8:
        return TensorProto.UINT8, 8
    if w_type == UINT2:
        return TensorProto.UINT8, 2
    if w_type == TensorProto.INT8:
        raise Reject("weight_dtype", "int8 table: GatherBlockQuantized has no int8 data type (T1 is int4/uint4/uint8/"
                                     "float8/float4); it would need a repack to uint8 (flip the sign bit, zp + 128)")
    if w_type == INT2:
        raise Reject("weight_dtype", "int2 table: GatherBlockQuantized reads 2-bit codes only as unsigned (uint8, bits=2)")
    raise Reject("weight_dtype", f"table {w_name} is {tensor_type_name(w_type)}; GatherBlockQuantized takes int4/uint4/uint8 "
                                 "(uint2 as uint8 bits=2)")


def check_scale_type(s_name: str, s_type: int) -> None:
    if s_type not in SCALE_TYPES:
        raise Reject("scale_dtype", f"scale {s_name} is {tensor_type_name(s_type)}; the CPU kernel takes float or float16 "
                                    "(bfloat16 throws 'DequantizeLinear into BFLOAT16 is not implemented yet')")


def check_constants(g: FusionGraph, w_name: str, s_name: str, zp_name: str | None):
    """(weight, scale, zero point) as constant initializers (``FusionGraph.constant_initializer``)."""
    w_const, s_const = g.constant_initializer(w_name), g.constant_initializer(s_name)
    if w_const is None:
        raise Reject("weight_not_constant", f"table {w_name} is not a constant initializer")
    if s_const is None:
        raise Reject("scale_not_constant", f"scale {s_name} is not a constant initializer")
    zp_const = g.constant_initializer(zp_name) if zp_name else None
    if zp_name and zp_const is None:
        raise Reject("zero_point_not_constant", f"zero point {zp_name} is not a constant initializer")
    return w_const, s_const, zp_const


def check_table(w_name: str, wdims: list[int], ga: NodeProto, data_dtype: int, bits: int) -> tuple[int, int, int]:
    """(V, D, gather axis): a rank-2 table the kernel can gather from in this data type."""
    if len(wdims) != 2:
        raise Reject("weight_rank", f"table {w_name} has rank {len(wdims)}; ortmem rewrites rank-2 tables only "
                                    "(the kernel itself takes any rank)")
    V, D = wdims
    gaxis = attribute(ga, "axis") or 0
    gaxis = gaxis + 2 if gaxis < 0 else gaxis
    if data_dtype == TensorProto.UINT8 and gaxis != 0:
        raise Reject("gather_axis", f"Gather axis={gaxis}: for uint8 data the kernel needs gather_axis 0")
    if bits == 2 and D % 4 != 0:
        raise Reject("unaligned_2bit", f"uint2 table with D={D} not a multiple of 4: rows are not byte-aligned, "
                                       "the uint8 bits=2 layout would need a repack of the table")
    return V, D, gaxis


def blockwise_layout(dq: NodeProto, sdims: list[int], zdims: list[int] | None, is_u8: bool, bits: int,
                     gaxis: int) -> Layout:
    """A blockwise DQ: GBQ takes its scales and zero points as they are (2-bit zero points repacked)."""
    block_attr = attribute(dq, "block_size")
    axis_attr = attribute(dq, "axis")
    axis = 1 if axis_attr is None else int(axis_attr)
    qaxis = axis + 2 if axis < 0 else axis
    if block_attr < MIN_BLOCK or not is_pow2(block_attr):
        raise Reject("block_size", f"block_size={block_attr}: the kernel needs a power of two >= 16 "
                                   "('block_size' must be a power of 2 and not less than 16)")
    if is_u8 and qaxis != 1:
        raise Reject("quantize_axis", f"blockwise over axis {qaxis}: for uint8 data the kernel needs "
                                      "quantize_axis = last dimension")
    if is_u8 and qaxis == gaxis:
        raise Reject("quantize_axis", "gather_axis == quantize_axis is refused for uint8 data")
    zp_action: ZeroPointAction = "as-is" if zdims is not None else ("zeros" if is_u8 else "none")
    if bits == 2 and zdims is not None:
        zp_action = "repack"
    return Layout("blockwise", qaxis, int(block_attr), tuple(sdims), "as-is", zp_action)


def per_axis_layout(dq: NodeProto, s_name: str, sdims: list[int], zdims: list[int] | None, V: int, D: int,
                    is_u8: bool, bits: int) -> Layout:
    """A per-tensor, per-row or per-column DQ: one GBQ block spans the whole quantized axis, so the
    scales map onto GBQ without changing values (expanded or re-dimensioned)."""
    axis_attr = attribute(dq, "axis")
    axis = 1 if axis_attr is None else int(axis_attr)
    if len(sdims) == 0:
        if zdims is not None and len(zdims) != 0:
            raise Reject("zero_point_shape", f"per-tensor scale with zero point shape {zdims}")
        zp_action: ZeroPointAction = "expand" if zdims is not None else ("zeros" if is_u8 else "none")
        return Layout("per-tensor", 1, _next_pow2_block(D), (V, 1), "expand", zp_action)
    if len(sdims) != 1:
        raise Reject("granularity", f"scale {s_name} of shape {sdims} is neither blockwise, per-axis nor per-tensor")
    a = axis + 2 if axis < 0 else axis
    if a == 0 and sdims[0] == V:
        kind, qaxis, block, scales_shape = "per-row", 1, _next_pow2_block(D), (V, 1)
    elif a == 1 and sdims[0] == D:
        if is_u8:
            raise Reject("quantize_axis", "per-column scales (DQ axis=1) need quantize_axis 0, which the "
                                          "kernel refuses for uint8 data")
        kind, qaxis, block, scales_shape = "per-column", 0, _next_pow2_block(V), (1, D)
    else:
        raise Reject("granularity", f"scale shape {sdims} does not match axis {a} of table [{V}, {D}]")
    zp_action = "reshape" if zdims is not None else ("zeros" if is_u8 else "none")
    if bits == 2 and zdims is not None:
        zp_action = "repack"
    return Layout(kind, qaxis, block, scales_shape, "reshape", zp_action)


def other_readers(g: FusionGraph, dq_idx: int, ga_idx: int, cast_idx: int | None) -> tuple[bool, list[int]]:
    """(whether the DQ stays, the other nodes reading it or its Cast): a tied lm_head, a graph output."""
    dq_out = g.nodes[dq_idx].output[0]
    others = [i for i, _ in g.consumers(dq_out) if i not in (ga_idx, cast_idx)] + g.implicit_users(dq_out)
    dq_kept = bool(others) or dq_out in g.outputs
    if cast_idx is not None:
        cast_out = g.nodes[cast_idx].output[0]
        cast_others = [i for i, _ in g.consumers(cast_out) if i != ga_idx] + g.implicit_users(cast_out)
        if cast_others or cast_out in g.outputs:
            others += cast_others
            dq_kept = True
    return dq_kept, others


def evaluate(g: FusionGraph, dq_idx: int, ga_idx: int, slot: int, cast_idx: int | None = None) -> GatherCandidate:
    """The GatherCandidate, or :class:`~ortmem.passes.rules.dq_match.Reject` from the first check that fails."""
    dq, ga = g.nodes[dq_idx], g.nodes[ga_idx]
    if slot != 0:
        raise Reject("not_data_input", f"DQ output feeds input {slot} (indices) of {g.label(ga_idx)}, not the table")
    w_name, s_name = dq.input[0], dq.input[1]
    zp_name = dq.input[2] if len(dq.input) > 2 and dq.input[2] else None
    w_t, s_t = g.type_of(w_name), g.type_of(s_name)
    w_type = w_t.elem_type if w_t else 0
    s_type = s_t.elem_type if s_t else 0
    data_dtype, bits = data_type(w_name, w_type)
    check_scale_type(s_name, s_type)
    w_const, s_const, zp_const = check_constants(g, w_name, s_name, zp_name)
    V, D, gaxis = check_table(w_name, [int(d) for d in w_const[1].proto.dims], ga, data_dtype, bits)
    is_u8 = data_dtype == TensorProto.UINT8
    sdims = [int(d) for d in s_const[1].proto.dims]
    zdims = [int(d) for d in zp_const[1].proto.dims] if zp_const else None
    notes: list[str] = []
    block_attr = attribute(dq, "block_size")
    if block_attr is not None and block_attr > 0:
        layout = blockwise_layout(dq, sdims, zdims, is_u8, bits, gaxis)
    else:
        layout = per_axis_layout(dq, s_name, sdims, zdims, V, D, is_u8, bits)
        notes.append(f"block_size {layout.block_size} >= the quantized axis: one block per row/column, so the "
                     f"{layout.kind} scales map onto GBQ without changing values")
    dq_kept, others = other_readers(g, dq_idx, ga_idx, cast_idx)
    if dq_kept:
        dq_out = dq.output[0]
        notes.append("the DQ keeps other consumers (" + ", ".join(g.label(i) for i in others)
                     + (", graph output" if dq_out in g.outputs else "") + "): it stays for them")
    if w_const[0] is not g:
        notes.append(f"{w_name} is an outer-scope initializer: GBQ reads it as an implicit input")
    notes.append("GBQ answers zeros for out-of-range indices where Gather fails: the rewrite checks them with a "
                 "Gather over arange first (ortmem.passes.rules.dq_gather)")
    return GatherCandidate(
        graph_path=g.path, node=g.label(ga_idx), node_index=ga_idx, dq_node=g.label(dq_idx), dq_index=dq_idx,
        weight=w_name, scale=s_name, zero_point=zp_name, weight_dtype=w_type, data_dtype=data_dtype, bits=bits,
        signed=w_type == TensorProto.INT4, gather_axis=gaxis, quantize_axis=layout.quantize_axis,
        block_size=layout.block_size, kind=layout.kind, scale_dtype=s_type, has_zp=zp_name is not None,
        scales_shape=tuple(layout.scales_shape), scale_action=layout.scale_action, zp_action=layout.zp_action,
        indices=ga.input[1], output=ga.output[0], dq_kept=dq_kept,
        cast=g.label(cast_idx) if cast_idx is not None else None,
        cast_to=int(attribute(g.nodes[cast_idx], "to")) if cast_idx is not None else None, notes=tuple(notes))


def _gathers_of(g: FusionGraph, dq: NodeProto) -> list[tuple[int, int, int | None]]:
    """(Gather, input slot, Cast or None) for each Gather reading the DQ, directly or through a
    ``Cast(float|float16)`` (the fp16 exporters' pattern, see :attr:`GatherCandidate.cast`)."""
    pairs: list[tuple[int, int, int | None]] = []
    for cons_idx, slot in g.consumers(dq.output[0]):
        cons = g.nodes[cons_idx]
        if not is_onnx_domain(cons):
            continue
        if cons.op_type == "Gather":
            pairs.append((cons_idx, slot, None))
        elif cons.op_type == "Cast" and attribute(cons, "to") in (TensorProto.FLOAT, TensorProto.FLOAT16):
            pairs += [(i, k, cons_idx) for i, k in g.consumers(cons.output[0])
                      if g.nodes[i].op_type == "Gather" and is_onnx_domain(g.nodes[i])]
    return pairs


def dq_gather_match(model: ModelProto) -> GatherMatchResult:
    """Every DQ -> Gather pair: can it become one GatherBlockQuantized (CPU kernel constraints), and why not."""
    candidates: list[GatherCandidate] = []
    rejected: list[Rejected] = []
    for g in fusion_graphs(model):
        for dq_idx, dq in dequantize_nodes(g):
            for cons_idx, slot, cast_idx in _gathers_of(g, dq):
                try:
                    candidates.append(evaluate(g, dq_idx, cons_idx, slot, cast_idx))
                except Reject as r:
                    rejected.append(r.record(g, dq_idx, cons_idx))
    return GatherMatchResult(candidates, rejected)
