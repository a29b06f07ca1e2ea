"""Peak-minimizing node orders: ORT's two orders, greedy and beam list schedules, local moves around the peak, exhaustive search for small graphs.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence


from ortmem.plan.estimate import activations as act
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og
from ortmem.plan.estimate.liveness import Context, analyze


def _active(ctx: Context, order: Sequence[int]) -> list[int]:
    """``order`` without the nodes ORT folds into constants (they never run)."""
    return [i for i in order if id(ctx.root.nodes[i]) not in ctx.removed]


def with_removed(ctx: Context, order: Sequence[int]) -> list[int]:
    """The folded nodes first (in file order; they read only constants), then ``order``'s others."""
    rem = [i for i in range(len(ctx.root.nodes)) if id(ctx.root.nodes[i]) in ctx.removed]
    return rem + _active(ctx, order)


def evaluate_order(ctx: Context, order: Sequence[int]) -> int:
    """Peak of ``order`` exactly as the liveness model counts it."""
    return ctx.activation(order, {}).peak_bytes


def realized(ctx: Context, order: Sequence[int]) -> list[int]:
    """The order ORT's ``PRIORITY_BASED`` runs once the file is written in ``order``."""
    rank = [0] * len(ctx.root.nodes)
    for r, i in enumerate(with_removed(ctx, order)):
        rank[i] = r
    return _active(ctx, ctx.root.priority_order(rank))


def _sizes(ctx: Context) -> tuple[dict[str, int], set[str]]:
    g = ctx.root
    local = {o for n in g.nodes if id(n) not in ctx.removed for o in n.outputs if o}
    return {v: shp.granule(ctx.nbytes(v)) for v in local}, local


def greedy_order(ctx: Context, mode: str = "footprint", base: Sequence[int] | None = None) -> list[int]:
    """A list schedule: at each step the ready node with the lowest immediate footprint (``footprint``:
    live + new outputs + workspace, ties to the larger release) or the largest net release
    (``release``: freed - allocated), ties to ``base`` (default ORT's ``DEFAULT`` order)."""
    g = ctx.root
    n = len(g.nodes)
    base = list(base) if base is not None else g.execution_order("DEFAULT")
    rank = {i: r for r, i in enumerate(base)}
    size, local = _sizes(ctx)
    outputs = set(g.outputs)
    users: dict[str, set[int]] = {}
    for i, node in enumerate(g.nodes):
        for v in {*node.inputs, *node.implicit_inputs}:
            if v in local:
                users.setdefault(v, set()).add(i)
    remaining = {v: len(u) for v, u in users.items()}
    indeg = [len(g.input_nodes(i)) for i in range(n)]
    ready = {i for i in range(n) if indeg[i] == 0}
    live = 0
    order: list[int] = []
    alias = act.ALIAS_OPS
    while ready:
        best, best_key = -1, None
        for i in ready:
            node = g.nodes[i]
            new = 0 if (node.op_type in alias and node.domain in ("", "ai.onnx")) or id(node) in ctx.removed else \
                sum(size.get(o, 0) for o in node.outputs if o)
            freed = sum(size.get(v, 0) for v in {*node.inputs, *node.implicit_inputs}
                        if v in remaining and remaining[v] == 1 and v not in outputs)
            ws = ctx.workspace(node, ctx.shapes) if new else 0
            key = (live + new + ws, new - freed, rank[i]) if mode == "footprint" else (new - freed, live + new + ws, rank[i])
            if best_key is None or key < best_key:
                best, best_key = i, key
        i = best
        ready.discard(i)
        order.append(i)
        node = g.nodes[i]
        if not ((node.op_type in alias and node.domain in ("", "ai.onnx")) or id(node) in ctx.removed):
            live += sum(size.get(o, 0) for o in node.outputs if o)
        for v in {*node.inputs, *node.implicit_inputs}:
            if v in remaining:
                remaining[v] -= 1
                if remaining[v] == 0 and v not in outputs:
                    live -= size.get(v, 0)
        for j in g.output_nodes(i):
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.add(j)
    if len(order) != n:
        raise ValueError("graph has a cycle")
    return _active(ctx, order)


def beam_order(ctx: Context, width: int = 16, max_nodes: int = 600) -> list[int] | None:
    """List scheduling with a beam: partial schedules ranked by (peak so far, live now), one kept per
    set of executed nodes (the live set depends on the set only), ``width`` kept per step. Approaches
    exhaustive search on small graphs; None above ``max_nodes`` (quadratic in the graph size)."""
    g = ctx.root
    n = len(g.nodes)
    if n > max_nodes:
        return None
    size, local = _sizes(ctx)
    outputs = set(g.outputs)
    users: dict[str, int] = {}
    for node in g.nodes:
        for v in {*node.inputs, *node.implicit_inputs}:
            if v in local:
                users[v] = users.get(v, 0) + 1
    alias = act.ALIAS_OPS

    def new_bytes(i: int) -> int:
        node = g.nodes[i]
        if (node.op_type in alias and node.domain in ("", "ai.onnx")) or id(node) in ctx.removed:
            return 0
        return sum(size.get(o, 0) for o in node.outputs if o)

    new = [new_bytes(i) for i in range(n)]
    ws = [ctx.workspace(g.nodes[i], ctx.shapes) if new[i] else 0 for i in range(n)]
    ins = [[v for v in {*g.nodes[i].inputs, *g.nodes[i].implicit_inputs} if v in users] for i in range(n)]
    preds = [g.input_nodes(i) for i in range(n)]
    # beam entries: (peak, live, order, done, remaining-users)
    beam = [(0, 0, [], frozenset(), dict(users))]
    for _ in range(n):
        cand: dict[frozenset, tuple] = {}
        for peak, live, order, done, rem in beam:
            ready = [i for i in range(n) if i not in done and preds[i] <= done]
            for i in ready:
                step_peak = max(peak, live + new[i] + ws[i])
                r2 = dict(rem)
                freed = 0
                for v in ins[i]:
                    r2[v] -= 1
                    if r2[v] == 0 and v not in outputs:
                        freed += size.get(v, 0)
                live2 = live + new[i] - freed
                d2 = done | {i}
                prev = cand.get(d2)
                if prev is None or (step_peak, live2) < (prev[0], prev[1]):
                    cand[d2] = (step_peak, live2, order + [i], d2, r2)
        beam = sorted(cand.values(), key=lambda e: (e[0], e[1]))[:width]
    return _active(ctx, beam[0][2]) if beam else None


def _cone_up(g: og.OrtGraph, start: int, lo: int, pos: dict[int, int]) -> set[int]:
    """``start`` and its ancestors placed at or after step ``lo``."""
    cone, stack = set(), [start]
    while stack:
        i = stack.pop()
        if i in cone:
            continue
        cone.add(i)
        stack.extend(j for j in g.input_nodes(i) if pos.get(j, -1) >= lo)
    return cone


def _cone_down(g: og.OrtGraph, producer: int, pos: dict[int, int]) -> set[int]:
    """``producer`` and its ancestors whose every reader is inside the set (an exclusive producer cone)."""
    cone = {producer}
    changed = True
    while changed:
        changed = False
        for i in list(cone):
            for j in g.input_nodes(i):
                if j in cone or j not in pos:
                    continue
                if all(k in cone for k in g.output_nodes(j)):
                    cone.add(j)
                    changed = True
    return cone


def _move(order: list[int], members: set[int], target: int) -> list[int]:
    """``order`` with ``members`` (kept in their relative order) moved to just before step ``target``."""
    moved = [i for i in order if i in members]
    rest = [(p, i) for p, i in enumerate(order) if i not in members]
    out, done = [], False
    for p, i in rest:
        if not done and p >= target:
            out.extend(moved)
            done = True
        out.append(i)
    if not done:
        out.extend(moved)
    return out


def _valid(g: og.OrtGraph, order: list[int]) -> bool:
    """Every edge between nodes of ``order`` points forward (folded nodes are not in it)."""
    pos = {i: p for p, i in enumerate(order)}
    return all(pos[j] < pos[i] for i in order for j in g.input_nodes(i) if j in pos)


def improve_order(ctx: Context, order: Sequence[int], *, rounds: int = 40, realize: bool = True) -> list[int]:
    """Local moves around the peak (see the module docstring), accepted while they lower the peak.
    With ``realize`` each candidate is scored as ORT's ``PRIORITY_BASED`` would run it."""
    g = ctx.root
    cur = list(realized(ctx, order) if realize else order)
    cur_peak = evaluate_order(ctx, cur)
    for _ in range(rounds):
        lv = analyze(ctx, cur)
        p = lv.peak_position
        pos = {i: k for k, i in enumerate(cur)}
        tries: list[list[int]] = []
        for t in lv.across_peak[:12]:  # sink what is alive across the peak
            prod = cur[t.start]
            firsts = [c for c in t.consumers if c > p]
            if not firsts:
                continue
            cone = _cone_down(g, prod, pos)
            target = min(min(pos[j] for j in g.output_nodes(i) if j not in cone) if g.output_nodes(i) - cone else len(cur)
                         for i in cone)
            if target > p:
                tries.append(_move(cur, cone, target))
            for c in firsts[:2]:  # hoist its next reader (and what that reader still needs) above the peak
                cone_up = _cone_up(g, cur[c], p, pos)
                tries.append(_move(cur, cone_up, p))
        best, best_peak = None, cur_peak
        for cand in tries:
            if not _valid(g, cand):
                continue
            cand = realized(ctx, cand) if realize else cand
            pk = evaluate_order(ctx, cand)
            if pk < best_peak:
                best, best_peak = cand, pk
        if best is None:
            break
        cur, cur_peak = best, best_peak
    return cur


@dataclass
class OrderResult:
    order: list[int]  # as ORT will run it (PRIORITY_BASED replay of the rewritten file)
    peak_bytes: int
    default_peak_bytes: int
    priority_peak_bytes: int
    tried: dict[str, int] = field(default_factory=dict)  # candidate -> peak


def best_order(ctx: Context, *, rounds: int = 40) -> OrderResult:
    """The lowest-peak order found (see the module docstring), as ORT would run it."""
    g = ctx.root
    cands = {
        "DEFAULT": _active(ctx, g.execution_order("DEFAULT")),
        "PRIORITY_BASED": _active(ctx, g.execution_order("PRIORITY_BASED")),
        "greedy-footprint": greedy_order(ctx, "footprint"),
        "greedy-release": greedy_order(ctx, "release"),
    }
    beam = beam_order(ctx)
    if beam is not None:
        cands["beam"] = beam
    tried: dict[str, int] = {}
    best, best_peak = None, None
    for name, o in cands.items():
        o2 = improve_order(ctx, o, rounds=rounds)
        pk = evaluate_order(ctx, o2)
        tried[name] = evaluate_order(ctx, realized(ctx, o))
        tried[name + "+moves"] = pk
        if best_peak is None or pk < best_peak:
            best, best_peak = o2, pk
    assert best is not None and best_peak is not None
    return OrderResult(best, best_peak, evaluate_order(ctx, cands["DEFAULT"]),
                       evaluate_order(ctx, cands["PRIORITY_BASED"]), tried)


def topological_orders(g: og.OrtGraph, limit: int = 200_000) -> Iterable[list[int]]:
    """Every topological order of ``g``'s main graph (raises past ``limit``)."""
    n = len(g.nodes)
    preds = [g.input_nodes(i) for i in range(n)]
    succs = [g.output_nodes(i) for i in range(n)]
    indeg = [len(p) for p in preds]
    order: list[int] = []
    count = [0]

    def rec(ready: set[int]):
        if len(order) == n:
            count[0] += 1
            if count[0] > limit:
                raise ValueError(f"more than {limit} topological orders")
            yield list(order)
            return
        for i in sorted(ready):
            order.append(i)
            nxt = set(ready)
            nxt.discard(i)
            for j in succs[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    nxt.add(j)
            yield from rec(nxt)
            for j in succs[i]:
                indeg[j] += 1
            order.pop()

    yield from rec({i for i in range(n) if indeg[i] == 0})


def exhaustive_order(ctx: Context, limit: int = 200_000) -> tuple[list[int], int]:
    """The lowest-peak topological order by enumeration (small graphs: tests and comparisons)."""
    best, best_peak = None, None
    for o in topological_orders(ctx.root, limit):
        pk = evaluate_order(ctx, o)
        if best_peak is None or pk < best_peak:
            best, best_peak = o, pk
    assert best is not None and best_peak is not None
    return best, best_peak


