"""Rewrite DequantizeLinear -> MatMul/Gemm into com.microsoft MatMulNBits before ORT sees the model.

ORT does the same rewrite inside session creation (``DQMatMulToMatMulNBits``), but it copies each
weight out of the proto, transposes it into a new buffer and keeps both alive. Here the transposition
is streamed block by block from the mapped source span straight into the tensor's final place in the
output file (``weights.bin``, page-aligned, so ORT memory-maps each tensor back), and the source pages
are given back as soon as each tensor is done. Which nodes are rewritten is decided by
:mod:`ortmem.passes.dq_matmul_match`, which replays ORT's own rule, so the resulting graph is the one
ORT would have built and its outputs are the ones ORT computes for the QDQ model.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..dtypes import dtype_info
from ..errors import ConversionError
from ..model import Model
from ..onnx_walk import iter_graphs, iter_tensor_sites, is_external, node_label
from ..ortmodel.variants import onnx_type_name
from ..ortmodel.release import Capabilities
from ..ortmodel.release import capabilities as installed_capabilities
from ..weights import WeightRef, page_align
from . import dq_gather
from . import nbits_layout as nb
from .dq_gather import GatherRewrite
from .sources import OutTensor, skeleton_index, source_bytes, source_ref
from .dq_matmul_match import Candidate, MatchResult, OrtSettings, dq_matmul_match

MS_DOMAIN = "com.microsoft"
WEIGHTS_FILE = "weights.bin"

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, tensor name)


@dataclass
class Rewrite:
    """One MatMulNBits. ``fp32``: the DQ has fp16 scales but ORT's CPU EP runs the fused node in
    fp32 (see :func:`ort_runs_fp16_matmulnbits_in_fp32`), so the node is emitted in fp32 with fp32
    scales and Casts around it, as ORT's own session ends up with it."""

    candidate: Candidate
    B: OutTensor
    scales: OutTensor
    zero_points: Optional[OutTensor]
    fp32: bool = False

    @property
    def source_bytes(self) -> int:
        c = self.candidate
        return -(-c.K * c.N * c.bits // 8)


@dataclass
class ConversionPlan:
    """Everything one conversion does: one plan, one writer loop, one skeleton rewrite.

    ``rewrites``: DQ+MatMul/Gemm -> MatMulNBits. ``gathers``: DQ(+Cast)+Gather ->
    GatherBlockQuantized (:mod:`ortmem.passes.dq_gather`); their quantized tables are *carried*
    (in ``copied``), not converted. ``copied``: every weight the new graph still reads unchanged.
    """

    rewrites: list[Rewrite]
    skipped: list[tuple[str, str]]  # (node, reason) for every DQ feeding a MatMul/Gemm/Gather left alone
    copied: list[tuple[WeightRef, OutTensor]]  # unchanged weights carried into weights.bin
    size: int = 0  # bytes of weights.bin
    gathers: list[GatherRewrite] = field(default_factory=list)

    @property
    def converted_source_bytes(self) -> int:
        return sum(r.source_bytes for r in self.rewrites)

    @property
    def has_work(self) -> bool:
        """True when the converted graph differs from the source (a MatMulNBits or a GBQ rewrite)."""
        return bool(self.rewrites or self.gathers)


@dataclass
class ConversionReport:
    converted: int
    skipped: list[tuple[str, str]]
    source_bytes: int  # quantized weight bytes read
    output_bytes: int  # bytes written to weights.bin (converted + carried)
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def throughput_gbps(self) -> float:
        return self.source_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @classmethod
    def from_plan(cls, plan: ConversionPlan, seconds: float) -> "ConversionReport":
        notes = [f"{len(plan.gathers)} DQ+Gather -> GatherBlockQuantized (table carried, not copied)"] if plan.gathers else []
        return cls(len(plan.rewrites), plan.skipped, plan.converted_source_bytes, plan.size, seconds, notes)

    def summary(self) -> str:
        lines = [
            f"converted {self.converted} DQ+MatMul pattern(s) to MatMulNBits, left {len(self.skipped)} as they were",
            f"{self.source_bytes / 2**20:.1f} MiB of quantized weights in {self.seconds:.2f} s "
            f"({self.throughput_gbps:.2f} GB/s); weights.bin {self.output_bytes / 2**20:.1f} MiB",
        ]
        lines += [f"  left as is: {node}: {reason}" for node, reason in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_conversion(model: Model, settings: Optional[OrtSettings] = None, *, carry_unchanged: bool = True,
                    fp16_in_fp32: Optional[bool] = None, capabilities: Optional[Capabilities] = None) -> ConversionPlan:
    """Decide what to rewrite (ORT's rule for MatMul/Gemm; GatherBlockQuantized's kernel constraints
    for Gather), and lay out every output tensor in weights.bin.

    ``fp16_in_fp32``: whether a fused MatMulNBits with fp16 scales runs in fp32 in the target session.
    ``None`` asks ORT's CPU EP (:func:`ort_runs_fp16_matmulnbits_in_fp32`; True on x86-64). CPU only:
    a caller whose session uses another EP that claims fp16 MatMuls (CUDA, DML) must pass False.
    """
    settings = settings or OrtSettings()
    caps = capabilities or installed_capabilities()
    result: MatchResult = dq_matmul_match(model.skeleton, settings=settings, block_max=caps.fusion_block_max,
                                          shared_guard=caps.shared_initializer_guard)
    rewrites: list[Rewrite] = []
    skipped = [(f"{r.node} -> {r.consumer}", r.reason) for r in result.rejected]
    taken: set[str] = _all_names(model.skeleton)
    for c in result.candidates:
        if c.ort_outcome == "fused_by_ort":
            skipped.append((c.node, "left to ORT, which fuses it itself: " + "; ".join(c.notes)))
            continue
        if c.ort_outcome == "session_error":
            skipped.append((c.node, "ORT's own rule fails session creation here; left for ORT to report: " + "; ".join(c.notes)))
            continue
        refusal = caps.matmul_refusal(weight_type=onnx_type_name(c.weight_dtype), has_zp=c.has_zp,
                                      scale_type=onnx_type_name(c.scale_dtype), accuracy=c.accuracy_level,
                                      block_size=c.block_size)
        if refusal is not None:
            skipped.append((c.node, f"left to ORT: {refusal}"))
            continue
        try:
            source_bytes(model, c.graph_path, c.weight)
        except ConversionError as e:
            skipped.append((c.node, str(e)))
            continue
        need_zp = nb.needs_zero_points(c.signed, c.has_zp)
        shp = nb.matmulnbits_shapes(c.K, c.N, c.bits, c.block_size, need_zp)
        B = OutTensor(_fresh(taken, f"{c.weight}_Q{c.bits}"), TensorProto.UINT8, shp.B, int(np.prod(shp.B)))
        fp32 = c.scale_dtype == TensorProto.FLOAT16 and (
            fp16_in_fp32 if fp16_in_fp32 is not None else ort_runs_fp16_matmulnbits_in_fp32(_target_op(c)))
        if not fp32:
            c = _defer_level2_bias_fold(model, c)
        s_type = TensorProto.FLOAT if fp32 else c.scale_dtype
        scales = OutTensor(_fresh(taken, f"{c.weight}_scales"), s_type, shp.scales,
                           int(np.prod(shp.scales)) * dtype_info(s_type).numpy.itemsize)
        zp = None
        if need_zp:
            zp = OutTensor(_fresh(taken, f"{c.weight}_zp"), TensorProto.UINT8, shp.zero_points, int(np.prod(shp.zero_points)))
        rewrites.append(Rewrite(c, B, scales, zp, fp32=fp32))

    gathers = dq_gather.plan_gathers(model, settings, lambda base: _fresh(taken, base), skipped, caps)
    plan = ConversionPlan(rewrites, skipped, [], gathers=gathers)
    if carry_unchanged:
        dropped = _dropped_initializers(model.skeleton, plan)
        for w in model.weights:
            if (w.graph, w.name) in dropped and w.kind == "initializer":
                continue
            plan.copied.append((w, OutTensor(w.name, w.data_type, w.shape, w.nbytes)))
    _layout(plan)
    return plan


def _defer_level2_bias_fold(model: Model, c: Candidate) -> Candidate:
    """Leave a Level-2 bias fold (``MatMulNBitsFusion``) to ORT itself.

    In ORT's own session the Add after the fused node is folded by ``MatMulNBitsFusion``
    (``core/optimizer/matmul_nbits_fusion.cc``), which runs late in the Level-2 list, after fusions
    that may take the same Add first: ``BiasGeluFusion`` turns ``Add(bias) -> Gelu`` into one
    ``BiasGelu`` (seen on all-MiniLM-L6-v2's intermediate dense, tests/test_real_model.py, where
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


@functools.lru_cache(maxsize=None)
def ort_runs_fp16_matmulnbits_in_fp32(op: str = "MatMul") -> bool:
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
def _cpu_fp16_ops() -> frozenset[tuple[str, str]]:
    """(domain, op) of every op ORT's CPU EP has some fp16 kernel for (ORT's own kernel registry)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    return frozenset((d.domain or "", d.op_name) for d in C.get_all_opkernel_def()
                     if d.provider == "CPUExecutionProvider"
                     and any("tensor(float16)" in v for v in d.type_constraints.values()))


def _fp16_sentinel_op() -> Optional[str]:
    """An op that is an exact copy with one input and that the CPU EP has no fp16 kernel for, so an
    fp16 instance stays unassigned at partitioning like ORT's own fused fp16 MatMulNBits; None when
    this build has one."""
    return None if ("", "Sum") in _cpu_fp16_ops() else "Sum"


def _may_be_isolated(n: onnx.NodeProto) -> bool:
    """Could ORT's IsIsolatedFp16NodeOnCpu force this neighbour of a fused fp16 node to fp32? Only a
    CPU node that has an fp16 kernel (else it is unassigned and cast anyway), no subgraph, and is not
    a Cast (a Cast's output is not fp16 where it converts from fp16, so it never qualifies)."""
    if n.op_type == "Cast" or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
        return False
    return (n.domain if n.domain != "ai.onnx" else "", n.op_type) in _cpu_fp16_ops()


def _removed_nodes(plan: ConversionPlan) -> set[tuple[str, int]]:
    """(graph, node index) of every node the rewrite removes *for certain* that reads a weight, scale or
    zero point: each MatMulNBits target and its DQ (single consumer: ORT's rule), each replaced Gather.
    A Gather's DQ (and Cast) go only when nothing else reads them, which
    :func:`_dropped_initializers` works out."""
    out: set[tuple[str, int]] = set()
    for r in plan.rewrites:
        c = r.candidate
        out |= {(c.graph_path, c.node_index), (c.graph_path, c.dq_index)}
    for g in plan.gathers:
        out.add((g.candidate.graph_path, g.candidate.node_index))
    return out


def _dropped_initializers(skeleton: onnx.ModelProto, plan: ConversionPlan) -> set[tuple[str, str]]:
    """(graph, name) of the rewritten DQs' weights, scales and zero points that nothing reads once the
    new graph exists: no node left (in any graph: subgraphs read outer names implicitly), no graph
    output, no GatherBlockQuantized input. Only these may be left out of ``plan.copied``.

    A zero point may be shared by a fused DQ and one that stays (ORT's rule checks weight and scale
    only, ``docs/ort-fusion-rules.md`` check 8), and a Gather's DQ may stay for a tied MatMul: both
    keep their inputs.
    """
    removed = _removed_nodes(plan)
    gather_dq = {(g.candidate.graph_path, g.candidate.dq_index): g.candidate for g in plan.gathers}
    cast_labels = {(g.candidate.graph_path, g.candidate.cast) for g in plan.gathers if g.candidate.cast}
    graphs = list(iter_graphs(skeleton.graph))
    # Gather DQs and Casts go when their outputs have no reader left: iterate to a fixed point
    while True:
        reads: set[str] = set()
        for path, g in graphs:
            for i, n in enumerate(g.node):
                if (path, i) not in removed:
                    reads.update(n.input)
            reads.update(o.name for o in g.output)
        more = set()
        for path, g in graphs:
            for i, n in enumerate(g.node):
                if (path, i) in removed:
                    continue
                is_dq = (path, i) in gather_dq
                is_cast = (path, node_label(n, i)) in cast_labels
                if (is_dq or is_cast) and not any(o in reads for o in n.output if o):
                    more.add((path, i))
        if not more:
            break
        removed |= more
    candidates: set[tuple[str, str]] = set()
    for r in plan.rewrites:
        candidates |= {(r.candidate.graph_path, n) for n in _consumed_names(r.candidate)}
    for g in plan.gathers:
        c = g.candidate
        candidates |= {(c.graph_path, n) for n in (c.weight, c.scale, c.zero_point) if n}
    still = set(reads) | {n for g in plan.gathers for n in g.reads} | {a.source for g in plan.gathers for a in g.aliases}
    return {(path, name) for path, name in candidates if name not in still}


def _layout(plan: ConversionPlan) -> None:
    """Page-aligned offsets in weights.bin for every output tensor that lives there."""
    offset = 0
    for t in _out_tensors(plan):
        if t.location is None:
            t.offset = offset
            offset = page_align(offset + t.nbytes)
    plan.size = offset


def relocate_carried(plan: ConversionPlan, locations: dict[Path, str]) -> None:
    """Carried tensors of these source files stay where they are, in a file named ``locations[file]``
    beside weights.bin (a hard link to the source): nothing of them is copied."""
    for ref, t in plan.copied:
        if ref.file in locations:
            t.location, t.offset = locations[ref.file], ref.offset
    _layout(plan)


def _out_tensors(plan: ConversionPlan) -> list[OutTensor]:
    out: list[OutTensor] = []
    for r in plan.rewrites:
        out += [r.B, r.scales] + ([r.zero_points] if r.zero_points else [])
    for g in plan.gathers:
        out += g.out_tensors()
    out += [t for _, t in plan.copied]
    return out


def out_tensors(plan: ConversionPlan) -> list[OutTensor]:
    """Every tensor of the converted model that has a place (weights.bin or a linked source)."""
    return _out_tensors(plan)


def _consumed_names(c: Candidate) -> list[str]:
    return [n for n in (c.weight, c.scale, c.zero_point) if n]


def _all_names(model: onnx.ModelProto) -> set[str]:
    names: set[str] = set()
    for _, g in iter_graphs(model.graph):
        names.update(t.name for t in g.initializer)
        names.update(v.name for v in list(g.input) + list(g.output) + list(g.value_info))
        for n in g.node:
            names.update(n.input)
            names.update(n.output)
    return names


def _fresh(taken: set[str], base: str) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


# ----------------------------------------------------------------------------- writing


def write_weights(model: Model, plan: ConversionPlan, out_path: Path, *, progress: Optional[Progress] = None,
                  threads: int = 2) -> float:
    """Fill ``out_path`` (``plan.size`` bytes, already reserved) with every output tensor; returns seconds.

    Each tensor is converted into a scratch buffer that is reused from tensor to tensor (so its pages
    stay faulted in and cached) and written to its final offset with ``pwrite``: writing through a
    shared mapping of a fresh file costs a page fault per 4 KiB instead, and charges every written
    page to this process's resident set. Each source span is released as soon as its tensor is done.
    """
    start = time.perf_counter()
    fd = os.open(out_path, os.O_RDWR)
    try:
        scratch = [_Scratch() for _ in range(max(1, threads))]

        def sink(r: Rewrite, slot: int):
            return _FileSink(fd, scratch[slot])

        done = _convert_all(model, plan, sink, len(scratch), progress)
        for ref, t in plan.copied:
            if t.location is None:
                copy_span(ref, fd, t.offset)
            done += t.nbytes
            if progress:
                progress(done, _total(plan), ref.name)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def convert_into_memory(model: Model, plan: ConversionPlan, buffer, *, progress: Optional[Progress] = None,
                        threads: int = 2) -> float:
    """Convert every rewrite straight into ``buffer`` (``plan.size`` bytes, e.g. an anonymous mmap) at
    the same offsets weights.bin would use; carried tensors are not touched (their pages stay unused).
    Returns seconds."""
    start = time.perf_counter()
    _convert_all(model, plan, lambda r, slot: _MemorySink(buffer), max(1, threads), progress)
    return time.perf_counter() - start


def _total(plan: ConversionPlan) -> int:
    return (plan.converted_source_bytes + sum(g.made_bytes for g in plan.gathers)
            + sum(t.nbytes for _, t in plan.copied))


def _convert_all(model: Model, plan: ConversionPlan, sink_for, workers: int, progress: Optional[Progress]) -> int:
    """Convert the rewrites on ``workers`` threads (numpy releases the GIL in the kernels), biggest
    first. GatherBlockQuantized jobs only materialize their few small tensors (expanded scales,
    explicit zero points); their tables are carried, not converted."""
    done = 0
    jobs: list[tuple[int, Callable[[object], None], object, str]] = []  # (bytes, convert, rewrite, name)
    for r in plan.rewrites:
        jobs.append((r.source_bytes, lambda sink, r=r: _convert_one(model, r, sink), r, r.candidate.node))
    for g in plan.gathers:
        if g.made:
            jobs.append((g.made_bytes, lambda sink, g=g: dq_gather.convert_gather(model, g, sink), g, g.candidate.node))
    jobs.sort(key=lambda j: -j[0])
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(fn, sink_for(r, n % workers)) for n, (_, fn, r, _) in enumerate(jobs)]
        for (nbytes, _, _, name), f in zip(jobs, futures):
            f.result()
            done += nbytes
            if progress:
                progress(done, _total(plan), name)
    return done


def _view_shape(t: OutTensor, dt) -> tuple[int, ...]:
    """The tensor's dims, or flat bytes for a packed sub-byte tensor (a GBQ int4 zero point)."""
    return t.shape if int(np.prod(t.shape)) * np.dtype(dt).itemsize == t.nbytes else (-1,)


class _Scratch:
    """One worker's reusable output buffer: grows to the largest tensor it has converted."""

    def __init__(self) -> None:
        import threading

        self.buf = np.empty(0, np.uint8)
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, np.uint8)
        return self.buf[:nbytes]


class _FileSink:
    """Outputs go to a scratch buffer, then to their offsets in the file."""

    def __init__(self, fd: int, scratch: _Scratch):
        self.fd, self.scratch = fd, scratch

    def __enter__(self):
        self.scratch.lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.scratch.lock.release()

    def views(self, outs: list[OutTensor], dtypes: list) -> list[np.ndarray]:
        buf = self.scratch.take(sum(page_align(t.nbytes) for t in outs))
        views, pos = [], 0
        for t, dt in zip(outs, dtypes):
            views.append(buf[pos : pos + t.nbytes].view(dt).reshape(_view_shape(t, dt)))
            pos += page_align(t.nbytes)
        return views

    def commit(self, outs: list[OutTensor], views: list[np.ndarray]) -> None:
        for t, v in zip(outs, views):
            _pwrite_all(self.fd, v.reshape(-1).view(np.uint8), t.offset)


class _MemorySink:
    """Outputs are written in place, in the final buffer."""

    def __init__(self, buffer):
        self.buffer = buffer

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def views(self, outs: list[OutTensor], dtypes: list) -> list[np.ndarray]:
        return [np.frombuffer(self.buffer, dtype=dt, count=t.nbytes // np.dtype(dt).itemsize, offset=t.offset)
                .reshape(_view_shape(t, dt)) for t, dt in zip(outs, dtypes)]

    def commit(self, outs: list[OutTensor], views: list[np.ndarray]) -> None:
        pass


def _convert_one(model: Model, r: Rewrite, sink) -> None:
    c = r.candidate
    w = source_bytes(model, c.graph_path, c.weight)
    scales = source_bytes(model, c.graph_path, c.scale).view(dtype_info(c.scale_dtype).numpy)
    zp = source_bytes(model, c.graph_path, c.zero_point) if c.zero_point else None
    if c.kind != "blockwise":
        # per-tensor / per-channel: expand to blocks as ORT does (scales are [N] or scalar: small)
        scales, zp = nb.expand_to_blocks(scales, zp, c.K, c.N, c.bits, c.block_size)
    else:
        scales = scales.reshape(-(-c.K // c.block_size), c.N)
    s_dtype = dtype_info(r.scales.data_type).numpy
    if scales.dtype != s_dtype:
        # fp16 -> fp32 is exact, as ORT's FuseInitializersTransformer (Initializer::ToFloat32) makes
        # its FusedBack_* scales; the scales are K/block_size x N: small
        scales = scales.astype(s_dtype)
    outs = [t for t in (r.B, r.scales, r.zero_points) if t is not None]
    dtypes = [s_dtype if t is r.scales else np.uint8 for t in outs]
    with sink:
        views = sink.views(outs, dtypes)
        nb.convert_dq_weights(w, scales, zp, K=c.K, N=c.N, bits=c.bits, signed=c.signed, block_size=c.block_size,
                              out_B=views[0], out_scales=views[1],
                              out_zero_points=views[2] if r.zero_points is not None else None)
        sink.commit(outs, views)
    del views, w, scales, zp
    ref = source_ref(model, c.graph_path, c.weight)
    if ref is not None:
        model.store.release(ref)


def _pwrite_all(fd: int, data, offset: int) -> None:
    mv = memoryview(data).cast("B")
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def copy_span(ref: WeightRef, out_fd: int, out_offset: int) -> None:
    """Copy an unchanged weight file-to-file in the kernel: no byte passes through this process."""
    in_fd = os.open(ref.file, os.O_RDONLY)
    try:
        remaining, src, dst = ref.length, ref.offset, out_offset
        while remaining:
            n = 0
            if hasattr(os, "copy_file_range"):
                try:
                    n = os.copy_file_range(in_fd, out_fd, remaining, src, dst)
                except OSError:
                    n = 0
            if n <= 0:
                chunk = os.pread(in_fd, min(remaining, 16 << 20), src)
                if not chunk:
                    raise ConversionError("source ended early", tensor=ref.name, file=str(ref.file))
                n = os.pwrite(out_fd, chunk, dst)
            remaining, src, dst = remaining - n, src + n, dst + n
    finally:
        os.close(in_fd)


# ----------------------------------------------------------------------------- the new graph


def rewrite_skeleton(model: Model, plan: ConversionPlan, location: str = WEIGHTS_FILE, *,
                     move_carried: bool = True) -> onnx.ModelProto:
    """A copy of the skeleton with MatMulNBits in place of each rewritten DQ+MatMul(+Add)/Gemm and
    GatherBlockQuantized in place of each rewritten DQ(+Cast)+Gather.

    Converted tensors point into ``location``; carried (unchanged) tensors too when ``move_carried``,
    else they keep pointing where they were (the in-memory handoff reads them from the source files).
    A GBQ alias (same bytes, other dtype or dims) is a copy of its source's TensorProto *after* the
    source was pointed at its final place, so both name the same bytes.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model.skeleton)  # the skeleton holds no weight bytes: this copy is small
    mm_by_graph: dict[str, list[Rewrite]] = {}
    for r in plan.rewrites:
        mm_by_graph.setdefault(r.candidate.graph_path, []).append(r)
    ga_by_graph: dict[str, list[GatherRewrite]] = {}
    for g in plan.gathers:
        ga_by_graph.setdefault(g.candidate.graph_path, []).append(g)
    taken = _all_names(out) | {o.name for o in _out_tensors(plan)} | {a.name for g in plan.gathers for a in g.aliases}
    # Deepest graphs first: rebuilding a graph's node list copies its nodes, subgraphs included, so a
    # subgraph must be final before its parent is rebuilt (and is looked up afresh each time).
    for path in sorted(set(mm_by_graph) | set(ga_by_graph), key=lambda p: (-p.count("/"), p)):
        graph = dict(iter_graphs(out.graph))[path]
        _rewrite_graph(graph, mm_by_graph.get(path, []), ga_by_graph.get(path, []), location, taken)
    carried = {(ref.graph, ref.kind, ref.name): t for ref, t in plan.copied} if move_carried else {}
    for site in iter_tensor_sites(out):
        t = carried.get(site.key)
        if t is not None:
            _point_to(site.tensor, t.location or location, t)
    _add_aliases(out, plan.gathers)
    consumed = {(r.candidate.graph_path, n) for r in plan.rewrites for n in _consumed_names(r.candidate)}
    consumed |= {(g.candidate.graph_path, n) for g in plan.gathers
                 for n in (g.candidate.weight, g.candidate.scale, g.candidate.zero_point) if n}
    _drop_unused_initializers(out, consumed)
    if plan.has_work and not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return out


def _point_to(t: TensorProto, location: str, o: OutTensor) -> None:
    t.ClearField("raw_data")
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(o.offset)), ("length", str(o.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v


def _external_tensor(o: OutTensor, location: str) -> TensorProto:
    t = TensorProto(name=o.name, data_type=o.data_type, dims=list(o.shape))
    _point_to(t, location, o)
    return t


def _scoped_initializer(graphs: dict[str, onnx.GraphProto], graph_path: str, name: str) -> TensorProto:
    """``name`` as seen from ``graph_path``: its own graph first, then the enclosing ones."""
    path = graph_path
    while True:
        g = graphs.get(path)
        if g is not None:
            for t in g.initializer:
                if t.name == name:
                    return t
        if not path:
            raise ConversionError("initializer to alias not found", tensor=name)
        path = path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""


def _add_aliases(out: onnx.ModelProto, gathers: list[GatherRewrite]) -> None:
    """One new initializer per :class:`~ortmem.passes.dq_gather.Alias`: the source's bytes (external
    reference or inline raw bytes, copied as they are) under another element type or dims."""
    graphs = dict(iter_graphs(out.graph))
    for g in gathers:
        for a in g.aliases:
            src = _scoped_initializer(graphs, a.graph_path, a.source)
            t = TensorProto()
            t.CopyFrom(src)
            t.name = a.name
            if a.data_type != src.data_type and not (is_external(t) or t.raw_data):
                raise ConversionError("a tensor in typed fields cannot change its element type", tensor=a.source)
            t.data_type = a.data_type
            del t.dims[:]
            t.dims.extend(a.shape)
            graphs[a.graph_path].initializer.append(t)


def _reads(n: onnx.NodeProto) -> set[str]:
    """Names a node reads: its inputs, and whatever its subgraphs read (implicit inputs)."""
    names = set(n.input)
    for attr in n.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                    list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []):
            for m in sub.node:
                names |= _reads(m)
            names.update(o.name for o in sub.output)
    return names


def _rewrite_graph(g: onnx.GraphProto, rewrites: list[Rewrite], gathers: list[GatherRewrite], location: str,
                   taken: set[str]) -> None:
    labels = {node_label(n, i): i for i, n in enumerate(g.node)}
    remove: set[int] = set()
    replace: dict[int, list[onnx.NodeProto]] = {}
    to_fp32: dict[str, str] = {}  # fp16 tensor -> its fp32 Cast, shared like InsertCastTransformer's
    producer = {o: n for n in g.node for o in n.output if o}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in set(n.input):
            consumers.setdefault(i, []).append(n)
    sentinel = _fp16_sentinel_op()
    # ONNX wants node names unique within a graph; ORT's names for unnamed MatMuls collide
    # ("/MatMulAddFusion" twice), where ORT itself would uniquify them (Graph::GenerateNodeName)
    replaced = {r.candidate.node_index for r in rewrites} | {ga.candidate.node_index for ga in gathers}
    node_names = {n.name for i, n in enumerate(g.node) if n.name and i not in replaced}
    for r in sorted(rewrites, key=lambda r: r.candidate.node_index):  # a shared Cast precedes every reader
        c = r.candidate
        a, bias, out = c.input_a, c.bias or "", c.output
        pre: list[onnx.NodeProto] = []
        post: list[onnx.NodeProto] = []
        if r.fp32:
            # What ORT's InsertCastTransformer builds around the fused node (see
            # ort_runs_fp16_matmulnbits_in_fp32): Casts to fp32 on its fp16 inputs, one back to fp16 on
            # its output; ORT's RemoveDuplicateCastTransformer then removes the same Cast pairs here as
            # in its own graph. The Casts carry ORT's "InsertedPrecisionFreeCast_" prefix because
            # RemoveDuplicateCastTransformer::UnsafeCast treats exactly those fp32->fp16 Casts as free.
            # The fused node was *unassigned* fp16 when InsertCastTransformer's
            # ForceSingleNodeCPUFloat16ToFloat32 looked at its neighbours (IsIsolatedFp16NodeOnCpu), so a
            # CPU fp16 node (LayerNormalization, Transpose, ...) between it and other unassigned nodes
            # was forced to fp32. A single-input Sum in fp16, which the CPU EP has no kernel for, plays
            # that unassigned neighbour here (an exact copy once ORT runs it in fp32), where a neighbour
            # could be forced at all (_may_be_isolated).
            for name in (a, bias):
                if name and name not in to_fp32:
                    src = name
                    if sentinel and name in producer and _may_be_isolated(producer[name]):
                        src = _fresh(taken, f"{name}_fp16")
                        pre.append(helper.make_node(sentinel, [name], [src], name=src))
                    to_fp32[name] = _fresh(taken, f"InsertedPrecisionFreeCast_{name}")
                    pre.append(helper.make_node("Cast", [src], [to_fp32[name]], name=to_fp32[name],
                                                to=TensorProto.FLOAT))
            a, bias = to_fp32[a], to_fp32[bias] if bias else ""
            out = _fresh(taken, f"InsertedPrecisionFreeCast_{c.output}")
            if sentinel and any(_may_be_isolated(n) for n in consumers.get(c.output, [])):
                y16 = _fresh(taken, f"{c.output}_fp16")
                post = [helper.make_node("Cast", [out], [y16], name=out, to=TensorProto.FLOAT16),
                        helper.make_node(sentinel, [y16], [c.output], name=y16)]
            else:
                post = [helper.make_node("Cast", [out], [c.output], name=out, to=TensorProto.FLOAT16)]
        inputs = [a, r.B.name, r.scales.name, r.zero_points.name if r.zero_points else "", "", bias]
        while inputs and not inputs[-1]:
            inputs.pop()
        node = helper.make_node(
            "MatMulNBits", inputs, [out], name=_fresh(node_names, c.ort_node_name or c.node), domain=MS_DOMAIN,
            K=c.K, N=c.N, bits=c.bits, block_size=c.block_size, accuracy_level=c.accuracy_level,
        )
        for extra in pre + post:
            extra.name = _fresh(node_names, extra.name)
        replace[c.node_index] = pre + [node] + post
        if c.fold_add is not None:
            if c.fold_add not in labels:
                raise ConversionError(f"Add node {c.fold_add!r} to fold was not found", tensor=c.weight)
            remove.add(labels[c.fold_add])
        g.initializer.extend([_external_tensor(t, location) for t in (r.B, r.scales, r.zero_points) if t is not None])
    # DQs (and a Gather's Cast) go once nothing reads their output any more.
    droppable = {r.candidate.dq_index for r in rewrites}
    for ga in gathers:
        c = ga.candidate
        replace[c.node_index] = dq_gather.gbq_nodes(ga, lambda base: _fresh(taken, base))
        g.initializer.extend([_external_tensor(t, location) for t in ga.out_tensors()])
        droppable.add(c.dq_index)
        if c.cast:
            droppable.add(labels[c.cast])
    graph_outputs = {o.name for o in g.output}
    while True:
        kept = [(i, replace.get(i, [n])) for i, n in enumerate(g.node) if i not in remove]
        read: set[str] = set(graph_outputs)
        for _, nodes in kept:
            for n in nodes:
                read |= _reads(n)
        gone = {i for i, nodes in kept if i in droppable and not any(o in read for o in nodes[0].output if o)}
        if not gone:
            break
        remove |= gone
    final = [n for _, nodes in kept for n in nodes]
    del g.node[:]
    g.node.extend(final)


def _drop_unused_initializers(model: onnx.ModelProto, candidates: set[tuple[str, str]]) -> None:
    """Remove the rewritten DQs' weights, scales and zero points once no node in any graph reads them."""
    used: set[str] = set()
    for _, g in iter_graphs(model.graph):
        for n in g.node:
            used.update(n.input)
        used.update(o.name for o in g.output)
    for path, g in iter_graphs(model.graph):
        drop = [t for t in g.initializer if (path, t.name) in candidates and t.name not in used]
        for t in drop:
            g.initializer.remove(t)
        names = {t.name for t in drop}
        for v in [v for v in g.input if v.name in names]:
            g.input.remove(v)
