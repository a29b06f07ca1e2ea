"""A conversion plan: the rewrites the rules chose, the weights carried unchanged, and where every
output tensor lives in weights.bin (or in a linked source file beside it).

Why rule-agnostic: the engine (layout, carried weights, which initializers die, the writer loop, the
skeleton rebuild in :mod:`.conversion`) sees each rule's rewrite only through :class:`RuleRewrite`, so
a rule is its matcher plus a small module (:mod:`.dq_matmul`, :mod:`.dq_gather`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import onnx

from ..model import Model
from ..onnx_walk import iter_graphs
from ..weights import WeightRef, page_align
from .skeleton_edit import Alias
from .sources import OutTensor
from .writers import Sink

if TYPE_CHECKING:  # the rules' own types name the plan's fields; the engine uses RuleRewrite only
    from .dq_gather import GatherRewrite
    from .dq_matmul import Rewrite


class RuleRewrite(Protocol):
    """What the engine needs of one rewrite of a rule (a node of the source model replaced)."""

    @property
    def graph_path(self) -> str: ...

    @property
    def label(self) -> str:
        """The replaced node's name, for progress lines."""

    @property
    def work_bytes(self) -> int:
        """Source bytes the conversion reads (progress, scheduling)."""

    @property
    def aliases(self) -> list[Alias]: ...

    def out_tensors(self) -> list[OutTensor]:
        """Tensors this rewrite writes into weights.bin, contiguous there in this order."""

    def removed_nodes(self) -> set[int]:
        """Indices (in its graph) of nodes that go for certain."""

    def droppable_nodes(self) -> set[int]:
        """Indices of nodes that go once nothing reads their outputs."""

    def consumed_names(self) -> list[str]:
        """Initializers the replaced nodes read: dropped when nothing reads them any more."""

    def kept_reads(self) -> list[str]:
        """Existing initializers the new nodes read (never dropped, never released)."""

    def convert(self, model: Model, sink: Sink) -> None:
        """Write :meth:`out_tensors` through ``sink``."""


class DQRewrite:
    """The part of :class:`RuleRewrite` a DequantizeLinear rule answers from its matcher candidate
    (``graph_path``, ``node``, and the DQ's ``weight``, ``scale``, ``zero_point``)."""

    candidate: Any

    @property
    def graph_path(self) -> str:
        return self.candidate.graph_path

    @property
    def label(self) -> str:
        return self.candidate.node

    def consumed_names(self) -> list[str]:
        c = self.candidate
        return [n for n in (c.weight, c.scale, c.zero_point) if n]


@dataclass
class ConversionPlan:
    """Everything one conversion does: one plan, one writer loop, one skeleton rewrite.

    ``rewrites``: DQ+MatMul/Gemm -> MatMulNBits. ``gathers``: DQ(+Cast)+Gather ->
    GatherBlockQuantized (:mod:`ortmem.passes.dq_gather`); their quantized tables are *carried*
    (in ``copied``), not converted. ``copied``: every weight the new graph still reads unchanged.
    """

    rewrites: list["Rewrite"]
    skipped: list[tuple[str, str]]  # (node, reason) for every DQ feeding a MatMul/Gemm/Gather left alone
    copied: list[tuple[WeightRef, OutTensor]]  # unchanged weights carried into weights.bin
    size: int = 0  # bytes of weights.bin
    gathers: list["GatherRewrite"] = field(default_factory=list)

    @property
    def all_rewrites(self) -> list[RuleRewrite]:
        """Every rule's rewrites, in the order their tensors are laid out."""
        return [*self.rewrites, *self.gathers]

    @property
    def converted_source_bytes(self) -> int:
        return sum(r.work_bytes for r in self.rewrites)

    @property
    def total_bytes(self) -> int:
        """Bytes the writer loop goes through (progress total)."""
        return sum(r.work_bytes for r in self.all_rewrites) + sum(t.nbytes for _, t in self.copied)

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
    #: Full digests (:mod:`ortmem.store.digest`) of the files written, computed while writing them; only
    #: when the caller asked (a cache entry records them in its manifest).
    file_digests: dict[str, str] = field(default_factory=dict)

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


def out_tensors(plan: ConversionPlan) -> list[OutTensor]:
    """Every tensor of the converted model that has a place (weights.bin or a linked source), in
    layout order."""
    out: list[OutTensor] = []
    for r in plan.all_rewrites:
        out += r.out_tensors()
    out += [t for _, t in plan.copied]
    return out


def layout(plan: ConversionPlan) -> None:
    """Page-aligned offsets in weights.bin for every output tensor that lives there: they tile the
    file, each tensor padded with zeros to the next page."""
    offset = 0
    for t in out_tensors(plan):
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
    layout(plan)


def add_carried(model: Model, plan: ConversionPlan) -> None:
    """Put every weight the new graph still reads into ``plan.copied``."""
    dropped = dropped_initializers(model.skeleton, plan)
    for w in model.weights:
        if (w.graph, w.name) in dropped and w.kind == "initializer":
            continue
        plan.copied.append((w, OutTensor(w.name, w.data_type, w.shape, w.nbytes)))


def dropped_initializers(skeleton: onnx.ModelProto, plan: ConversionPlan) -> set[tuple[str, str]]:
    """(graph, name) of the rewritten nodes' inputs (weights, scales, zero points) that nothing reads
    once the new graph exists: no node left (in any graph: subgraphs read outer names implicitly), no
    graph output, no new node. Only these may be left out of ``plan.copied``.

    A zero point may be shared by a fused DQ and one that stays (ORT's rule checks weight and scale
    only, ``docs/ort-fusion-rules.md`` check 8), and a Gather's DQ may stay for a tied MatMul: both
    keep their inputs.
    """
    removed: set[tuple[str, int]] = set()
    droppable: set[tuple[str, int]] = set()
    for r in plan.all_rewrites:
        removed |= {(r.graph_path, i) for i in r.removed_nodes()}
        droppable |= {(r.graph_path, i) for i in r.droppable_nodes()}
    graphs = list(iter_graphs(skeleton.graph))
    # droppable nodes go when their outputs have no reader left: iterate to a fixed point
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
                if (path, i) in droppable and (path, i) not in removed and not any(o in reads for o in n.output if o):
                    more.add((path, i))
        if not more:
            break
        removed |= more
    candidates = {(r.graph_path, n) for r in plan.all_rewrites for n in r.consumed_names()}
    still = reads | {n for r in plan.all_rewrites for n in r.kept_reads()}
    return {(path, name) for path, name in candidates if name not in still}
