"""Heuristic 1: device by device, first-fit decreasing over the tree, then swaps and gap repair.

Part of the placement search behind :mod:`ortmem.plan.partition.device_map` (its docstring
describes the model and the method)."""
from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left, bisect_right, insort

from ortmem.plan.partition.placement.plans import Limits, Plan, better_plan, plan_from, plan_key
from ortmem.plan.partition.placement.tree import INF, Tree


def _fill_device(tree: Tree, pool: list[int], room: int, limit: float) -> tuple[list[int], list[int]]:
    """Take pieces for one device, largest first; open a piece only when it does not fit whole.

    Returns (taken, left); ``left`` is re-coarsened: a piece opened for nothing is closed again.
    """
    sizes, kids, first, min_atom = tree.sizes, tree.children, tree.first, tree.min_atom
    heap = [(-sizes[v], first[v], v) for v in pool]
    heapq.heapify(heap)
    taken: list[int] = []
    left: set[int] = set()
    opened: list[int] = []
    while heap:
        neg, _, v = heapq.heappop(heap)
        s = -neg
        if s <= room and s <= limit:
            taken.append(v)
            room -= s
        elif kids[v] and min_atom[v] <= min(room, limit):
            opened.append(v)
            for c in kids[v]:
                heapq.heappush(heap, (-sizes[c], first[c], c))
        else:
            left.add(v)
    for v in reversed(opened):  # children before parents
        if all(c in left for c in kids[v]):
            left.difference_update(kids[v])
            left.add(v)
    taken, left_list = _swap_fill(tree, taken, sorted(left, key=first.__getitem__), room, limit)
    return taken, left_list


def _swap_fill(tree: Tree, taken: list[int], left: list[int], room: int, limit: float
               ) -> tuple[list[int], list[int]]:
    """One-for-one swaps that fill the room first-fit left: replace a taken piece by a larger left one.

    First-fit decreasing leaves a gap smaller than every piece it skipped; a swap closes part of it
    whenever some skipped piece is at most ``room`` larger than a taken one.
    """
    if room <= 0 or not taken or not left:
        return taken, left
    sizes = tree.sizes
    cand = sorted((sizes[v], tree.first[v], v) for v in left if sizes[v] <= limit)
    cand_sizes = [c[0] for c in cand]
    taken_sorted = sorted(taken, key=lambda v: (sizes[v], tree.first[v]))
    improved = True
    taken_set = set(taken)
    left_set = set(left)
    while improved and room > 0:
        improved = False
        for t in list(taken_sorted):
            st = sizes[t]
            i = bisect_right(cand_sizes, st + room) - 1
            if i < 0 or cand_sizes[i] <= st:
                continue
            sq, fq, q = cand.pop(i)
            cand_sizes.pop(i)
            taken_sorted.remove(t)
            taken_set.discard(t)
            left_set.discard(q)
            taken_set.add(q)
            left_set.add(t)
            insort(taken_sorted, q, key=lambda v: (sizes[v], tree.first[v]))
            if st <= limit:
                j = bisect_left(cand_sizes, st)
                cand.insert(j, (st, tree.first[t], t))
                cand_sizes.insert(j, st)
            room -= sq - st
            improved = True
            if room <= 0:
                break
    key = tree.first.__getitem__
    return sorted(taken_set, key=key), sorted(left_set, key=key)


def _atoms(tree: Tree) -> list[int]:
    return [tree.starts[p][-1] for p in range(tree.n_positions)]


def refill_from(tree: Tree, lim: Limits, plan: Plan, j: int, fine: bool) -> Plan | None:
    """Keep ``plan`` on devices before ``j`` and fill devices ``j..`` again from what is left.

    The best plan for device 0 often comes from the sequence heuristic, whose later devices are
    filled myopically; re-filling them greedily keeps the first devices' bytes and fills the rest.
    """
    n = len(lim.caps)
    kept = [(v, d) for v, d in plan.entries if d < j]
    rest = [v for v, d in plan.entries if d >= j]
    if fine:
        rest = [a for v in rest for a in _atoms_under(tree, v)]
    pool = rest
    entries = list(kept)
    for d in range(j, n):
        if not pool:
            break
        taken, pool = _fill_device(tree, pool, lim.caps[d], lim.item[d])
        entries.extend((v, d) for v in taken)
    if pool:
        return None
    return plan_from(entries, tree, n)


def regap(tree: Tree, lim: Limits, plan: Plan) -> Plan | None:
    """With a switch bound: keep device 0's runs, give each gap between them one later device.

    The sequence heuristic fills device 0 well but picks the later devices myopically; one device
    per gap never adds a device change, and there are few gaps (at most ``max_switches / 2 + 1``),
    so every assignment is tried, each gap covered by its cheapest modules.
    """
    n = len(lim.caps)
    gaps: list[tuple[int, int]] = []
    kept: list[tuple[int, int]] = []
    start = None
    for v, d in plan.entries:
        if d == 0:
            if start is not None:
                gaps.append((start, tree.first[v]))
                start = None
            kept.append((v, d))
        elif start is None:
            start = tree.first[v]
    if start is not None:
        gaps.append((start, tree.n_positions))
    if not gaps or len(gaps) > 4:
        return None
    best = None
    covers: dict[tuple[int, int, float], list[int] | None] = {}
    for assign in itertools.product(range(1, n), repeat=len(gaps)):
        entries = list(kept)
        for (a, b), d in zip(gaps, assign):
            key = (a, b, lim.item[d])
            if key not in covers:
                covers[key] = _cheapest_cover(tree, a, b, lim.item[d])
            if covers[key] is None:
                break
            entries.extend((v, d) for v in covers[key])
        else:
            cand = plan_from(entries, tree, n)
            if all(x <= c for x, c in zip(cand.loads, lim.caps)):
                best = better_plan(best, cand)
    # a spare device change can split one gap between two later devices
    spare = lim.max_switches - (best.switches if best is not None else plan.switches)
    base = best if best is not None else plan
    while spare > 0:
        split = _split_a_gap(tree, lim, base)
        if split is None or split.switches > lim.max_switches or split.key >= base.key:
            break
        base = split
        spare = lim.max_switches - base.switches
    return better_plan(best, base if base is not plan else None)


def _split_a_gap(tree: Tree, lim: Limits, plan: Plan) -> Plan | None:
    """Best plan that re-covers one run of non-first-device entries as a prefix on one later device
    and a suffix on another (one more device change), all else kept."""
    n = len(lim.caps)
    runs: list[tuple[int, int, int, int]] = []  # (first entry index, last+1, position a, position b)
    i = 0
    entries = plan.entries
    while i < len(entries):
        if entries[i][1] == 0:
            i += 1
            continue
        j = i
        while j < len(entries) and entries[j][1] != 0:
            j += 1
        runs.append((i, j, tree.first[entries[i][0]], tree.end[entries[j - 1][0]]))
        i = j
    best = None
    for i, j, a, b in runs:
        outside = [e for k, e in enumerate(entries) if not i <= k < j]
        base_loads = [0] * n
        for v, d in outside:
            base_loads[d] += tree.sizes[v]
        for d1 in range(1, n):
            pre = _cover_costs(tree, a, b, lim.item[d1], forward=True)
            for d2 in range(1, n):
                if d2 == d1:
                    continue
                suf = _cover_costs(tree, a, b, lim.item[d2], forward=False)
                choice = None
                for c in range(a + 1, b):
                    x, y = pre[0][c - a], suf[0][c - a]
                    if base_loads[d1] + x > lim.caps[d1] or base_loads[d2] + y > lim.caps[d2]:
                        continue
                    loads = list(base_loads)
                    loads[d1] += x
                    loads[d2] += y
                    k = plan_key(loads, loads, 0, 0)
                    if choice is None or k < choice[0]:
                        choice = (k, c)
                if choice is None:
                    continue
                c = choice[1]
                new = outside + [(v, d1) for v in _walk_cover(tree, pre[1], a, a, c, True)]
                new += [(v, d2) for v in _walk_cover(tree, suf[1], a, c, b, False)]
                best = better_plan(best, plan_from(new, tree, n))
    return best


def _cover_costs(tree: Tree, a: int, b: int, limit: float, forward: bool):
    """Cheapest covers of ``a..c-1`` (forward) or ``c..b-1`` (backward) for every ``c``, with the
    module that ends (forward) or starts (backward) the cover at ``c``."""
    m = b - a
    cost = [INF] * (m + 1)
    via = [-1] * (m + 1)
    if forward:
        cost[0] = 0
        for p in range(a, b):
            if cost[p - a] == INF:
                continue
            for v in tree.starts[p]:
                q = tree.end[v]
                if q <= b and tree.sizes[v] <= limit and cost[p - a] + tree.sizes[v] < cost[q - a]:
                    cost[q - a] = cost[p - a] + tree.sizes[v]
                    via[q - a] = v
    else:
        cost[m] = 0
        for p in range(b - 1, a - 1, -1):
            for v in tree.starts[p]:
                q = tree.end[v]
                if q <= b and tree.sizes[v] <= limit and tree.sizes[v] + cost[q - a] < cost[p - a]:
                    cost[p - a] = tree.sizes[v] + cost[q - a]
                    via[p - a] = v
    return cost, via


def _walk_cover(tree: Tree, via: list[int], a: int, lo: int, hi: int, forward: bool) -> list[int]:
    """The modules of a cover found by :func:`_cover_costs` (positions relative to ``a``)."""
    out = []
    if forward:
        p = hi
        while p > lo:
            v = via[p - a]
            out.append(v)
            p = tree.first[v]
        return out[::-1]
    p = lo
    while p < hi:
        v = via[p - a]
        out.append(v)
        p = tree.end[v]
    return out


def _cheapest_cover(tree: Tree, a: int, b: int, limit: float) -> list[int] | None:
    """Modules of at most ``limit`` bytes covering positions ``a..b-1`` with the fewest bytes."""
    cost, via = _cover_costs(tree, a, b, limit, forward=False)
    return None if cost[0] == INF else _walk_cover(tree, via, a, a, b, forward=False)


def _atoms_under(tree: Tree, v: int) -> list[int]:
    return [tree.starts[p][-1] for p in range(tree.first[v], tree.end[v])]


def greedy_by_device(tree: Tree, lim: Limits, fine: bool) -> Plan | None:
    """Heuristic 1 (order-free): fill device 0, then device 1 with what is left, and so on.

    ``fine`` starts from the atomic modules (best fill when sizes add up: the gap left is smaller
    than every module skipped); otherwise from the root, opening modules only when they do not fit
    (best when children over-count shared bytes). Cleaning merges the fine pieces back anyway.
    """
    n = len(lim.caps)
    pool = _atoms(tree) if fine else [0]
    entries: list[tuple[int, int]] = []
    for d in range(n):
        if not pool:
            break
        taken, pool = _fill_device(tree, pool, lim.caps[d], lim.item[d])
        entries.extend((v, d) for v in taken)
    if pool:
        return _first_fit_across(tree, lim)
    return plan_from(entries, tree, n)


def _first_fit_across(tree: Tree, lim: Limits) -> Plan | None:
    """Fallback when filling device by device strands pieces: each piece, largest first, goes to
    the first device with room (classic first-fit decreasing bin packing); open it if none has."""
    n = len(lim.caps)
    room = list(lim.caps)
    heap = [(-tree.sizes[0], 0, 0)]
    entries: list[tuple[int, int]] = []
    while heap:
        neg, _, v = heapq.heappop(heap)
        s = -neg
        for d in range(n):
            if s <= room[d] and s <= lim.item[d]:
                room[d] -= s
                entries.append((v, d))
                break
        else:
            if not tree.children[v]:
                return None
            for c in tree.children[v]:
                heapq.heappush(heap, (-tree.sizes[c], tree.first[c], c))
    return plan_from(entries, tree, n)


