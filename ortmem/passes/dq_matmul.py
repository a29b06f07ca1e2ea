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
from ..weights import PAGE, WeightRef
from . import nbits_layout as nb
from .dq_matmul_match import Candidate, MatchResult, OrtSettings, dq_matmul_match

MS_DOMAIN = "com.microsoft"
WEIGHTS_FILE = "weights.bin"

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, tensor name)


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass
class OutTensor:
    """A tensor of the output model: where its bytes go in weights.bin."""

    name: str
    data_type: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0
    location: Optional[str] = None  # None: weights.bin; else a file beside it (a linked source)


@dataclass
class Rewrite:
    candidate: Candidate
    B: OutTensor
    scales: OutTensor
    zero_points: Optional[OutTensor]

    @property
    def source_bytes(self) -> int:
        c = self.candidate
        return -(-c.K * c.N * c.bits // 8)


@dataclass
class ConversionPlan:
    rewrites: list[Rewrite]
    skipped: list[tuple[str, str]]  # (node, reason) for every DQ feeding a MatMul/Gemm left alone
    copied: list[tuple[WeightRef, OutTensor]]  # unchanged weights carried into weights.bin
    size: int = 0  # bytes of weights.bin

    @property
    def converted_source_bytes(self) -> int:
        return sum(r.source_bytes for r in self.rewrites)


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

    def summary(self) -> str:
        lines = [
            f"converted {self.converted} DQ+MatMul pattern(s) to MatMulNBits, left {len(self.skipped)} as they were",
            f"{self.source_bytes / 2**20:.1f} MiB of quantized weights in {self.seconds:.2f} s "
            f"({self.throughput_gbps:.2f} GB/s); weights.bin {self.output_bytes / 2**20:.1f} MiB",
        ]
        lines += [f"  left as is: {node}: {reason}" for node, reason in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_conversion(model: Model, settings: Optional[OrtSettings] = None, *, carry_unchanged: bool = True) -> ConversionPlan:
    """Decide what to rewrite (ORT's rule), and lay out every output tensor in weights.bin."""
    result: MatchResult = dq_matmul_match(model.skeleton, settings=settings or OrtSettings())
    rewrites: list[Rewrite] = []
    skipped = [(f"{r.node} -> {r.consumer}", r.reason) for r in result.rejected]
    taken: set[str] = _all_names(model.skeleton)
    for c in result.candidates:
        if c.ort_outcome == "session_error":
            skipped.append((c.node, "ORT's own rule fails session creation here; left for ORT to report: " + "; ".join(c.notes)))
            continue
        try:
            _source(model, c.graph_path, c.weight)
        except ConversionError as e:
            skipped.append((c.node, str(e)))
            continue
        need_zp = nb.needs_zero_points(c.signed, c.has_zp)
        shp = nb.matmulnbits_shapes(c.K, c.N, c.bits, c.block_size, need_zp)
        B = OutTensor(_fresh(taken, f"{c.weight}_Q{c.bits}"), TensorProto.UINT8, shp.B, int(np.prod(shp.B)))
        s_info = dtype_info(c.scale_dtype)
        scales = OutTensor(_fresh(taken, f"{c.weight}_scales"), c.scale_dtype, shp.scales,
                           int(np.prod(shp.scales)) * s_info.numpy.itemsize)
        zp = None
        if need_zp:
            zp = OutTensor(_fresh(taken, f"{c.weight}_zp"), TensorProto.UINT8, shp.zero_points, int(np.prod(shp.zero_points)))
        rewrites.append(Rewrite(c, B, scales, zp))

    plan = ConversionPlan(rewrites, skipped, [])
    consumed = {(r.candidate.graph_path, n) for r in rewrites for n in _consumed_names(r.candidate)}
    if carry_unchanged:
        for w in model.weights:
            if (w.graph, w.name) in consumed and w.kind == "initializer":
                continue
            plan.copied.append((w, OutTensor(w.name, w.data_type, w.shape, w.nbytes)))
    _layout(plan)
    return plan


def _layout(plan: ConversionPlan) -> None:
    """Page-aligned offsets in weights.bin for every output tensor that lives there."""
    offset = 0
    for t in _out_tensors(plan):
        if t.location is None:
            t.offset = offset
            offset = _align(offset + t.nbytes)
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
    out += [t for _, t in plan.copied]
    return out


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


# ----------------------------------------------------------------------------- reading sources


def _find_initializer(model: Model, graph_path: str, name: str) -> tuple[str, TensorProto]:
    """The initializer ``name`` as seen from ``graph_path`` (outer scopes included, as ORT looks it up)."""
    graphs = dict(iter_graphs(model.skeleton.graph))
    path = graph_path
    while True:
        g = graphs.get(path)
        if g is not None:
            for t in g.initializer:
                if t.name == name:
                    return path, t
        if not path:
            break
        path = path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""
    raise ConversionError("initializer not found (a Constant node or graph input?)", tensor=name, file=str(model.path))


def _source(model: Model, graph_path: str, name: str) -> np.ndarray:
    """The raw bytes of an initializer: a zero-copy view of its mapped span, or the inline bytes."""
    path, t = _find_initializer(model, graph_path, name)
    if is_external(t):
        return model.store.get(name, path).raw()
    if t.raw_data:
        return np.frombuffer(t.raw_data, dtype=np.uint8)
    arr = numpy_helper.to_array(t)  # typed fields: small tensors only (scales, zero points)
    if dtype_info(t.data_type).packed:
        raise ConversionError("packed sub-byte tensor stored in typed fields is not supported", tensor=name, file=str(model.path))
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _source_ref(model: Model, graph_path: str, name: str) -> Optional[WeightRef]:
    path, t = _find_initializer(model, graph_path, name)
    return model.store.get(name, path) if is_external(t) else None


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
    return plan.converted_source_bytes + sum(t.nbytes for _, t in plan.copied)


def _convert_all(model: Model, plan: ConversionPlan, sink_for, workers: int, progress: Optional[Progress]) -> int:
    """Convert the rewrites on ``workers`` threads (numpy releases the GIL in the kernels), biggest first."""
    done = 0
    order = sorted(range(len(plan.rewrites)), key=lambda i: -plan.rewrites[i].B.nbytes)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {i: pool.submit(_convert_one, model, plan.rewrites[i], sink_for(plan.rewrites[i], n % workers))
                   for n, i in enumerate(order)}
        for i in order:
            futures[i].result()
            done += plan.rewrites[i].source_bytes
            if progress:
                progress(done, _total(plan), plan.rewrites[i].candidate.node)
    return done


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
        buf = self.scratch.take(sum(_align(t.nbytes) for t in outs))
        views, pos = [], 0
        for t, dt in zip(outs, dtypes):
            views.append(buf[pos : pos + t.nbytes].view(dt).reshape(t.shape))
            pos += _align(t.nbytes)
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
        return [np.frombuffer(self.buffer, dtype=dt, count=t.nbytes // np.dtype(dt).itemsize, offset=t.offset).reshape(t.shape)
                for t, dt in zip(outs, dtypes)]

    def commit(self, outs: list[OutTensor], views: list[np.ndarray]) -> None:
        pass


def _convert_one(model: Model, r: Rewrite, sink) -> None:
    c = r.candidate
    s_dtype = dtype_info(c.scale_dtype).numpy
    w = _source(model, c.graph_path, c.weight)
    scales = _source(model, c.graph_path, c.scale).view(s_dtype)
    zp = _source(model, c.graph_path, c.zero_point) if c.zero_point else None
    if c.kind != "blockwise":
        # per-tensor / per-channel: expand to blocks as ORT does (scales are [N] or scalar: small)
        scales, zp = nb.expand_to_blocks(scales, zp, c.K, c.N, c.bits, c.block_size)
    else:
        scales = scales.reshape(-(-c.K // c.block_size), c.N)
    outs = [t for t in (r.B, r.scales, r.zero_points) if t is not None]
    dtypes = [s_dtype if t is r.scales else np.uint8 for t in outs]
    with sink:
        views = sink.views(outs, dtypes)
        nb.convert_dq_weights(w, scales, zp, K=c.K, N=c.N, bits=c.bits, signed=c.signed, block_size=c.block_size,
                              out_B=views[0], out_scales=views[1],
                              out_zero_points=views[2] if r.zero_points is not None else None)
        sink.commit(outs, views)
    del views, w, scales, zp
    ref = _source_ref(model, c.graph_path, c.weight)
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
    """A copy of the skeleton with MatMulNBits in place of each rewritten DQ+MatMul(+Add)/Gemm.

    Converted tensors point into ``location``; carried (unchanged) tensors too when ``move_carried``,
    else they keep pointing where they were (the in-memory handoff reads them from the source files).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model.skeleton)  # the skeleton holds no weight bytes: this copy is small
    graphs = dict(iter_graphs(out.graph))
    by_graph: dict[str, list[Rewrite]] = {}
    for r in plan.rewrites:
        by_graph.setdefault(r.candidate.graph_path, []).append(r)
    for path, rewrites in by_graph.items():
        _rewrite_graph(graphs[path], rewrites, location)
    _drop_unused_initializers(out, {(r.candidate.graph_path, n) for r in plan.rewrites for n in _consumed_names(r.candidate)})
    carried = {(ref.graph, ref.kind, ref.name): t for ref, t in plan.copied} if move_carried else {}
    for site in iter_tensor_sites(out):
        t = carried.get(site.key)
        if t is not None:
            _point_to(site.tensor, t.location or location, t)
    if plan.rewrites and not any(o.domain == MS_DOMAIN for o in out.opset_import):
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


def _rewrite_graph(g: onnx.GraphProto, rewrites: list[Rewrite], location: str) -> None:
    labels = {node_label(n, i): i for i, n in enumerate(g.node)}
    remove: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for r in rewrites:
        c = r.candidate
        inputs = [c.input_a, r.B.name, r.scales.name, r.zero_points.name if r.zero_points else "", "", c.bias or ""]
        while inputs and not inputs[-1]:
            inputs.pop()
        node = helper.make_node(
            "MatMulNBits", inputs, [c.output], name=c.ort_node_name, domain=MS_DOMAIN,
            K=c.K, N=c.N, bits=c.bits, block_size=c.block_size, accuracy_level=c.accuracy_level,
        )
        replace[c.node_index] = node
        if c.fold_add is not None:
            if c.fold_add not in labels:
                raise ConversionError(f"Add node {c.fold_add!r} to fold was not found", tensor=c.weight)
            remove.add(labels[c.fold_add])
        g.initializer.extend([_external_tensor(t, location) for t in (r.B, r.scales, r.zero_points) if t is not None])
    # A DQ goes once nothing reads its output any more.
    kept = [(i, replace.get(i, n)) for i, n in enumerate(g.node) if i not in remove]
    readers: dict[str, int] = {}
    for _, n in kept:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    graph_outputs = {o.name for o in g.output}
    dq_indices = {r.candidate.dq_index for r in rewrites}
    final = [n for i, n in kept if not (i in dq_indices and readers.get(n.output[0], 0) == 0 and n.output[0] not in graph_outputs)]
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
