"""Clones written into the node list (placed for ``DEFAULT`` or ``PRIORITY_BASED``) and reorders of a state.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

from typing import Sequence

from onnx import NodeProto

from ortmem.plan.estimate import activations as act
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og
from ortmem.plan.estimate.liveness import Context
from ortmem.plan.recompute.discovery import Occurrence
from ortmem.plan.recompute.orders import with_removed
from ortmem.plan.recompute.state import Entry, State, graph_with


def _fresh(base: str, taken: set[str], tag: str) -> str:
    name = f"{base}__{tag}"
    k = 1
    while name in taken:
        k += 1
        name = f"{base}__{tag}{k}"
    taken.add(name)
    return name


def apply(state: State, occurrences: Sequence[Occurrence]) -> tuple[State, list[Occurrence]]:
    """``state`` with ``occurrences`` cloned and their readers rewired (see the module docstring for
    where clones go in the file). Occurrences that touch nodes an earlier one rewired are skipped
    (they reappear, re-derived, in the next round). Returns the new state and what was applied."""
    ctx = state.ctx
    g = ctx.root
    lv = state.liveness
    pos = {i: p for p, i in enumerate(lv.order)}
    protos = list(ctx.model.graph.node)
    ort_to_file = {node.index: node.file_index for node in g.nodes}  # and the reverse, file_to_ort, below
    taken = {o for n in protos for o in n.output} | {n.name for n in protos} | set(g.inputs) | \
        {t.name for t in ctx.model.graph.initializer}
    entries = list(state.entries)
    new_protos: dict[int, NodeProto] = {}  # file position -> rewired copy
    touched_sub: set[int] = set()
    touched_cons: set[int] = set()
    applied: list[Occurrence] = []
    clones: list[tuple[Occurrence, list[NodeProto], list[og.OrtNode]]] = []
    renamed: dict[str, str] = {}
    for occ in occurrences:
        if set(occ.subgraph) & touched_cons or set(occ.consumers) & touched_sub:
            continue
        mapping: dict[str, str] = {}
        made: list[NodeProto] = []
        for i in occ.subgraph:
            src = g.nodes[i].proto
            c = NodeProto()
            c.CopyFrom(new_protos.get(ort_to_file[i], src))
            c.name = _fresh(src.name or src.op_type, taken, "rc")
            for s, v in enumerate(c.input):
                if v in mapping:
                    c.input[s] = mapping[v]
            for s, v in enumerate(c.output):
                if v:
                    nv = _fresh(v, taken, "rc")
                    mapping[v] = nv
                    renamed[nv] = v
                    c.output[s] = nv
            made.append(c)
        for ci in occ.consumers:
            k = ort_to_file[ci]
            p = new_protos.get(k)
            if p is None:
                p = NodeProto()
                p.CopyFrom(protos[k])
                new_protos[k] = p
            for s, v in enumerate(p.input):
                if v in occ.values:
                    p.input[s] = mapping[v]
        touched_sub.update(occ.subgraph)
        touched_cons.update(occ.consumers)
        clones.append((occ, made, [g.nodes[i] for i in occ.subgraph]))
        applied.append(occ)
    if not applied:
        return state, []
    for k, p in new_protos.items():
        entries[k] = ("new", p)

    # file layout
    const_pos = [k for k in range(len(protos)) if k not in ort_to_file.values()]
    if state.kind == "PRIORITY_BASED":
        # the file in the order ORT runs now, each clone at the cheapest step before its group's reader
        before: dict[int, list[int]] = {}
        live = [st.live_bytes for st in lv.steps]
        for n, (occ, _, _) in enumerate(clones):
            before.setdefault(lv.order[_clone_step(ctx, occ, pos, live)], []).append(n)
        layout: list[tuple[str, int, int]] = [("file", k, -1) for k in const_pos]
        # nodes ORT folds into constants never run (the order leaves them out): first, in file order
        layout += [("file", ort_to_file[i], -1) for i in range(len(g.nodes)) if id(g.nodes[i]) in ctx.removed]
        for i in lv.order:
            for n in before.get(i, []):
                layout += [("clone", n, j) for j in range(len(clones[n][1]))]
            layout.append(("file", ort_to_file[i], -1))
    else:
        # the original file order, each clone right after the last producer of what it reads
        after: dict[int, list[int]] = {}
        for n, (occ, _, _) in enumerate(clones):
            prods = [g.producer[s] for s in occ.sources if s in g.producer and id(g.nodes[g.producer[s]]) not in ctx.removed]
            anchor = max((ort_to_file[p] for p in prods), default=-1)
            after.setdefault(anchor, []).append(n)
        layout = [("file", k, -1) for k in const_pos]
        for n in after.get(-1, []):
            layout += [("clone", n, j) for j in range(len(clones[n][1]))]
        for i in range(len(g.nodes)):
            k = ort_to_file[i]
            layout.append(("file", k, -1))
            for n in after.get(k, []):
                layout += [("clone", n, j) for j in range(len(clones[n][1]))]
    nodes: list[NodeProto] = []
    new_entries: list[Entry] = []
    origins: list[og.OrtNode] = []
    file_to_ort = {k: i for i, k in ort_to_file.items()}
    for kind, a, j in layout:
        if kind == "file":
            e = entries[a]
            nodes.append(e[1] if e[0] == "new" else protos[a])
            new_entries.append(e)
            if a in file_to_ort:
                origins.append(g.nodes[file_to_ort[a]])
        else:
            occ, made, orig = clones[a]
            nodes.append(made[j])
            new_entries.append(("new", made[j]))
            origins.append(orig[j])
    model = graph_with(ctx, nodes)
    new_ctx = ctx.derive(model, origins, renamed)
    return State(new_ctx, new_entries, state.kind, base=state), applied


def _clone_transient(ctx: Context, occ: Occurrence) -> int:
    """Peak of the clone's own tensors while it runs (its nodes in order; aliases free; a tensor freed
    after its last reader inside the clone; the recomputed values kept)."""
    g = ctx.root
    sub = occ.subgraph
    last: dict[str, int] = {}
    for k, i in enumerate(sub):
        for v in g.nodes[i].inputs:
            last[v] = k
    live = peak = 0
    held: dict[str, int] = {}
    for k, i in enumerate(sub):
        node = g.nodes[i]
        alias = node.op_type in act.ALIAS_OPS and node.domain in ("", "ai.onnx")
        new = 0 if alias else sum(shp.granule(ctx.nbytes(o)) for o in node.outputs if o)
        peak = max(peak, live + new + ctx.workspace(node, ctx.shapes))
        live += new
        for o in node.outputs:
            if o and not alias:
                held[o] = shp.granule(ctx.nbytes(o))
        for v in list(held):
            if v not in occ.values and last.get(v, -1) <= k:
                live -= held.pop(v)
    return peak


def _clone_step(ctx: Context, occ: Occurrence, pos: dict[int, int], live: list[int]) -> int:
    """Where to run a clone under ``PRIORITY_BASED``: the step ``p`` between its sources and its group's
    first reader ``q`` minimising ``max(live[p] + transient, max(live[p:q]) + bytes)`` (the clone's own
    peak at ``p``, then its result held until ``q``), the latest such step on ties."""
    g = ctx.root
    q = occ.first_reader
    lo = 0
    for v in occ.sources:
        p = g.producer.get(v)
        if p is not None and p in pos:
            lo = max(lo, pos[p] + 1)
    lo = min(lo, q)
    transient = _clone_transient(ctx, occ)
    best, best_cost = q, None
    run_max = 0
    for p in range(q, lo - 1, -1):  # walking back: max(live[p:q]) grows
        if p < q:
            run_max = max(run_max, live[p])
        cost = max(live[p] + transient, run_max + occ.nbytes)
        if best_cost is None or cost < best_cost:
            best, best_cost = p, cost
    return best


def reorder(state: State, order: Sequence[int]) -> State:
    """``state`` with its file written in ``order`` (node indices of ``state``'s graph), to be run with
    ``PRIORITY_BASED`` (which then follows the file, Shape/Size nodes excepted)."""
    ctx = state.ctx
    g = ctx.root
    protos = list(ctx.model.graph.node)
    ort_to_file = {node.index: node.file_index for node in g.nodes}
    const_pos = [k for k in range(len(protos)) if k not in ort_to_file.values()]
    order = with_removed(ctx, order)
    layout = const_pos + [ort_to_file[i] for i in order]
    nodes = [protos[k] for k in layout]
    entries = [state.entries[k] for k in layout]
    origins = [g.nodes[i] for i in order]
    new_ctx = ctx.derive(graph_with(ctx, nodes), origins, {})
    return State(new_ctx, entries, "PRIORITY_BASED", base=state)


