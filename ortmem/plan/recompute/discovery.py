"""Candidates: the readers of each long-lived buffer split into groups, a clone per later group, clones clustered by pattern.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


from ortmem.ort import graph_index as og
from ortmem.plan.estimate.liveness import Liveness
from ortmem.plan.recompute.cost import CLASS_RANK, cost_class, node_flops
from ortmem.plan.recompute.state import State


@dataclass
class Occurrence:
    """One clone: recompute ``values`` of buffer ``tensor`` for the readers in ``consumers``."""

    tensor: str
    values: list[str]
    nbytes: int
    group: int  # 1 = the second reader group, ...
    first_reader: int  # step of the group's first reader (in the state's order)
    consumers: list[int]  # node indices (state graph)
    subgraph: list[int]  # node indices recomputed, in execution order
    sources: list[str]  # tensors the clone reads
    pattern: str
    cost_class: str
    flops: int


@dataclass
class Cluster:
    pattern: str
    cost_class: str
    occurrences: list[Occurrence]  # nearest the end of the run first (what a count keeps)

    @property
    def flops(self) -> int:
        return sum(o.flops for o in self.occurrences)

    @property
    def tensors(self) -> list[str]:
        return list(dict.fromkeys(o.tensor for o in self.occurrences))


def _readers(lv: Liveness, g: og.OrtGraph) -> tuple[dict[str, list[int]], dict[str, bool]]:
    """Steps reading each value, and whether some reader reads it from inside a subgraph."""
    readers: dict[str, list[int]] = {}
    implicit: dict[str, bool] = {}
    for p, i in enumerate(lv.order):
        n = g.nodes[i]
        for v in n.inputs:
            if v:
                readers.setdefault(v, []).append(p)
        for v in n.implicit_inputs:
            readers.setdefault(v, []).append(p)
            implicit[v] = True
    return readers, implicit


def _groups(positions: list[int], live: list[int]) -> list[list[int]]:
    """Reader steps split where some step between two consecutive readers holds more than both."""
    positions = sorted(set(positions))
    if not positions:
        return []
    groups = [[positions[0]]]
    for a, b in zip(positions, positions[1:]):
        gap = max(live[a + 1:b], default=0)
        if gap > max(live[a], live[b]):
            groups.append([b])
        else:
            groups[-1].append(b)
    return groups


def discover(state: State, classes: Iterable[str] = ("free", "cheap"), *, max_nodes: int = 48,
             min_bytes: int = 1) -> list[Occurrence]:
    """Every occurrence in ``state``: clones of buffers read by two or more reader groups, built from
    ops of the given cost ``classes``, at most ``max_nodes`` nodes each."""
    ctx, lv = state.ctx, state.liveness
    g = ctx.root
    allowed = set(classes)
    order = lv.order
    pos = {i: p for p, i in enumerate(order)}
    live = [s.live_bytes for s in lv.steps]
    readers, implicit = _readers(lv, g)
    last = {v: max(ps) for v, ps in readers.items()}
    outputs = set(g.outputs)
    removed = ctx.removed

    def available(x: str, q: int, own: set[str]) -> bool:
        if x in own:
            return False
        if x in g.inputs or g.find_initializer(x) is not None:
            return True
        p = g.producer.get(x)
        if p is None:
            return True  # outer scope or graph input under another name: not ours to free
        if id(g.nodes[p]) in removed:
            return True  # ORT folds it into a constant before the run
        if pos.get(p, q) >= q:
            return False
        return x in outputs or last.get(x, -1) >= q

    found: list[Occurrence] = []
    for t in lv.tensors:
        if t.nbytes < min_bytes or any(v in outputs for v in t.values) or any(implicit.get(v) for v in t.values):
            continue
        groups = _groups(t.consumers, live)
        if len(groups) < 2:
            continue
        own = set(t.values)
        for k, grp in enumerate(groups[1:], start=1):
            q = grp[0]
            cons = [order[p] for p in grp]
            wanted = [v for v in t.values if any(v in g.nodes[c].inputs for c in cons)]
            sub: set[int] = set()
            stack = list(wanted)
            ok = True
            seen: set[str] = set()
            srcs: list[str] = []
            while stack and ok:
                x = stack.pop()
                if x in seen:
                    continue
                seen.add(x)
                if available(x, q, own):
                    srcs.append(x)
                    continue
                p = g.producer.get(x)
                node = g.nodes[p] if p is not None else None
                cls = cost_class(node) if node is not None else None
                if node is None or cls is None or cls not in allowed or id(node) in removed:
                    ok = False
                    break
                if p not in sub:
                    sub.add(p)
                    if len(sub) > max_nodes:
                        ok = False
                        break
                    stack.extend(v for v in node.inputs if v)
            if not ok or not sub:
                continue
            nodes = sorted(sub, key=lambda i: pos[i])
            cls = max((cost_class(g.nodes[i]) or "cheap" for i in nodes), key=lambda c: CLASS_RANK[c])
            pattern = _pattern(g, sub)
            found.append(Occurrence(t.name, wanted, t.nbytes, k, q, cons, nodes, sorted(set(srcs)), pattern, cls,
                                    sum(node_flops(ctx, g.nodes[i]) for i in nodes)))
    return found


def _pattern(g: og.OrtGraph, sub: set[int]) -> str:
    """The clone's op types in a topological order that depends on structure, not node numbering
    (Kahn over the subgraph, the alphabetically first ready op next), ``+``-joined as ORT names them;
    so the same plan string selects the same clones whatever order or file layout the model has."""
    indeg = {i: len(g.input_nodes(i) & sub) for i in sub}
    ready = sorted((g.nodes[i].op_type, i) for i in sub if indeg[i] == 0)
    out: list[str] = []
    while ready:
        op, i = ready.pop(0)
        out.append(op + "+")
        for j in g.output_nodes(i) & sub:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append((g.nodes[j].op_type, j))
        ready.sort(key=lambda t: t[0])
    return "".join(out)


def clusters(occurrences: Iterable[Occurrence]) -> list[Cluster]:
    """Occurrences grouped by pattern; within a cluster the clones nearest the end of the run first."""
    by: dict[str, list[Occurrence]] = {}
    for o in occurrences:
        by.setdefault(o.pattern, []).append(o)
    out = []
    for pattern, occ in by.items():
        occ.sort(key=lambda o: (-o.first_reader, o.tensor))
        cls = max((o.cost_class for o in occ), key=lambda c: CLASS_RANK[c])
        out.append(Cluster(pattern, cls, occ))
    out.sort(key=lambda c: (min(o.first_reader for o in c.occurrences), c.pattern))
    return out


