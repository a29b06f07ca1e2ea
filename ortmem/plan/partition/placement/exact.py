"""Exact: depth-first branch and bound with memoised states, seeded by the heuristic.

Part of the placement search behind :mod:`ortmem.plan.partition.device_map` (its docstring
describes the model and the method)."""
from __future__ import annotations

import math
import sys
from typing import Sequence

from ortmem.plan.partition.placement.plans import Limits, Plan, objective_len, plan_key
from ortmem.plan.partition.placement.sequence import per_device_mincost
from ortmem.plan.partition.placement.tree import Tree


#: Expansion budget of the exact search (about 1-2 s of CPU on one core).
EXACT_BUDGET = 50_000


class _Stop(Exception):
    pass


class SearchBudget:
    """Expansions the exact search may still spend, shared by every reservation candidate."""

    def __init__(self, left: int = EXACT_BUDGET):
        self.left = left


class _FillBound:
    """For each position ``p``: which byte counts the modules from ``p`` on could put on a set of
    devices, as a union of intervals, one per bucket of ``width`` bytes (an over-approximation).

    ``max_fill(p, room)`` is then an upper bound on the bytes of the rest that fit in ``room``, which
    makes the branch-and-bound bound see that a device cannot be filled to the byte (the weak bound
    assumes any room can be filled exactly, and proves nothing when the optimum leaves a gap).
    Built backwards over positions with numpy, ``O(modules * buckets)``.
    """

    BUCKETS = 2048

    def __init__(self, tree: Tree, limit: int):
        import numpy as np

        self._np = np
        nb = self.BUCKETS
        width = max(1, -(-(limit + 1) // nb))
        self.width = width
        self.limit = limit
        empty_lo = np.full(nb, np.iinfo(np.int64).max, dtype=np.int64)
        empty_hi = np.full(nb, -1, dtype=np.int64)
        npos = tree.n_positions
        lo: list = [None] * (npos + 1)
        hi: list = [None] * (npos + 1)
        lo[npos], hi[npos] = empty_lo.copy(), empty_hi.copy()
        lo[npos][0] = hi[npos][0] = 0
        for p in range(npos - 1, -1, -1):
            acc_lo, acc_hi = empty_lo.copy(), empty_hi.copy()
            for v in tree.starts[p]:
                q = tree.end[v]
                np.minimum(acc_lo, lo[q], out=acc_lo)
                np.maximum(acc_hi, hi[q], out=acc_hi)
                self._shift_into(acc_lo, acc_hi, lo[q], hi[q], tree.sizes[v])
            lo[p], hi[p] = acc_lo, acc_hi
        # prefix maxima of hi: the largest reachable value in buckets < b
        self.lo = lo
        self.hi = hi
        self.prefmax = [np.maximum.accumulate(h).tolist() for h in hi]
        self.lo_list = [x.tolist() for x in lo]
        self.hi_list = [x.tolist() for x in hi]

    def _shift_into(self, acc_lo, acc_hi, lo, hi, s: int) -> None:
        np = self._np
        if s > self.limit:
            return
        mask = hi >= 0
        a = lo[mask] + s
        b = hi[mask] + s
        keep = a <= self.limit
        a, b = a[keep], np.minimum(b[keep], self.limit)
        w = self.width
        ba, bb = a // w, b // w
        same = ba == bb
        np.minimum.at(acc_lo, ba, a)
        np.maximum.at(acc_hi, ba, np.where(same, b, (ba + 1) * w - 1))
        split = ~same
        if split.any():
            np.minimum.at(acc_lo, bb[split], bb[split] * w)
            np.maximum.at(acc_hi, bb[split], b[split])

    def max_fill(self, p: int, room: int) -> int:
        """Upper bound on the largest byte count <= room the modules from position ``p`` can reach."""
        if room >= self.limit:
            room = self.limit
        if room < 0:
            return -1
        b = room // self.width
        if self.lo_list[p][b] <= room:
            h = self.hi_list[p][b]
            return room if h > room else h
        return self.prefmax[p][b - 1] if b > 0 else -1


def _gcd_caps(tree: Tree, caps: Sequence[int]) -> tuple[int, ...]:
    """Budgets rounded down to a multiple of the sizes' gcd: no load can use the remainder."""
    g = 0
    for s in tree.sizes:
        g = math.gcd(g, s)
    if g <= 1:
        return tuple(caps)
    return tuple(c // g * g for c in caps)


def exact_plan(tree: Tree, lim: Limits, incumbent: Plan | None, budget: SearchBudget,
           first_only: bool = False) -> tuple[Plan | None, bool]:
    """Best plan and whether its bytes are proved optimal (False only if the budget ran out).

    A state is (position, charged bytes per device, current device when switches are bounded);
    its memo value is what else the key compares for equal charged bytes: minus the atomic bytes
    per device, switches, entries. A state is dominated by an earlier visit whose value is no worse,
    because any completion adds the same to both.
    """
    n = len(lim.caps)
    npos = tree.n_positions
    caps = _gcd_caps(tree, lim.caps)
    item, max_sw = lim.item, lim.max_switches
    sizes, end, starts, atom_bytes = tree.sizes, tree.end, tree.starts, tree.atom_bytes
    mincost = tree.mincost()
    per_dev = per_device_mincost(tree, lim)
    total_cap = sum(caps)
    fill = None if first_only or n == 1 else _FillBound(tree, sum(caps[:-1]))
    atoms_after = [0] * (npos + 1)  # atomic bytes from each position on
    for p in range(npos - 1, -1, -1):
        atoms_after[p] = atoms_after[p + 1] + atom_bytes[starts[p][-1]]
    additive = tree.additive

    def bound(p: int, loads: Sequence[int], atoms: Sequence[int], sw: int, items: int) -> tuple:
        """T_j: bytes past j plus what the cheapest cover of the rest cannot fit on 0..j (each device
        filled separately, to the bytes the rest can actually sum to); atoms: all that could come."""
        rest = mincost[p]
        out = []
        room = 0
        each = 0
        past = sum(loads[1:])
        for j in range(n - 1):
            r = caps[j] - loads[j]
            room += r
            if fill is not None:
                own = fill.max_fill(p, r)
                each += own
                got = min(fill.max_fill(p, room), each)
            else:
                own = got = room
            over = rest - got
            out.append(past + (over if over > 0 else 0))
            out.append(-(atoms[j] + (own if additive and own < atoms_after[p] else atoms_after[p])))
            past -= loads[j + 1]
        return (*out, sw, items + (1 if p < npos else 0))

    # Exactness is claimed for the bytes (the first 2(n-1) entries of the key); the tie-breaks
    # (switches, entries) are best effort: once a plan meets the bound on those the search stops.
    m = objective_len(n)
    zeros = (0,) * n
    root = bound(0, zeros, zeros, 0, 0)[:m]
    best: list = [incumbent, incumbent.key if incumbent is not None else None]
    if incumbent is not None and (first_only or best[1][:m] <= root):
        return incumbent, True
    if budget.left <= 0:
        return incumbent, False
    # Without a switch bound the current device only matters for the tie-breaks: leave it out of
    # the memo key, which makes all orders of equal loads one state.
    track_cur = max_sw is not None
    memo: dict[tuple, tuple] = {}
    path: list[tuple[int, int]] = []

    def visit(p: int, loads: tuple[int, ...], atoms: tuple[int, ...], cur: int, sw: int, items: int) -> None:
        if p == npos:
            k = plan_key(loads, atoms, sw, items)
            if best[1] is None or k < best[1]:
                best[0] = Plan(tuple(path), loads, sw, atoms)
                best[1] = k
                if first_only or k[:m] <= root:
                    raise _Stop
            return
        mk = (p, loads, cur) if track_cur else (p, loads)
        value = (*(-a for a in atoms[:-1]), sw, items)
        seen = memo.get(mk)
        if seen is not None and seen <= value:
            return
        memo[mk] = value
        if mincost[p] > total_cap - sum(loads):
            return
        if max_sw is not None and sw == max_sw and cur >= 0 and per_dev[cur][p] > caps[cur] - loads[cur]:
            return
        if best[1] is not None and bound(p, loads, atoms, sw, items) >= best[1]:
            return
        budget.left -= 1
        if budget.left < 0:
            raise _Stop
        for v in starts[p]:
            s = sizes[v]
            q = end[v]
            for d in range(n):
                if s > item[d] or loads[d] + s > caps[d]:
                    continue
                nsw = sw + (1 if cur >= 0 and d != cur else 0)
                if max_sw is not None and nsw > max_sw:
                    continue
                nl = loads[:d] + (loads[d] + s,) + loads[d + 1:]
                na = atoms[:d] + (atoms[d] + atom_bytes[v],) + atoms[d + 1:]
                path.append((v, d))
                visit(q, nl, na, d, nsw, items + 1)
                path.pop()

    proved = True
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, npos + 1000))
    try:
        visit(0, zeros, zeros, -1, 0, 0)
    except _Stop:
        proved = budget.left >= 0
    finally:
        sys.setrecursionlimit(old_limit)
    return best[0], proved


