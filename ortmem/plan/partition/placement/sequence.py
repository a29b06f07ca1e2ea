"""Heuristic 2: one representative per (position, device, switches) along execution order, a beam of them, forwards and backwards; the heuristic driver.

Part of the placement search behind :mod:`ortmem.plan.partition.device_map` (its docstring
describes the model and the method)."""
from __future__ import annotations

from ortmem.plan.partition.placement.greedy import greedy_by_device, refill_from, regap
from ortmem.plan.partition.placement.plans import Limits, Plan, better_plan, plan_from, plan_key_function
from ortmem.plan.partition.placement.tree import Tree


#: Beam of the sequence heuristic: up to _BEAM plans per state, fewer on large models.
_BEAM = 16
_BEAM_WORK = 20_000
#: Up to this many positions the sequence heuristic also runs backwards.
_MIRROR_MAX_POSITIONS = 2_000


def _sequence_dp(tree: Tree, lim: Limits, beam: int = 1) -> list[tuple[int, int]] | None:
    """Dynamic programme over execution order keeping the ``beam`` best partial plans per state.

    A state is (position, current device, switches used) under a switch bound, and just the
    position without one (the device then only matters for the tie-break on switches, which the
    rank carries). Partial plans reaching a state are ranked by :func:`plan_key_function`; distinct
    load vectors only. With one switch on two devices the best one is optimal; otherwise a wider
    beam keeps alternatives that leave room for later modules. Ranking by bytes so far is myopic
    (it fills device 0 early and may find no room for a big module at the end), so
    :func:`heuristic_plan` also runs it on the mirrored order.
    """
    n = len(lim.caps)
    npos = tree.n_positions
    caps, item, max_sw = lim.caps, lim.item, lim.max_switches
    total_cap = sum(caps)
    mincost = tree.mincost()
    per_dev = per_device_mincost(tree, lim)
    # per position: state key -> list of (rank, loads, switches, items, back, device), best first;
    # back = (position, state key, index in that list, node, device)
    states: list[dict] = [dict() for _ in range(npos + 1)]
    bounded = max_sw is not None
    states[0][(-1, 0) if bounded else 0] = [((), (0,) * n, 0, 0, None, -1)]
    rank_of = plan_key_function(n)
    sizes, end = tree.sizes, tree.end
    band = max(1, caps[0] // (4 * beam))
    for p in range(npos):
        live = _undominated(states[p]) if bounded and beam == 1 else states[p]
        for skey, plans in live.items():
            for idx, (_, loads, sw, items, _, cur) in enumerate(plans):
                used = sum(loads)
                for v in tree.starts[p]:
                    s = sizes[v]
                    q = end[v]
                    if mincost[q] > total_cap - used - s:
                        continue
                    table = states[q]
                    for d in range(n):
                        if s > item[d] or loads[d] + s > caps[d]:
                            continue
                        nsw = sw + 1 if cur >= 0 and d != cur else sw
                        if bounded:
                            if nsw > max_sw:
                                continue
                            if nsw == max_sw and per_dev[d][q] > caps[d] - loads[d] - s:
                                continue
                        nkey = (d, nsw) if bounded else 0
                        if beam == 1:
                            old = table.get(nkey)
                            # cheap first test on the leading rank term (bytes past device 0)
                            if old is not None and used + s - loads[0] - (s if d == 0 else 0) > old[0][0][0]:
                                continue
                        nl = loads[:d] + (loads[d] + s,) + loads[d + 1:]
                        entry = (rank_of(nl, nsw, items + 1), nl, nsw, items + 1, (p, skey, idx, v, d), d)
                        if beam == 1:
                            if old is None or entry[0] < old[0][0]:
                                table[nkey] = [entry]
                        else:
                            _beam_insert(table, nkey, entry, beam, band)
    if not states[npos]:
        return None
    skey = min(states[npos], key=lambda k: states[npos][k][0][0])
    idx = 0
    entries = []
    p = npos
    while True:
        back = states[p][skey][idx][4]
        if back is None:
            break
        p, skey, idx, v, d = back
        entries.append((v, d))
    return entries


def _undominated(table: dict) -> dict:
    """States worth extending: (device, switches) is dominated by a state of the same device with
    fewer switches, or of any device with at least one switch fewer, whose plan ranks no worse
    (whatever follows the dominated one, the other can follow at no more switches)."""
    out = {}
    best_below = None  # best rank over all devices with fewer switches than the current level
    level_best = None
    level = None
    best_dev: dict[int, tuple] = {}  # device -> best rank with fewer switches
    for d, sw in sorted(table, key=lambda k: (k[1], k[0])):
        if sw != level:
            if level_best is not None and (best_below is None or level_best < best_below):
                best_below = level_best
            level, level_best = sw, None
        rank = table[(d, sw)][0][0]
        mine = best_dev.get(d)
        if level_best is None or rank < level_best:
            level_best = rank
        if mine is None or rank < mine:
            best_dev[d] = rank
        if (best_below is not None and best_below <= rank) or (mine is not None and mine <= rank):
            continue
        out[(d, sw)] = table[(d, sw)]
    return out


def _mirror(tree: Tree) -> Tree:
    """The same modules with execution order reversed (for the backward sequence pass)."""
    npos = tree.n_positions
    first = tuple(npos - e for e in tree.end)
    end = tuple(npos - f for f in tree.first)
    starts: list[list[int]] = [[] for _ in range(npos)]
    for v in range(len(tree.names)):  # preorder: ancestors before descendants
        starts[first[v]].append(v)
    return Tree(tree.names, tree.sizes, tree.children, tree.parent, first, end,
                 tuple(tuple(x) for x in starts), tree.min_atom, tree.atom_bytes, tree.additive)


def _beam_insert(table: dict, key, entry: tuple, beam: int, width: int) -> None:
    """Keep up to ``beam`` entries of ``table[key]``, best rank first, at most one per band of
    ``width`` bytes on the first device: the best-ranked plans all spent the first device alike,
    and a plan that kept room there is what a later module may need (trimming, as in the subset-sum
    approximation schemes)."""
    plans = table.get(key)
    if plans is None:
        table[key] = [entry]
        return
    rank = entry[0]
    if len(plans) >= beam and rank >= plans[-1][0]:
        return
    band = entry[1][0] // width
    for i, other in enumerate(plans):
        if other[1][0] // width == band:
            if rank >= other[0]:
                return
            plans.pop(i)
            break
    i = len(plans)
    while i > 0 and rank < plans[i - 1][0]:
        i -= 1
    plans.insert(i, entry)
    if len(plans) > beam:
        plans.pop()


def per_device_mincost(tree: Tree, lim: Limits) -> list[list[float]]:
    cache: dict[float, list[float]] = {}
    return [cache.setdefault(lim.item[d], tree.mincost(lim.item[d])) for d in range(len(lim.caps))]


def heuristic_plan(tree: Tree, lim: Limits, quick: bool = False) -> Plan | None:
    """Heuristic 2, and heuristic 1 where its plan respects the switch bound; the better one,
    then later devices re-filled. ``quick`` (to compare reservations on large models): heuristic 1
    alone where no switch bound needs heuristic 2, and no re-fill."""
    best = None
    if not quick or lim.max_switches is not None:
        states = tree.n_positions * (1 if lim.max_switches is None else len(lim.caps) * (lim.max_switches + 1))
        beam = 1 if quick else max(1, min(_BEAM, _BEAM_WORK // max(1, states)))
        for t in (tree, _mirror(tree)):
            entries = _sequence_dp(t, lim, beam)
            if entries is not None:
                best = better_plan(best, plan_from(entries, tree, len(lim.caps)))
            if best is not None and tree.n_positions > _MIRROR_MAX_POSITIONS:
                break  # large models: the forward pass only (the backward one doubles the time)
    for fine in (True, False):
        greedy = greedy_by_device(tree, lim, fine)
        if greedy is not None and (lim.max_switches is None or greedy.switches <= lim.max_switches):
            best = better_plan(best, greedy)
    if best is not None and not quick and len(lim.caps) > 2:
        if lim.max_switches is None:
            for j in range(1, len(lim.caps) - 1):
                for fine in (True, False):
                    best = better_plan(best, refill_from(tree, lim, best, j, fine))
        else:
            best = better_plan(best, regap(tree, lim, best))
    return best


