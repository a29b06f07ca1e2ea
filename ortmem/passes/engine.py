"""The rewrite engine: plan the rules' rewrites, write their tensors (to a file or to memory), and
build the new skeleton.

The rules are :data:`ortmem.passes.rules.RULES`, applied in that order; this module never names one.
Each rule (:class:`ortmem.passes.rule.Rule`) plans its rewrites, says what each writes and edits one
graph for them; the engine does the rest once for all: fresh names, which nodes a rule may still
claim, the layout of weights.bin (:mod:`.conversion_plan`), the writer loop (:mod:`.writers`), the
graph edits (:mod:`.skeleton_edit`).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import onnx
from onnx import helper

from ortmem.errors import ConversionError
from ortmem.onnxfile.model import Model
from ortmem.onnxfile.walk import iter_graphs, iter_tensor_sites
from ortmem.ort.release import Capabilities
from ortmem.ort.release import capabilities as installed_capabilities
from ortmem.ort.settings import OrtSettings
from ortmem.onnxfile.weights import page_align
from ortmem.passes.conversion_plan import ConversionPlan, add_carried, layout
from ortmem.passes.rule import PlanContext, RuleRewrite, claimed_by
from ortmem.passes.rules import RULES
from ortmem.passes.skeleton_edit import MS_DOMAIN, FreshNames, GraphEdit, add_aliases, all_names, drop_unused_initializers, point_to
from ortmem.passes.writers import FileSink, Job, MemorySink, OrderedDigest, Progress, Scratch, conversion_threads, copy_span, run_jobs


def plan_conversion(model: Model, settings: Optional[OrtSettings] = None, *, carry_unchanged: bool = True,
                    fp16_in_fp32: Optional[bool] = None, capabilities: Optional[Capabilities] = None) -> ConversionPlan:
    """Decide what to rewrite (each rule of :data:`~ortmem.passes.rules.RULES` in turn, on the nodes
    the ones before it left), and lay out every output tensor in weights.bin.

    ``carry_unchanged``: put every weight the new graph still reads into ``plan.copied`` (a self-contained
    output); False plans the rewritten tensors only.
    ``fp16_in_fp32``: whether a fused MatMulNBits with fp16 scales runs in fp32 in the target session.
    ``None`` asks ORT's CPU EP (:func:`ortmem.ort.fp16_kernels.runs_fp16_matmulnbits_in_fp32`;
    True on x86-64). CPU only: a caller whose session uses another EP that claims fp16 MatMuls (CUDA,
    DML) must pass False.
    """
    context = PlanContext(model, settings or OrtSettings(), capabilities or installed_capabilities(),
                          FreshNames(all_names(model.skeleton)), fp16_in_fp32)
    plan = ConversionPlan([], [], [])
    for rule in RULES:
        planned = rule.plan(context, claimed_by(plan.rewrites))
        plan.rewrites += planned.rewrites
        plan.skipped += planned.skipped
        line = rule.summary(planned.rewrites)
        if line:
            plan.done.append(line)
    if carry_unchanged:
        add_carried(model, plan)
    layout(plan)
    return plan


# ----------------------------------------------------------------------------- writing


def _jobs(model: Model, plan: ConversionPlan) -> list[Job]:
    """One job per rewrite that writes tensors (a GBQ that only reuses its inputs writes none)."""
    return [Job(r.work_bytes, r.label, r.out_tensors(), lambda sink, r=r: r.convert(model, sink))
            for r in plan.rewrites if r.out_tensors()]


def write_weights(model: Model, plan: ConversionPlan, out_path: Path, *, progress: Optional[Progress] = None,
                  threads: int = 0, digest: bool = False) -> Optional[str]:
    """Fill ``out_path`` (``plan.size`` bytes, already reserved zero-filled) with every output tensor.

    Each source span is released as soon as its tensor is done. ``digest``: also return the file's
    full digest (:mod:`ortmem.files.digest`), computed from the bytes as they are written, in file order
    (the jobs then run in file order, each commit after the one before it). ``threads`` counts as
    ORT's ``intra_op_num_threads`` does (0: one per physical core), capped
    (:func:`~ortmem.passes.writers.conversion_threads`).
    """
    threads = conversion_threads(threads)
    ordered = OrderedDigest() if digest else None
    fd = os.open(out_path, os.O_RDWR)
    try:
        scratch = [Scratch() for _ in range(threads)]
        jobs = _jobs(model, plan)
        if ordered is not None:
            _check_tiling(plan, jobs)
            jobs = [Job(j.nbytes, j.name, j.outs, _aborting(j, ordered)) for j in jobs]
        total = plan.total_bytes
        done = run_jobs(jobs, lambda slot: FileSink(fd, scratch[slot], ordered), len(scratch),
                        in_file_order=ordered is not None, progress=progress, total=total)
        for ref, t in plan.copied:
            if t.location is None:
                copy_span(ref, fd, t.offset, ordered, t)
            done += t.nbytes
            if progress:
                progress(done, total, ref.name)
    finally:
        os.close(fd)
    return ordered.hexdigest(plan.size) if ordered is not None else None


def _check_tiling(plan: ConversionPlan, jobs: list[Job]) -> None:
    """The jobs and the copies must cover weights.bin end to end, each region starting where the one
    before ended: an ordered digest waits for each region's predecessor, so a gap would never end."""
    regions = [(j.offset, page_align(j.outs[-1].offset + j.outs[-1].nbytes)) for j in jobs]
    regions += [(t.offset, page_align(t.offset + t.nbytes)) for _, t in plan.copied if t.location is None]
    position = 0
    for start, end in sorted(regions):
        if start != position:
            raise ConversionError(f"internal: weights.bin layout has a gap or overlap at {position}")
        position = end
    if position != plan.size:
        raise ConversionError(f"internal: weights.bin layout ends at {position}, not {plan.size}")


def _aborting(job: Job, ordered: OrderedDigest):
    """``job.convert``, which on failure wakes the jobs waiting for its turn (they fail too)."""
    def run(sink) -> None:
        try:
            job.convert(sink)
        except BaseException:
            ordered.abort()
            raise
    return run


def convert_into_memory(model: Model, plan: ConversionPlan, buffer, *, progress: Optional[Progress] = None,
                        threads: int = 0) -> float:
    """Convert every rewrite straight into ``buffer`` (``plan.size`` bytes, e.g. an anonymous mmap) at
    the same offsets weights.bin would use; carried tensors are not touched (their pages stay unused).
    Returns seconds. ``threads`` as in :func:`write_weights`."""
    start = time.perf_counter()
    run_jobs(_jobs(model, plan), lambda slot: MemorySink(buffer), conversion_threads(threads), progress=progress,
             total=plan.total_bytes)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- the new graph


def rewrite_skeleton(model: Model, plan: ConversionPlan, location: str, *,
                     move_carried: bool = True) -> onnx.ModelProto:
    """A copy of the skeleton with MatMulNBits in place of each rewritten DQ+MatMul(+Add)/Gemm and
    GatherBlockQuantized in place of each rewritten DQ(+Cast)+Gather.

    Converted tensors point into ``location``; carried (unchanged) tensors too when ``move_carried``,
    else they keep pointing where they were (the in-memory handoff reads them from the source files).
    An alias (same bytes, other dtype or dims) is a copy of its source's TensorProto *after* the
    source was pointed at its final place, so both name the same bytes.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model.skeleton)  # the skeleton holds no weight bytes: this copy is small
    by_graph: dict[str, list[RuleRewrite]] = {}
    for r in plan.rewrites:
        by_graph.setdefault(r.graph_path, []).append(r)
    aliases = [a for r in plan.rewrites for a in r.aliases]
    fresh = FreshNames(all_names(out) | {t.name for r in plan.rewrites for t in r.out_tensors()}
                       | {t.name for _, t in plan.copied} | {a.name for a in aliases})
    # Deepest graphs first: rebuilding a graph's node list copies its nodes, subgraphs included, so a
    # subgraph must be final before its parent is rebuilt (and is looked up afresh each time).
    for path in sorted(by_graph, key=lambda p: (-p.count("/"), p)):
        graph = dict(iter_graphs(out.graph))[path]
        edit = GraphEdit(graph, replaced={r.node_index for r in by_graph[path]})
        for rule in RULES:  # in rule order: the fresh names each takes depend on it
            mine = [r for r in by_graph[path] if r.rule == rule.name]
            if mine:
                rule.edit_graph(edit, mine, location, fresh)
        edit.apply()
    carried = {(ref.graph, ref.kind, ref.name): t for ref, t in plan.copied} if move_carried else {}
    for site in iter_tensor_sites(out):
        t = carried.get(site.key)
        if t is not None:
            point_to(site.tensor, t.location or location, t)
    add_aliases(out, aliases)
    drop_unused_initializers(out, {(r.graph_path, n) for r in plan.rewrites for n in r.consumed_names()})
    if plan.has_work and not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return out
