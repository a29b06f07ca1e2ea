"""What a rule is to the rewrite engine: :class:`Rule` (plan its rewrites, edit one graph for them,
say what it did) and :class:`RuleRewrite` (one rewrite: what it writes, which nodes it replaces).

Why protocols: the engine (:mod:`ortmem.passes.engine`, :mod:`.conversion_plan`) iterates
:data:`ortmem.passes.rules.RULES` and never names a rule, so a new rewrite is one module that
implements these two and one line in that list. A rule sees the model and the target session
through :class:`PlanContext`, and the nodes earlier rules already rewrite through ``claimed``: a node
is rewritten by one rule at most.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from ortmem.base.records import record
from ortmem.onnxfile.model import Model
from ortmem.ort.release import Capabilities
from ortmem.ort.settings import OrtSettings
from ortmem.passes.skeleton_edit import Alias, GraphEdit
from ortmem.passes.tensors import OutTensor
from ortmem.passes.writers import Sink

#: A node of the source model: (graph path, index in that graph).
NodeKey = tuple[str, int]


class RuleRewrite(Protocol):
    """What the engine needs of one rewrite of a rule (a node of the source model replaced)."""

    @property
    def rule(self) -> str:
        """The name of the :class:`Rule` that planned it."""

    @property
    def graph_path(self) -> str: ...

    @property
    def label(self) -> str:
        """The replaced node's name, for progress lines."""

    @property
    def node_index(self) -> int:
        """The replaced node's index in its graph (its name is free for the new nodes)."""

    @property
    def work_bytes(self) -> int:
        """Source bytes the conversion reads (progress, scheduling)."""

    @property
    def converted_bytes(self) -> int:
        """Bytes of source weights this rewrite converts into a new form (the report's throughput);
        0 for a rewrite that reads its weights as they are."""

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


@dataclass
class PlanContext:
    """What every rule plans against: the loaded model, the target session's settings and the
    installed ORT's capabilities; ``fresh(base)`` gives an unused tensor name (shared by all rules,
    so their names never collide). ``fp16_in_fp32``: whether a fused MatMulNBits with fp16 scales
    runs in fp32 in the target session (None: ask ORT's CPU EP)."""

    model: Model
    settings: OrtSettings
    capabilities: Capabilities
    fresh: Callable[[str], str]
    fp16_in_fp32: Optional[bool] = None


@record
class Planned:
    """A rule's answer: its rewrites, and ``(node, reason)`` for each candidate it left alone."""

    rewrites: Sequence[RuleRewrite]
    skipped: list[tuple[str, str]]


class Rule(Protocol):
    """One rewrite of the source graph (DQ+MatMul -> MatMulNBits, DQ+Gather -> GatherBlockQuantized)."""

    @property
    def name(self) -> str: ...

    def plan(self, context: PlanContext, claimed: frozenset[NodeKey]) -> Planned:
        """Every rewrite this rule makes of ``context.model``, leaving out nodes in ``claimed``
        (rewritten by an earlier rule)."""

    def edit_graph(self, edit: GraphEdit, rewrites: Sequence[Any], location: str, fresh: Callable[[str], str]) -> None:
        """Replace this rule's rewritten nodes of one graph (``rewrites``: its own, of that graph);
        their new tensors point into ``location``."""

    def summary(self, rewrites: Sequence[Any]) -> Optional[str]:
        """What this rule did, for the conversion report (None: nothing worth a line)."""


def claimed_by(rewrites: Sequence[RuleRewrite]) -> frozenset[NodeKey]:
    """The nodes ``rewrites`` remove or may drop: no later rule may rewrite them."""
    return frozenset((r.graph_path, i) for r in rewrites for i in r.removed_nodes() | r.droppable_nodes())


def already_claimed(graph_path: str, nodes: Sequence[int], claimed: frozenset[NodeKey]) -> bool:
    return any((graph_path, i) in claimed for i in nodes)


CLAIMED_REASON = "already rewritten by an earlier rule"


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

    @property
    def node_index(self) -> int:
        return self.candidate.node_index

    def consumed_names(self) -> list[str]:
        c = self.candidate
        return [n for n in (c.weight, c.scale, c.zero_point) if n]
