"""DequantizeLinear -> Gather into com.microsoft GatherBlockQuantized: the conversion half.

ONNX Runtime has no DQ+Gather fusion (``docs/ort-fusion-rules.md`` section 9, measured at
``ORT_ENABLE_ALL``), so a quantized embedding table is dequantized *in full* into a V x D float
buffer on every run, to read a handful of rows. ``GatherBlockQuantized``
(``onnxruntime/contrib_ops/cpu/quantization/gather_block_quantized.cc``) dequantizes only the rows it
gathers. Which pairs qualify, and what to do with scales and zero points, is decided by
:func:`ortmem.passes.rules.dq_gather_match.dq_gather_match`; this module is the rule (:data:`RULE`, one of
:data:`ortmem.passes.rules.RULES`) that turns its candidates into rewrites of the one
:class:`~ortmem.passes.conversion_plan.ConversionPlan`:

* **The table is never copied.** The kernel reads ``data`` in the DQ weight's own layout, so the GBQ
  reads the DQ weight initializer itself. It stays a *carried* tensor: in a cache entry it stays in
  the hard-linked source file, in memory it is borrowed from the source mapping, and only
  ``ortmem convert`` (which must not depend on the source) copies it, file to file in the kernel.
  A uint2 table becomes uint8 with ``bits=2`` (same bytes, dims ``[V, D/4]``): that is an
  :class:`~ortmem.passes.skeleton_edit.Alias`, a second initializer over the same bytes, not a copy.
* **Scales and zero points** are reused as they are (``as-is``), re-dimensioned over the same bytes
  (``reshape``: an alias), or, when their bytes must change (``expand`` a per-tensor scalar,
  ``zeros`` for uint8 without a zero point, ``repack`` 2-bit zero points along rows), materialized
  into weights.bin like any converted tensor. Those are V x ceil(D/block) elements at most: small.
* **Nothing is pre-packed.** The CPU kernel has no ``PrePack``: it reads ``data``, ``scales`` and
  ``zero_points`` from the initializers on every run, so none of them may ever be released after
  session creation (``tests/session/test_convert.py::test_in_memory_never_releases_gbq_inputs`` proves ORT
  reads them at run time).

* **Indices go through a real ONNX Gather first.** ORT's Gather kernel
  (``onnxruntime/core/providers/cpu/tensor/gather.cc``, ``GatherCopyData``) fails the run with
  ``INVALID_ARGUMENT`` ("indices element out of data bounds") for an index outside ``[-n, n)``;
  GatherBlockQuantized (``CopyDataAndDequantize``: ``if (indices_val < -gather_axis_dim ||
  indices_val >= gather_axis_dim) std::fill_n(..., 0)``) silently writes a row of zeros. ortmem
  must never turn a failing run into an answer, so the GBQ reads ``Gather(arange(n), indices)``:
  ORT's own Gather raises exactly where the original model's did, with the same exception, and
  hands on the in-range indices with negatives normalised (which GBQ would also do, ``indices_val
  + gather_axis_dim``), so GBQ only ever sees valid rows. The ``arange`` is int32 whatever the
  indices' type (GBQ takes int32 or int64 indices; the Gather compares int64 ids in int64, so a
  huge id still fails): ``4 n`` bytes in weights.bin, one per graph and table size, beside a table
  of ``n x D x bits/8`` (0.4 % of an int4 [32000, 2048] one); per run it costs a gather of the ids
  themselves. ORT neither folds nor drops it (its indices are not constant);
  ``tests/passes/rules/test_dq_gather.py`` holds both the errors and the outputs to plain ORT's.

The rewrite is ortmem's own (ORT would not do it), so it is applied only when ORT would optimize
the graph at all (``graph_optimization_level >= ORT_ENABLE_BASIC``). Outputs are bit-identical to
ORT's DQ+Gather, and so is whether a run fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Sequence

import numpy as np
from onnx import TensorProto, helper

from ortmem.base.dtypes import dtype_info, numel
from ortmem.errors import ConversionError
from ortmem.onnxfile.model import Model
from ortmem.onnxfile.walk import iter_graphs, node_label
from ortmem.ort.variants import onnx_type_name
from ortmem.ort.settings import OrtSettings
from ortmem.passes.nbits import packing as nb
from ortmem.passes.rules.dq_gather_match import GatherCandidate, dq_gather_match
from ortmem.passes.rule import CLAIMED_REASON, DQRewrite, NodeKey, PlanContext, Planned, already_claimed
from ortmem.passes.skeleton_edit import MS_DOMAIN, Alias, GraphEdit, external_tensor
from ortmem.passes.tensors import OutTensor, find_initializer, skeleton_index, source_bytes
from ortmem.passes.writers import Sink

#: ortmem's own policy, not ORT's (ORT never does this rewrite): rewrite only when the user lets ORT
#: optimize the graph at all. 1 = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC.
MIN_OPTIMIZATION_LEVEL = 1

#: The rule's name (:attr:`GatherRewrite.rule`, ``ConversionPlan.of_rule``).
NAME = "dq_gather"


@dataclass
class GatherRewrite(DQRewrite):
    """One Gather (or DQ -> Cast -> Gather) that becomes a GatherBlockQuantized.

    ``data``/``scales``/``zero_points`` are the GBQ input names: an existing initializer, an
    :class:`Alias`, or a tensor in ``made``. ``made`` holds the tensors this rewrite materializes
    into weights.bin (a tensor shared by two Gathers of the same DQ is owned by the first);
    ``reads`` lists the existing initializers whose bytes the GBQ keeps reading (never released).
    ``bounds``: the ``arange`` the indices are gathered from first (see the module docstring), a
    tensor in ``made`` (shared by every Gather of one graph over an axis of the same size).
    ``cast_index``: the DQ -> Cast -> Gather form's Cast, which goes with the DQ.
    """

    candidate: GatherCandidate
    data: str
    scales: str
    zero_points: Optional[str]
    aliases: list[Alias] = field(default_factory=list)
    made: list[tuple[str, OutTensor]] = field(default_factory=list)  # ("scales"|"zero_points"|"bounds", tensor)
    reads: list[str] = field(default_factory=list)
    bounds: str = ""
    cast_index: Optional[int] = None
    rule: ClassVar[str] = NAME

    @property
    def made_bytes(self) -> int:
        return sum(t.nbytes for _, t in self.made)

    # -- the rest of what the engine asks of every rewrite (passes.rule.RuleRewrite)
    @property
    def work_bytes(self) -> int:
        return self.made_bytes

    @property
    def converted_bytes(self) -> int:
        """None: the table is read as it is (carried), and what is made is only laid out anew."""
        return 0

    def out_tensors(self) -> list[OutTensor]:
        return [t for _, t in self.made]

    def removed_nodes(self) -> set[int]:
        """The Gather. Its DQ (and Cast) go only when nothing else reads them (a tied lm_head may)."""
        return {self.candidate.node_index}

    def droppable_nodes(self) -> set[int]:
        return {self.candidate.dq_index} | ({self.cast_index} if self.cast_index is not None else set())

    def kept_reads(self) -> list[str]:
        return self.reads + [a.source for a in self.aliases]

    def convert(self, model: Model, sink: Sink) -> None:
        """Materialize ``made`` (expanded scales, explicit or repacked zero points, the index
        bounds' arange) through ``sink``."""
        if not self.made:
            return
        c = self.candidate
        outs = self.out_tensors()
        dtypes = [np.uint8 if role == "zero_points" else dtype_info(t.data_type).numpy for role, t in self.made]
        with sink:
            views = sink.views(outs, dtypes)
            for (role, t), view in zip(self.made, views):
                flat = view.reshape(-1)
                if role == "bounds":
                    flat[:] = np.arange(flat.size, dtype=flat.dtype)
                elif role == "scales":
                    s = source_bytes(model, c.graph_path, c.scale).view(dtype_info(c.scale_dtype).numpy)
                    flat[:] = s[0]
                else:
                    flat[:] = _zero_point_bytes(c, source_bytes(model, c.graph_path, c.zero_point) if c.zero_point else None)
            sink.commit(outs, views)


# ----------------------------------------------------------------------------- planning


def gathers_enabled(settings: OrtSettings) -> bool:
    return int(settings.graph_optimization_level) >= MIN_OPTIMIZATION_LEVEL


def _plan_gathers(context: PlanContext, claimed: frozenset[NodeKey]) -> Planned:
    """GatherRewrites for every DQ -> Gather that GatherBlockQuantized can express; rejections (the
    matcher's, this build's, and inputs whose bytes cannot be read) as skipped ``(node, reason)``."""
    model = context.model
    if not gathers_enabled(context.settings):
        return Planned([], [])
    if not any(n.op_type == "Gather" for _, g in iter_graphs(model.skeleton.graph) for n in g.node):
        return Planned([], [])  # the matcher's graph index and value types are not free
    result = dq_gather_match(model.skeleton)
    skipped = [(f"{r.node} -> {r.consumer}", f"not GatherBlockQuantized: {r.reason}") for r in result.rejected]
    rewrites: list[GatherRewrite] = []
    shared: dict[tuple, str] = {}  # (graph, dq index, role) / alias key -> tensor name
    labels: dict[str, dict[str, int]] = {}  # graph path -> node label -> index (for Casts)
    for c in result.candidates:
        refusal = (CLAIMED_REASON if already_claimed(c.graph_path, (c.node_index, c.dq_index), claimed)
                   else context.capabilities.gather_refusal(weight_type=onnx_type_name(c.weight_dtype),
                                                            has_zp=c.zero_point is not None,
                                                            scale_type=onnx_type_name(c.scale_dtype)))
        if refusal is not None:
            skipped.append((f"{c.dq_node} -> {c.node}", f"not GatherBlockQuantized: {refusal}"))
            continue
        try:
            for name in (c.weight, c.scale, c.zero_point):
                if name:
                    source_bytes(model, c.graph_path, name)  # every input must be readable (external or raw)
            cast_index = None
            if c.cast:
                if c.graph_path not in labels:
                    g = skeleton_index(model).graphs[c.graph_path]
                    labels[c.graph_path] = {node_label(n, i): i for i, n in enumerate(g.node)}
                cast_index = labels[c.graph_path].get(c.cast)
                if cast_index is None:
                    raise ConversionError(f"Cast node {c.cast!r} was not found", tensor=c.weight)
            r = _plan_one(model, c, context.fresh, shared)
            r.cast_index = cast_index
            rewrites.append(r)
        except ConversionError as e:
            skipped.append((f"{c.dq_node} -> {c.node}", f"not GatherBlockQuantized: {e}"))
    return Planned(rewrites, skipped)


def _plan_one(model: Model, c: GatherCandidate, fresh: Callable[[str], str], shared: dict[tuple, str]) -> GatherRewrite:

    r = GatherRewrite(c, c.weight, c.scale, c.zero_point)

    def alias(src: str, data_type: int, shape: tuple[int, ...], suffix: str) -> str:
        key = ("alias", c.graph_path, src, data_type, shape)
        if key not in shared:
            shared[key] = fresh(f"{src}_{suffix}")
            r.aliases.append(Alias(c.graph_path, shared[key], src, data_type, shape))
        r.reads.append(src)
        return shared[key]

    def made(role: str, base: str, data_type: int, shape: tuple[int, ...], nbytes: int) -> str:
        key = ("made", c.graph_path, c.dq_index, role)
        if key not in shared:
            shared[key] = fresh(base)
            r.made.append((role, OutTensor(shared[key], data_type, shape, nbytes)))
        return shared[key]

    V, D = (int(d) for d in find_initializer(model, c.graph_path, c.weight)[1].dims)
    r.bounds = _bounds(c, (V, D)[c.gather_axis], fresh, shared, r)
    # data: the DQ weight itself; uint2 travels as uint8 bits=2 over the same bytes, [V, D/4]
    if c.data_dtype == c.weight_dtype:
        r.reads.append(c.weight)
    else:
        r.data = alias(c.weight, c.data_dtype, (V, D * c.bits // 8), "u8")
    # scales
    s_info = dtype_info(c.scale_dtype)
    if c.scale_action == "as-is":
        r.reads.append(c.scale)
    elif c.scale_action == "reshape":
        r.scales = alias(c.scale, c.scale_dtype, c.scales_shape, "gbq")
    else:  # expand: a per-tensor scalar broadcast to [V, 1]
        r.scales = made("scales", f"{c.scale}_gbq", c.scale_dtype, c.scales_shape,
                        numel(c.scales_shape) * s_info.numpy.itemsize)
    # zero points
    zp_type, zp_shape, zp_bytes = _zp_layout(c)
    if c.zp_action == "none":
        r.zero_points = None
    elif c.zp_action == "as-is":
        r.reads.append(c.zero_point)
    elif c.zp_action == "reshape" or (c.zp_action == "repack" and c.scales_shape[-1] % (8 // c.bits) == 0):
        # 2-bit zero points whose rows fill whole bytes: ONNX's flat packing *is* the per-row packing
        r.zero_points = alias(c.zero_point, zp_type, zp_shape, "gbq")
    else:  # expand, zeros, repack: new bytes
        base = f"{c.zero_point}_gbq" if c.zero_point else f"{c.weight}_zero_point_gbq"
        r.zero_points = made("zero_points", base, zp_type, zp_shape, zp_bytes)
    return r


def _bounds(c: GatherCandidate, size: int, fresh: Callable[[str], str], shared: dict[tuple, str],
            r: GatherRewrite) -> str:
    """The ``arange(size)`` (``size``: the gathered axis of the table) the indices are gathered from
    before the GBQ (module docstring: ORT's Gather checks indices, GBQ answers zeros). int32 unless
    the axis outgrows it; one per graph and size, owned (written) by the first rewrite that asks."""
    data_type = TensorProto.INT32 if size <= np.iinfo(np.int32).max else TensorProto.INT64
    key = ("bounds", c.graph_path, size, data_type)
    if key not in shared:
        shared[key] = fresh(f"ortmem_gather_range_{size}")
        itemsize = dtype_info(data_type).numpy.itemsize
        r.made.append(("bounds", OutTensor(shared[key], data_type, (size,), size * itemsize)))
    return shared[key]


def _zp_layout(c: GatherCandidate) -> tuple[int, tuple[int, ...], int]:
    """(element type, dims, bytes) of the GBQ zero-point input.

    int4/uint4 data: the data's own 4-bit type, dims = scales dims, packed flat (ONNX layout).
    uint8 data with bits=8: uint8, dims = scales dims. uint8 with bits=2: uint8, four codes a byte
    *per row* of the last axis (``PrepareForCompute``: ``(scales_shape[i] + components - 1) /
    components == zero_points_shape[i]`` on quantize_axis).
    """
    shape = tuple(c.scales_shape)
    if c.data_dtype in (TensorProto.INT4, TensorProto.UINT4):
        return c.data_dtype, shape, -(-numel(shape) * 4 // 8)
    if c.bits == 8:
        return TensorProto.UINT8, shape, numel(shape)
    per = 8 // c.bits
    packed = shape[:-1] + (-(-shape[-1] // per),)
    return TensorProto.UINT8, packed, numel(packed)


def _zero_point_bytes(c: GatherCandidate, raw: Optional[np.ndarray]) -> np.ndarray:
    """The GBQ zero-point bytes for ``expand``/``zeros``/``repack``: logical codes (raw bit patterns,
    no sign interpretation needed) laid out as :func:`_zp_layout` says."""
    shape = tuple(c.scales_shape)
    n = numel(shape)
    w_bits = dtype_info(c.weight_dtype).bits
    if c.zp_action == "zeros":
        codes = np.zeros(n, np.uint8)
    else:
        assert raw is not None
        count = 1 if c.zp_action == "expand" else n
        codes = nb.unpack_codes(raw, count, w_bits) if w_bits < 8 else raw[:count].copy()
        if c.zp_action == "expand":
            codes = np.full(n, codes[0], np.uint8)
    if c.data_dtype in (TensorProto.INT4, TensorProto.UINT4) or c.bits == 8:
        return nb.pack_codes(codes, c.bits) if c.bits < 8 else codes
    # uint8 data with bits=2 (or 4): pack each row of the last axis on its own, padding the row
    rows = codes.reshape(-1, shape[-1])
    per = 8 // c.bits
    padded = np.zeros((rows.shape[0], -(-shape[-1] // per) * per), np.uint8)
    padded[:, : shape[-1]] = rows
    return nb.pack_codes(padded, c.bits)


# ----------------------------------------------------------------------------- the new graph


def edit_graph(edit: GraphEdit, rewrites: Sequence[GatherRewrite], location: str, fresh: Callable[[str], str]) -> None:
    """Replace each rewritten Gather of one graph with its GatherBlockQuantized (and moved Cast); the
    tensors it materialized point into ``location``; its DQ (and Cast) go once nothing reads them."""
    for r in rewrites:
        nodes = gbq_nodes(r, fresh)
        for n in nodes:
            n.name = edit.node_name(n.name)
        edit.replace[r.candidate.node_index] = nodes
        edit.add_initializers(external_tensor(t, location) for t in r.out_tensors())
        edit.droppable |= r.droppable_nodes()


def gbq_nodes(r: GatherRewrite, fresh_output: Callable[[str], str]) -> list:
    """The nodes that replace the Gather: the index check (an ONNX Gather over ``arange``, which
    raises where the original Gather did), the GBQ, then the moved Cast for the DQ -> Cast -> Gather
    form."""
    c = r.candidate
    checked = fresh_output(f"{c.indices}_checked")
    inputs = [r.data, checked, r.scales] + ([r.zero_points] if r.zero_points else [])
    out = fresh_output(f"{c.output}_gbq") if c.cast else c.output
    nodes = [helper.make_node("Gather", [r.bounds, c.indices], [checked], name=f"{c.node}/IndexCheck", axis=0),
             helper.make_node("GatherBlockQuantized", inputs, [out], name=c.node, domain=MS_DOMAIN,
                              gather_axis=c.gather_axis, quantize_axis=c.quantize_axis,
                              block_size=c.block_size, bits=c.bits)]
    if c.cast:
        # the fp16 rows are gathered first, then cast: Cast(fp16 -> fp32) is exact, so casting the
        # gathered rows equals gathering the cast table
        nodes.append(helper.make_node("Cast", [out], [c.output], name=f"{c.node}/Cast", to=int(c.cast_to)))
    return nodes


# ----------------------------------------------------------------------------- the rule


class DQGatherRule:
    """DQ(+Cast)+Gather -> GatherBlockQuantized: ortmem's own rewrite (module docstring)."""

    name = NAME

    def plan(self, context: PlanContext, claimed: frozenset[NodeKey]) -> Planned:
        return _plan_gathers(context, claimed)

    def edit_graph(self, edit: GraphEdit, rewrites: Sequence[GatherRewrite], location: str,
                   fresh: Callable[[str], str]) -> None:
        edit_graph(edit, rewrites, location, fresh)

    def summary(self, rewrites: Sequence[GatherRewrite]) -> Optional[str]:
        if not rewrites:
            return None
        return f"rewrote {len(rewrites)} DQ+Gather pattern(s) to GatherBlockQuantized (table carried, not copied)"


RULE = DQGatherRule()
