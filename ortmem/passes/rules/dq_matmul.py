"""DequantizeLinear -> MatMul/Gemm into com.microsoft MatMulNBits: the rule's conversion half.

ORT does the same rewrite inside session creation (``DQMatMulToMatMulNBits``), but it copies each
weight out of the proto, transposes it into a new buffer and keeps both alive. Here the transposition
is streamed block by block from the mapped source span straight into the tensor's final place in the
output (weights.bin, page-aligned, so ORT memory-maps each tensor back; or the in-memory buffer), and
the source pages are given back as soon as each tensor is done. Which nodes are rewritten is decided
by :mod:`ortmem.passes.rules.dq_matmul_match`, which replays ORT's own rule, so the resulting graph is the
one ORT would have built and its outputs are the ones ORT computes for the QDQ model.

This module is the rule (:data:`RULE`, one of :data:`ortmem.passes.rules.RULES`): what one rewrite is
(:class:`MatMulRewrite`: its output tensors, how they are computed), which candidates become one
(:meth:`DQMatMulRule.plan`) and which nodes replace the MatMul (:meth:`DQMatMulRule.edit_graph`); the
engine (:mod:`ortmem.passes.engine`) lays out, writes and edits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortmem.base.dtypes import dtype_info
from ortmem.errors import ConversionError
from ortmem.onnxfile.model import Model
from ortmem.ort.fp16_kernels import fp16_sentinel_op, may_be_isolated, runs_fp16_matmulnbits_in_fp32
from ortmem.ort.variants import onnx_type_name
from ortmem.passes.nbits import packing as nb
from ortmem.passes.rules.dq_matmul_match import Candidate, MatchResult, dq_matmul_match
from ortmem.passes.rule import CLAIMED_REASON, DQRewrite, NodeKey, PlanContext, Planned, already_claimed
from ortmem.passes.skeleton_edit import MS_DOMAIN, Alias, GraphEdit, external_tensor
from ortmem.passes.tensors import OutTensor, skeleton_index, source_bytes, source_ref
from ortmem.passes.writers import Sink

#: The rule's name (:attr:`MatMulRewrite.rule`, ``ConversionPlan.of_rule``).
NAME = "dq_matmul"


@dataclass
class MatMulRewrite(DQRewrite):
    """One MatMulNBits. ``fp32``: the DQ has fp16 scales but ORT's CPU EP runs the fused node in
    fp32 (see :func:`ortmem.ort.fp16_kernels.runs_fp16_matmulnbits_in_fp32`), so the node is
    emitted in fp32 with fp32 scales and Casts around it, as ORT's own session ends up with it."""

    candidate: Candidate
    B: OutTensor
    scales: OutTensor
    zero_points: Optional[OutTensor]
    fp32: bool = False
    rule: ClassVar[str] = NAME

    @property
    def source_bytes(self) -> int:
        c = self.candidate
        return -(-c.K * c.N * c.bits // 8)

    # -- the rest of what the engine asks of every rewrite (passes.rule.RuleRewrite)
    @property
    def work_bytes(self) -> int:
        return self.source_bytes

    @property
    def converted_bytes(self) -> int:
        return self.source_bytes

    @property
    def aliases(self) -> list[Alias]:
        return []

    def out_tensors(self) -> list[OutTensor]:
        return [t for t in (self.B, self.scales, self.zero_points) if t is not None]

    def removed_nodes(self) -> set[int]:
        """The MatMul/Gemm and its DQ (single consumer: ORT's rule)."""
        return {self.candidate.node_index, self.candidate.dq_index}

    def droppable_nodes(self) -> set[int]:
        return {self.candidate.dq_index}

    def kept_reads(self) -> list[str]:
        return []

    def convert(self, model: Model, sink: Sink) -> None:
        """Transpose and pack the DQ weight (and expand its scales and zero points) into B, scales,
        zero points; then give back the source span."""
        c = self.candidate
        w = source_bytes(model, c.graph_path, c.weight)
        scales = source_bytes(model, c.graph_path, c.scale).view(dtype_info(c.scale_dtype).numpy)
        zp = source_bytes(model, c.graph_path, c.zero_point) if c.zero_point else None
        if c.kind != "blockwise":
            # per-tensor / per-channel: expand to blocks as ORT does (scales are [N] or scalar: small)
            scales, zp = nb.expand_to_blocks(scales, zp, c.K, c.N, c.bits, c.block_size)
        else:
            scales = scales.reshape(-(-c.K // c.block_size), c.N)
        s_dtype = dtype_info(self.scales.data_type).numpy
        if scales.dtype != s_dtype:
            # fp16 -> fp32 is exact, as ORT's FuseInitializersTransformer (Initializer::ToFloat32) makes
            # its FusedBack_* scales; the scales are K/block_size x N: small
            scales = scales.astype(s_dtype)
        outs = self.out_tensors()
        dtypes = [s_dtype if t is self.scales else np.uint8 for t in outs]
        with sink:
            views = sink.views(outs, dtypes)
            nb.convert_dq_weights(w, scales, zp, K=c.K, N=c.N, bits=c.bits, signed=c.signed, block_size=c.block_size,
                                  out_B=views[0], out_scales=views[1],
                                  out_zero_points=views[2] if self.zero_points is not None else None)
            sink.commit(outs, views)
        del views, w, scales, zp
        ref = source_ref(model, c.graph_path, c.weight)
        if ref is not None:
            model.store.release(ref)


# ----------------------------------------------------------------------------- planning


def _left_alone(c: Candidate, context: PlanContext) -> Optional[str]:
    """Why a candidate of ORT's rule is not rewritten here (None: it is): ORT fuses it itself, ORT
    fails on it, this build refuses it, or its weight cannot be read."""
    if c.ort_outcome == "fused_by_ort":
        return "left to ORT, which fuses it itself: " + "; ".join(c.notes)
    if c.ort_outcome == "session_error":
        return "ORT's own rule fails session creation here; left for ORT to report: " + "; ".join(c.notes)
    refusal = context.capabilities.matmul_refusal(
        weight_type=onnx_type_name(c.weight_dtype), has_zp=c.has_zp, scale_type=onnx_type_name(c.scale_dtype),
        accuracy=c.accuracy_level, block_size=c.block_size)
    if refusal is not None:
        return f"left to ORT: {refusal}"
    try:
        source_bytes(context.model, c.graph_path, c.weight)
    except ConversionError as e:
        return str(e)
    return None


def _rewrite(c: Candidate, context: PlanContext) -> MatMulRewrite:
    """The MatMulNBits for candidate ``c``: its tensors named and sized (not yet placed)."""
    fresh = context.fresh
    need_zp = nb.needs_zero_points(c.signed, c.has_zp)
    shp = nb.matmulnbits_shapes(c.K, c.N, c.bits, c.block_size, need_zp)
    B = OutTensor(fresh(f"{c.weight}_Q{c.bits}"), TensorProto.UINT8, shp.B, int(np.prod(shp.B)))
    fp16_in_fp32 = context.fp16_in_fp32
    fp32 = c.scale_dtype == TensorProto.FLOAT16 and (
        fp16_in_fp32 if fp16_in_fp32 is not None else runs_fp16_matmulnbits_in_fp32(_target_op(c)))
    if not fp32:
        c = _defer_level2_bias_fold(context.model, c)
    s_type = TensorProto.FLOAT if fp32 else c.scale_dtype
    scales = OutTensor(fresh(f"{c.weight}_scales"), s_type, shp.scales,
                       int(np.prod(shp.scales)) * dtype_info(s_type).numpy.itemsize)
    zp = None
    if need_zp:
        zp = OutTensor(fresh(f"{c.weight}_zp"), TensorProto.UINT8, shp.zero_points, int(np.prod(shp.zero_points)))
    return MatMulRewrite(c, B, scales, zp, fp32=fp32)


def _defer_level2_bias_fold(model: Model, c: Candidate) -> Candidate:
    """Leave a Level-2 bias fold (``MatMulNBitsFusion``) to ORT itself.

    In ORT's own session the Add after the fused node is folded by ``MatMulNBitsFusion``
    (``core/optimizer/matmul_nbits_fusion.cc``), which runs late in the Level-2 list, after fusions
    that may take the same Add first: ``BiasGeluFusion`` turns ``Add(bias) -> Gelu`` into one
    ``BiasGelu`` (seen on all-MiniLM-L6-v2's intermediate dense, tests/passes/test_engine.py, where
    folding it ahead of time changed the outputs by up to 0.05). The converted graph gives ORT the
    same ``MatMulNBits -> Add`` that its QDQ fusion produces, so ORT makes the same choice in the same
    order. Only the Level-1 path (``MatMulAddFusion`` -> Gemm -> bias on input 5, built by the DQ
    fusion itself) is wired here. A fused fp16 node emitted in fp32 keeps the fold: the Casts around
    it would hide the Add from ORT's MatMulNBitsFusion.
    """
    if c.fold_add is None or "MatMulNBitsFusion" not in c.fusion:
        return c
    target = skeleton_index(model).graphs[c.graph_path].node[c.node_index]
    fusion = tuple(f for f in c.fusion if f != "MatMulNBitsFusion")
    return dataclasses.replace(c, bias=None, fold_add=None, output=target.output[0], fusion=fusion)


def _target_op(c: Candidate) -> str:
    """The op ORT's partitioner sees for this candidate (Level-1 MatMulAddFusion runs before it)."""
    return "Gemm" if "MatMulAddFusion" in c.fusion else c.op


# ----------------------------------------------------------------------------- the new graph


class _Fp32Casts:
    """What ORT's InsertCastTransformer builds around a fused node run in fp32 (see
    runs_fp16_matmulnbits_in_fp32), for the rewrites of one graph: Casts to fp32 on its fp16 inputs,
    one back to fp16 on its output; ORT's RemoveDuplicateCastTransformer then removes the same Cast
    pairs here as in its own graph. The Casts carry ORT's "InsertedPrecisionFreeCast_" prefix because
    RemoveDuplicateCastTransformer::UnsafeCast treats exactly those fp32->fp16 Casts as free.

    The fused node was *unassigned* fp16 when InsertCastTransformer's ForceSingleNodeCPUFloat16ToFloat32
    looked at its neighbours (IsIsolatedFp16NodeOnCpu), so a CPU fp16 node (LayerNormalization,
    Transpose, ...) between it and other unassigned nodes was forced to fp32. A single-input Sum in
    fp16, which the CPU EP has no kernel for, plays that unassigned neighbour here (an exact copy once
    ORT runs it in fp32), where a neighbour could be forced at all (may_be_isolated).
    """

    def __init__(self, g: onnx.GraphProto, fresh: Callable[[str], str]):
        self.fresh = fresh
        self.to_fp32: dict[str, str] = {}  # fp16 tensor -> its fp32 Cast, shared like InsertCastTransformer's
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in set(n.input):
                self.consumers.setdefault(i, []).append(n)
        self.sentinel = fp16_sentinel_op()

    def inputs(self, names: Sequence[str]) -> list[onnx.NodeProto]:
        """The Casts (and sentinels) that give each of ``names`` an fp32 twin in :attr:`to_fp32`."""
        pre: list[onnx.NodeProto] = []
        for name in names:
            if name and name not in self.to_fp32:
                src = name
                if self.sentinel and name in self.producer and may_be_isolated(self.producer[name]):
                    src = self.fresh(f"{name}_fp16")
                    pre.append(helper.make_node(self.sentinel, [name], [src], name=src))
                self.to_fp32[name] = self.fresh(f"InsertedPrecisionFreeCast_{name}")
                pre.append(helper.make_node("Cast", [src], [self.to_fp32[name]], name=self.to_fp32[name],
                                            to=TensorProto.FLOAT))
        return pre

    def output(self, output: str) -> tuple[str, list[onnx.NodeProto]]:
        """(the fused node's fp32 output, the nodes that turn it back into fp16 ``output``)."""
        out = self.fresh(f"InsertedPrecisionFreeCast_{output}")
        if self.sentinel and any(may_be_isolated(n) for n in self.consumers.get(output, [])):
            y16 = self.fresh(f"{output}_fp16")
            return out, [helper.make_node("Cast", [out], [y16], name=out, to=TensorProto.FLOAT16),
                         helper.make_node(self.sentinel, [y16], [output], name=y16)]
        return out, [helper.make_node("Cast", [out], [output], name=out, to=TensorProto.FLOAT16)]


def edit_graph(edit: GraphEdit, rewrites: Sequence[MatMulRewrite], location: str, fresh: Callable[[str], str]) -> None:
    """Replace each rewritten MatMul/Gemm(+Add) of one graph with a MatMulNBits (and, for a node run in
    fp32, the Casts ORT's own session puts around it), its new initializers pointing into ``location``."""
    casts = _Fp32Casts(edit.graph, fresh)
    for r in sorted(rewrites, key=lambda r: r.candidate.node_index):  # a shared Cast precedes every reader
        c = r.candidate
        a, bias, out = c.input_a, c.bias or "", c.output
        pre: list[onnx.NodeProto] = []
        post: list[onnx.NodeProto] = []
        if r.fp32:
            pre = casts.inputs((a, bias))
            a, bias = casts.to_fp32[a], casts.to_fp32[bias] if bias else ""
            out, post = casts.output(c.output)
        inputs = [a, r.B.name, r.scales.name, r.zero_points.name if r.zero_points else "", "", bias]
        while inputs and not inputs[-1]:
            inputs.pop()
        node = helper.make_node(
            "MatMulNBits", inputs, [out], name=edit.node_name(c.ort_node_name or c.node), domain=MS_DOMAIN,
            K=c.K, N=c.N, bits=c.bits, block_size=c.block_size, accuracy_level=c.accuracy_level,
        )
        for extra in pre + post:
            extra.name = edit.node_name(extra.name)
        edit.replace[c.node_index] = pre + [node] + post
        if c.fold_add is not None:
            if c.fold_add not in edit.labels:
                raise ConversionError(f"Add node {c.fold_add!r} to fold was not found", tensor=c.weight)
            edit.remove.add(edit.labels[c.fold_add])
        edit.add_initializers(external_tensor(t, location) for t in r.out_tensors())
        edit.droppable |= r.droppable_nodes()


# ----------------------------------------------------------------------------- the rule


class DQMatMulRule:
    """DQ+MatMul/Gemm -> MatMulNBits, exactly where ORT's own rule would fuse (:mod:`.dq_matmul_match`)."""

    name = NAME

    def plan(self, context: PlanContext, claimed: frozenset[NodeKey]) -> Planned:
        """ORT's rule for every DQ -> MatMul/Gemm, then this build's refusals."""
        caps = context.capabilities
        result: MatchResult = dq_matmul_match(context.model.skeleton, settings=context.settings,
                                              block_max=caps.fusion_block_max,
                                              shared_guard=caps.shared_initializer_guard)
        rewrites: list[MatMulRewrite] = []
        skipped = [(f"{r.node} -> {r.consumer}", r.reason) for r in result.rejected]
        for c in result.candidates:
            why = (CLAIMED_REASON if already_claimed(c.graph_path, (c.node_index, c.dq_index), claimed)
                   else _left_alone(c, context))
            if why is not None:
                skipped.append((c.node, why))
                continue
            rewrites.append(_rewrite(c, context))
        return Planned(rewrites, skipped)

    def edit_graph(self, edit: GraphEdit, rewrites: Sequence[MatMulRewrite], location: str,
                   fresh: Callable[[str], str]) -> None:
        edit_graph(edit, rewrites, location, fresh)

    def summary(self, rewrites: Sequence[MatMulRewrite]) -> Optional[str]:
        return f"converted {len(rewrites)} DQ+MatMul pattern(s) to MatMulNBits"


RULE = DQMatMulRule()
