"""A conversion plan: the rewrites the rules chose, the weights carried unchanged, and where every
output tensor lives in weights.bin (or in a linked source file beside it).

Why rule-agnostic: the engine (layout, carried weights, which initializers die, the writer loop, the
skeleton rebuild in :mod:`ortmem.passes.engine`) sees each rule's rewrite only through
:class:`~ortmem.passes.rule.RuleRewrite`, so a rule is its matcher plus a small module
(:mod:`ortmem.passes.rules.dq_matmul`, :mod:`ortmem.passes.rules.dq_gather`) listed in :data:`ortmem.passes.rules.RULES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ortmem.onnxfile.model import Model
from ortmem.onnxfile.walk import iter_graphs
from ortmem.onnxfile.weights import WeightRef, page_align
from ortmem.passes.rule import RuleRewrite
from ortmem.passes.tensors import OutTensor


@dataclass
class ConversionPlan:
    """Everything one conversion does: one plan, one writer loop, one skeleton rewrite.

    ``rewrites``: every rule's rewrites, in rule order (:data:`ortmem.passes.rules.RULES`), which is
    also the order their tensors are laid out in; each knows its rule (``rewrite.rule``).
    ``copied``: every weight the new graph still reads unchanged (a GatherBlockQuantized's table
    among them: carried, not converted).
    """

    rewrites: list[RuleRewrite]
    skipped: list[tuple[str, str]]  # (node, reason) for every DQ feeding a MatMul/Gemm/Gather left alone
    copied: list[tuple[WeightRef, OutTensor]]  # unchanged weights carried into weights.bin
    size: int = 0  # bytes of weights.bin
    #: Each rule's line for the report (``Rule.summary``), in rule order.
    done: list[str] = field(default_factory=list)

    def of_rule(self, name: str) -> list[RuleRewrite]:
        """The rewrites rule ``name`` planned (``dq_matmul.NAME``, ``dq_gather.NAME``...)."""
        return [r for r in self.rewrites if r.rule == name]

    @property
    def converted_source_bytes(self) -> int:
        return sum(r.converted_bytes for r in self.rewrites)

    @property
    def total_bytes(self) -> int:
        """Bytes the writer loop goes through (progress total)."""
        return sum(r.work_bytes for r in self.rewrites) + sum(t.nbytes for _, t in self.copied)

    @property
    def has_work(self) -> bool:
        """True when the converted graph differs from the source (any rule rewrote a node)."""
        return bool(self.rewrites)


def out_tensors(plan: ConversionPlan) -> list[OutTensor]:
    """Every tensor of the converted model that has a place (weights.bin or a linked source), in
    layout order."""
    out: list[OutTensor] = []
    for r in plan.rewrites:
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
    for r in plan.rewrites:
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
    candidates = {(r.graph_path, n) for r in plan.rewrites for n in r.consumed_names()}
    still = reads | {n for r in plan.rewrites for n in r.kept_reads()}
    return {(path, name) for path, name in candidates if name not in still}
