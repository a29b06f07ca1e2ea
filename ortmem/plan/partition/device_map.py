"""Device maps: which device holds (and by default runs) each module of a model.

:func:`infer_device_map` takes accelerate-shaped inputs (``module_sizes`` from
``compute_module_sizes``: dotted names, every prefix, ``""`` the total, in execution order;
``max_memory``: budgets in preference order, fastest device first) and returns a cleaned map
``{module: device}``. Unlike accelerate's greedy walk it

- splits a module into its children only when that lets more bytes sit on earlier devices,
- may come back to an earlier device when a later module still fits there (accelerate issue 3041),
- bounds the number of device changes along execution order when ``max_switches`` is given,
- reserves room on the first device for offloaded modules only with ``reserve="offload"``, only when
  something is offloaded, and only as much as the largest offloaded entry needs.

The model
---------
A *placement* is a set of modules whose leaf spans partition the model (no module together with an
ancestor) and a device for each; read in execution order they form a sequence, and a *device change*
is two neighbours on different devices. A module may be split into its children unless it is in
``no_split``, is a leaf, or its children do not account for all its bytes (the remainder has no
name a map could carry, so such a module is placed whole). Children may account for *more* than
the parent (a weight shared by two children is charged to each: see
:mod:`ortmem.plan.partition.graph_modules`); splitting then costs bytes, and the planner sees that cost.

Objective, lexicographic, smaller is better: for each device ``j`` but the last, ``T_j`` = the bytes
charged to devices after ``j``, then minus the bytes of the *atomic* modules (those never split)
that ``j`` runs; then device changes, then entries. With sizes that add up (accelerate's) this is
exactly "as many bytes as possible on device 0, then on device 1, ...". It is stated as bytes *not*
on the early devices so that opening a module whose children over-count a shared weight is never
rewarded for the over-count; the atomic term settles ties such as a tied lm_head (the CPU holds the
whole model either way, so the lm_head may as well run on the GPU). Cleaning (merging siblings on
one device into their parent) changes neither term.

Exact (up to :data:`EXACT_MAX_MODULES` modules)
-------------------------------------------------
A depth-first branch and bound over execution order. A state is (position in the leaf order, bytes
charged per device, current device when switches are bounded); a move is "place module ``v``
starting here on device ``d``", so the cut into modules and the devices are chosen together, and
``max_switches`` is a counter on the path. States are memoised with the best value seen, which makes
this a dynamic programme over the *set of reachable load vectors* (pseudo-polynomial, no capacity
grid: bytes stay exact), visited depth first from the heuristic's plan so that its lower bound prunes
hard. The bound on ``T_j``: bytes already past ``j`` plus what the cheapest cover of the remaining
leaves cannot fit on devices ``0..j``, where "fit" uses :class:`_FillBound`, the byte counts the
remaining modules can actually sum to (so a device that cannot be filled to the byte is seen as
such), and budgets rounded down to the sizes' gcd. Exactness is claimed for the bytes (the ``T`` and
atomic terms); the search stops as soon as a plan meets the bound there, so the tie-breaks (changes,
entries) are best effort.

Cost: worst case exponential (subset sum is the one-device special case, so nothing exact is
polynomial in the bytes' bits); repeated layers keep the distinct load vectors few. Measured on 192
decoder-shaped trees (46 to 246 modules, budgets 0.2-0.9 of the model): proved optimal in 32/32 cases
with one device change allowed (two or three devices), 28/32 for two devices without a bound,
10-17/32 with three changes or three devices; each search stops after :data:`EXACT_BUDGET`
expansions (about 1 s) and then returns the best plan found (never worse than the heuristic's) with
``Placement.exact`` false.

We chose this over an integer program (``scipy.optimize.milp``): HiGHS's feasibility and integrality
tolerances are relative, so with byte-sized coefficients (1e9 and more) a "feasible" solution can be kilobytes over budget,
the lexicographic objective needs one solve per term, and ``max_switches`` needs an auxiliary
variable per adjacent leaf pair; the hand-written search is exact in integers, needs no new
dependency, and its heuristic start already meets the bound in most cases.

Heuristic (beyond that, and the exact search's start)
-----------------------------------------------------
The best of: (1) device by device, first-fit decreasing over the tree (from the atomic modules, and
from the root opening a module only when it does not fit), then one-for-one swaps that fill the gap
left, with a first-fit-across-devices fallback when pieces get stranded: ``O(N log N)`` per device;
(2) a dynamic programme over execution order keeping the best partial plans (a beam of up to
``_BEAM``, one on large models) per (position, device, switches used), dominated states dropped,
run forwards and (up to ``_MIRROR_MAX_POSITIONS`` positions) backwards: ``O(N D^2 (S+1) beam)``.
The winner's later devices are then re-filled (no switch bound: greedily from what the first devices
left; with one: one device per gap between the first device's runs, and a spare change spent on
splitting a gap). The beam keeps at most one plan per band of first-device bytes, so a plan that
kept room for a later module survives. On the 10,118-module bench graph this plans in about 0.2-0.7 s;
on the 192 trees above the first device's bytes are within 0.25% of the exact search's (the second
device's, with three devices, within 16%: the lexicographic order lets the first device's last
kilobytes decide what is left for the second).

``reserve="offload"``
---------------------
The reservation depends on the placement, so the optimisation enumerates it: for each candidate ``R``
(0, then each distinct module size, ascending, from the first for which the modules too large to
offload could fit at all) modules on cpu/disk must be at most ``R`` bytes and the first device's
budget shrinks by ``R``; the best plan over all ``R`` is the optimum (a plan whose largest offloaded
entry is below ``R`` is also found at that smaller ``R``). Candidates stop when the bound for ``R``
cannot beat the best plan (the bound only grows with ``R``); the heuristic tries a few only. The
cleaned map never merges offloaded siblings into a parent larger than the reservation.
"""
from __future__ import annotations

import fnmatch
import heapq
import itertools
import math
import sys
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

from ...errors import PlanError

__all__ = [
    "EXACT_MAX_MODULES",
    "OFFLOAD_DEVICES",
    "Placement",
    "infer_device_map",
    "plan_placement",
]

#: Device names whose modules are executed on the first device when ``reserve="offload"``.
OFFLOAD_DEVICES = frozenset({"cpu", "disk"})
#: Up to this many placeable modules the exact search runs (seeded by the heuristic).
EXACT_MAX_MODULES = 400
#: Expansion budget of the exact search (about 1-2 s of CPU on one core).
EXACT_BUDGET = 50_000
#: Budget of each feasibility search behind PlanError's per-device minimum.
_FEASIBILITY_BUDGET = 20_000
#: In heuristic mode, how many reservation candidates are solved after the first feasible one.
_HEURISTIC_RESERVE_TRIES = 4
#: Beam of the sequence heuristic: up to _BEAM plans per state, fewer on large models.
_BEAM = 16
_BEAM_WORK = 20_000
#: Up to this many positions the sequence heuristic also runs backwards.
_MIRROR_MAX_POSITIONS = 2_000

_INF = float("inf")


# --------------------------------------------------------------------------------------------------
# The module tree


@dataclass(frozen=True)
class _Tree:
    """The placeable part of the module tree, in execution (pre)order.

    Only modules that may appear in a map are kept: the children of an atomic module (leaf,
    no_split, or children not covering its bytes) are dropped. ``first``/``end`` are each module's
    span of *positions* (atomic modules in execution order); ``starts[p]`` lists the modules whose
    span starts at ``p``, ancestors first, so the search tries coarse placements before fine ones.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    parent: tuple[int, ...]
    first: tuple[int, ...]
    end: tuple[int, ...]
    starts: tuple[tuple[int, ...], ...]
    min_atom: tuple[int, ...]  # smallest atomic module in each subtree (cheap "nothing fits" test)
    atom_bytes: tuple[int, ...]  # bytes of the atomic modules in each subtree (what runs where)
    additive: bool  # every splittable module's size is the sum of its children's

    @property
    def n_positions(self) -> int:
        return len(self.starts)

    def mincost(self, limit: float = _INF) -> list[float]:
        """Cheapest cover of positions ``p..`` using modules of at most ``limit`` bytes (inf: none)."""
        n = self.n_positions
        best = [_INF] * (n + 1)
        best[n] = 0
        for p in range(n - 1, -1, -1):
            b = _INF
            for v in self.starts[p]:
                s = self.sizes[v]
                if s <= limit:
                    c = s + best[self.end[v]]
                    if c < b:
                        b = c
            best[p] = b
        return best

    def forced(self, limit: float) -> float:
        """Fewest bytes of modules over ``limit`` that any cover must contain (they cannot be offloaded)."""
        n = self.n_positions
        best = [0.0] * (n + 1)
        for p in range(n - 1, -1, -1):
            b = _INF
            for v in self.starts[p]:
                s = self.sizes[v]
                c = (s if s > limit else 0) + best[self.end[v]]
                if c < b:
                    b = c
            best[p] = b
        return best[0]


def _normalise_sizes(module_sizes: Mapping[str, int]) -> tuple[dict[str, int], dict[str, list[str]], set[str]]:
    """Sizes and ordered children for every module, missing prefixes (and ``""``) synthesised.

    Children are ordered by first appearance, which is execution order in ``compute_module_sizes``'s
    output. A synthesised prefix is the sum of its children (returned in the third value).
    """
    sizes: dict[str, int] = {}
    children: dict[str, list[str]] = {"": []}
    synthetic: set[str] = set()

    def ensure(name: str) -> None:
        if name in children:
            return
        parent = name.rpartition(".")[0]
        ensure(parent)
        children[name] = []
        children[parent].append(name)

    for name, size in module_sizes.items():
        if not isinstance(name, str):
            raise PlanError(f"module names must be strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PlanError(f"module {name!r}: size must be a non-negative int, got {size!r}")
        if name:
            ensure(name)
        sizes[name] = size
    for name in children:
        if name not in sizes:
            synthetic.add(name)
    # synthesised prefixes: sum of children, deepest first
    for name in sorted(synthetic, key=lambda n: -n.count(".") - (1 if n else 0)):
        sizes[name] = sum(sizes[c] for c in children[name])
    return sizes, children, synthetic


def _no_split_matcher(patterns: Iterable[str], names: Iterable[str]) -> set[str]:
    """Module names that must stay whole: exact names, or fnmatch patterns (``model.layers.*``)."""
    names = list(names)
    name_set = set(names)
    out: set[str] = set()
    for pat in patterns:
        if any(ch in pat for ch in "*?["):
            out.update(fnmatch.filter(names, pat))
        elif pat in name_set:
            out.add(pat)
        else:
            raise PlanError(f"no_split names a module that module_sizes does not have: {pat!r}")
    return out


def _build_tree(module_sizes: Mapping[str, int], no_split: Iterable[str]) -> _Tree:
    sizes, children, synthetic = _normalise_sizes(module_sizes)
    whole = _no_split_matcher(no_split, children.keys())
    names: list[str] = []
    node_sizes: list[int] = []
    kids: list[list[int]] = []
    parent: list[int] = []
    first: list[int] = []
    pos = 0
    # iterative preorder; each stack entry is (name, parent index)
    stack: list[tuple[str, int]] = [("", -1)]
    while stack:
        name, par = stack.pop()
        idx = len(names)
        names.append(name)
        node_sizes.append(sizes[name])
        kids.append([])
        parent.append(par)
        first.append(pos)
        if par >= 0:
            kids[par].append(idx)
        ch = children[name]
        covered = sum(sizes[c] for c in ch)
        atomic = not ch or name in whole or (name not in synthetic and covered < sizes[name])
        if atomic:
            pos += 1
        else:
            stack.extend((c, idx) for c in reversed(ch))
    n = len(names)
    end = [0] * n
    min_atom = [0] * n
    atom_bytes = [0] * n
    additive = True
    for i in range(n - 1, -1, -1):
        if kids[i]:
            end[i] = end[kids[i][-1]]
            min_atom[i] = min(min_atom[c] for c in kids[i])
            atom_bytes[i] = sum(atom_bytes[c] for c in kids[i])
            additive = additive and atom_bytes[i] == node_sizes[i]
        else:
            end[i] = first[i] + 1
            min_atom[i] = atom_bytes[i] = node_sizes[i]
    starts: list[list[int]] = [[] for _ in range(pos)]
    for i in range(n):
        starts[first[i]].append(i)
    return _Tree(tuple(names), tuple(node_sizes), tuple(tuple(k) for k in kids), tuple(parent),
                 tuple(first), tuple(end), tuple(tuple(s) for s in starts), tuple(min_atom),
                 tuple(atom_bytes), additive)


# --------------------------------------------------------------------------------------------------
# Plans and their order


@dataclass(frozen=True)
class Placement:
    """A plan before cleaning: ``entries`` are (module, device index) in execution order.

    ``reserve`` is the room kept on the first device for offloaded modules (0 without offload);
    ``exact`` says whether the plan was proved optimal.
    """

    entries: tuple[tuple[str, int], ...]
    loads: tuple[int, ...]
    switches: int
    reserve: int = 0
    exact: bool = False


@dataclass(frozen=True)
class _Plan:
    entries: tuple[tuple[int, int], ...]  # (tree node, device) in execution order
    loads: tuple[int, ...]
    switches: int
    atoms: tuple[int, ...]  # bytes of atomic modules per device

    @property
    def key(self) -> tuple:
        return _key(self.loads, self.atoms, self.switches, len(self.entries))


def _key(loads: Sequence[int], atoms: Sequence[int], switches: int, items: int) -> tuple:
    """Lexicographic objective, smaller is better: for each device ``j`` but the last, the bytes
    past it (``T_j``), then minus the atomic modules' bytes it runs; then device changes, then
    entries. The second term only decides between plans whose charged bytes tie (shared weights:
    the lm_head on the GPU while the CPU keeps the whole model); it counts what runs there, not what
    is charged, so opening a module whose children over-count is not rewarded."""
    out = []
    past = sum(loads[1:])
    for j in range(len(loads) - 1):
        out.append(past)
        out.append(-atoms[j])
        past -= loads[j + 1]
    return (*out, switches, items)


def _objective_len(n: int) -> int:
    """How many leading entries of a key are bytes (what the exact search proves optimal)."""
    return 2 * (n - 1)


def _key_function(n: int):
    """The heuristics' ranking of partial plans covering the same modules: bytes past each device,
    then the bytes charged to it, *fewer* first (the same coverage for less of the device leaves
    more room; preferring more would reward opening modules whose children over-count shared
    weights). Unrolled for two and three devices: it runs once per transition."""
    if n == 2:
        return lambda loads, sw, items: (loads[1], loads[0], sw, items)
    if n == 3:
        return lambda loads, sw, items: (loads[1] + loads[2], loads[0], loads[2], loads[1], sw, items)

    def rank(loads, sw, items):
        out = []
        past = sum(loads[1:])
        for j in range(n - 1):
            out.append(past)
            out.append(loads[j])
            past -= loads[j + 1]
        return (*out, sw, items)

    return rank


def _plan_from(entries: list[tuple[int, int]], tree: _Tree, n_dev: int) -> _Plan:
    entries = sorted(entries, key=lambda e: tree.first[e[0]])
    loads = [0] * n_dev
    atoms = [0] * n_dev
    switches = 0
    prev = -1
    for v, d in entries:
        loads[d] += tree.sizes[v]
        atoms[d] += tree.atom_bytes[v]
        if prev >= 0 and d != prev:
            switches += 1
        prev = d
    return _Plan(tuple(entries), tuple(loads), switches, tuple(atoms))


def _better(a: _Plan | None, b: _Plan | None) -> _Plan | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if b.key < a.key else a


@dataclass(frozen=True)
class _Limits:
    """Per-device budgets (after any reservation) and largest module each may take."""

    caps: tuple[int, ...]
    item: tuple[float, ...]
    max_switches: int | None


def _root_bound(tree: _Tree, lim: _Limits, mincost0: float) -> tuple:
    """Lower bound on the key of any plan: the cheapest cover's bytes that cannot fit on devices
    ``0..j``; every atomic byte on device ``j`` (its budget, when sizes add up)."""
    n = len(lim.caps)
    out = []
    room = 0
    for j in range(n - 1):
        room += lim.caps[j]
        out.append(max(0, mincost0 - room))
        out.append(-min(tree.atom_bytes[0], lim.caps[j]) if tree.additive else -tree.atom_bytes[0])
    return (*out, 0, 1 if tree.n_positions else 0)


# --------------------------------------------------------------------------------------------------
# Heuristic 1: device by device, first-fit decreasing over the tree, then swaps


def _fill_device(tree: _Tree, pool: list[int], room: int, limit: float) -> tuple[list[int], list[int]]:
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


def _swap_fill(tree: _Tree, taken: list[int], left: list[int], room: int, limit: float
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


def _atoms(tree: _Tree) -> list[int]:
    return [tree.starts[p][-1] for p in range(tree.n_positions)]


def _refill_from(tree: _Tree, lim: _Limits, plan: _Plan, j: int, fine: bool) -> _Plan | None:
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
    return _plan_from(entries, tree, n)


def _regap(tree: _Tree, lim: _Limits, plan: _Plan) -> _Plan | None:
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
            cand = _plan_from(entries, tree, n)
            if all(x <= c for x, c in zip(cand.loads, lim.caps)):
                best = _better(best, cand)
    # a spare device change can split one gap between two later devices
    spare = lim.max_switches - (best.switches if best is not None else plan.switches)
    base = best if best is not None else plan
    while spare > 0:
        split = _split_a_gap(tree, lim, base)
        if split is None or split.switches > lim.max_switches or split.key >= base.key:
            break
        base = split
        spare = lim.max_switches - base.switches
    return _better(best, base if base is not plan else None)


def _split_a_gap(tree: _Tree, lim: _Limits, plan: _Plan) -> _Plan | None:
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
                    k = _key(loads, loads, 0, 0)
                    if choice is None or k < choice[0]:
                        choice = (k, c)
                if choice is None:
                    continue
                c = choice[1]
                new = outside + [(v, d1) for v in _walk_cover(tree, pre[1], a, a, c, True)]
                new += [(v, d2) for v in _walk_cover(tree, suf[1], a, c, b, False)]
                best = _better(best, _plan_from(new, tree, n))
    return best


def _cover_costs(tree: _Tree, a: int, b: int, limit: float, forward: bool):
    """Cheapest covers of ``a..c-1`` (forward) or ``c..b-1`` (backward) for every ``c``, with the
    module that ends (forward) or starts (backward) the cover at ``c``."""
    m = b - a
    cost = [_INF] * (m + 1)
    via = [-1] * (m + 1)
    if forward:
        cost[0] = 0
        for p in range(a, b):
            if cost[p - a] == _INF:
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


def _walk_cover(tree: _Tree, via: list[int], a: int, lo: int, hi: int, forward: bool) -> list[int]:
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


def _cheapest_cover(tree: _Tree, a: int, b: int, limit: float) -> list[int] | None:
    """Modules of at most ``limit`` bytes covering positions ``a..b-1`` with the fewest bytes."""
    cost, via = _cover_costs(tree, a, b, limit, forward=False)
    return None if cost[0] == _INF else _walk_cover(tree, via, a, a, b, forward=False)


def _atoms_under(tree: _Tree, v: int) -> list[int]:
    return [tree.starts[p][-1] for p in range(tree.first[v], tree.end[v])]


def _greedy_by_device(tree: _Tree, lim: _Limits, fine: bool) -> _Plan | None:
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
    return _plan_from(entries, tree, n)


def _first_fit_across(tree: _Tree, lim: _Limits) -> _Plan | None:
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
    return _plan_from(entries, tree, n)


# --------------------------------------------------------------------------------------------------
# Heuristic 2: one representative per (position, device, switches) along execution order


def _sequence_dp(tree: _Tree, lim: _Limits, beam: int = 1) -> list[tuple[int, int]] | None:
    """Dynamic programme over execution order keeping the ``beam`` best partial plans per state.

    A state is (position, current device, switches used) under a switch bound, and just the
    position without one (the device then only matters for the tie-break on switches, which the
    rank carries). Partial plans reaching a state are ranked by :func:`_key_function`; distinct
    load vectors only. With one switch on two devices the best one is optimal; otherwise a wider
    beam keeps alternatives that leave room for later modules. Ranking by bytes so far is myopic
    (it fills device 0 early and may find no room for a big module at the end), so
    :func:`_heuristic` also runs it on the mirrored order.
    """
    n = len(lim.caps)
    npos = tree.n_positions
    caps, item, max_sw = lim.caps, lim.item, lim.max_switches
    total_cap = sum(caps)
    mincost = tree.mincost()
    per_dev = _per_device_mincost(tree, lim)
    # per position: state key -> list of (rank, loads, switches, items, back, device), best first;
    # back = (position, state key, index in that list, node, device)
    states: list[dict] = [dict() for _ in range(npos + 1)]
    bounded = max_sw is not None
    states[0][(-1, 0) if bounded else 0] = [((), (0,) * n, 0, 0, None, -1)]
    rank_of = _key_function(n)
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


def _mirror(tree: _Tree) -> _Tree:
    """The same modules with execution order reversed (for the backward sequence pass)."""
    npos = tree.n_positions
    first = tuple(npos - e for e in tree.end)
    end = tuple(npos - f for f in tree.first)
    starts: list[list[int]] = [[] for _ in range(npos)]
    for v in range(len(tree.names)):  # preorder: ancestors before descendants
        starts[first[v]].append(v)
    return _Tree(tree.names, tree.sizes, tree.children, tree.parent, first, end,
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


def _per_device_mincost(tree: _Tree, lim: _Limits) -> list[list[float]]:
    cache: dict[float, list[float]] = {}
    return [cache.setdefault(lim.item[d], tree.mincost(lim.item[d])) for d in range(len(lim.caps))]


def _heuristic(tree: _Tree, lim: _Limits, quick: bool = False) -> _Plan | None:
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
                best = _better(best, _plan_from(entries, tree, len(lim.caps)))
            if best is not None and tree.n_positions > _MIRROR_MAX_POSITIONS:
                break  # large models: the forward pass only (the backward one doubles the time)
    for fine in (True, False):
        greedy = _greedy_by_device(tree, lim, fine)
        if greedy is not None and (lim.max_switches is None or greedy.switches <= lim.max_switches):
            best = _better(best, greedy)
    if best is not None and not quick and len(lim.caps) > 2:
        if lim.max_switches is None:
            for j in range(1, len(lim.caps) - 1):
                for fine in (True, False):
                    best = _better(best, _refill_from(tree, lim, best, j, fine))
        else:
            best = _better(best, _regap(tree, lim, best))
    return best


# --------------------------------------------------------------------------------------------------
# Exact: depth-first branch and bound with memoised states


class _Stop(Exception):
    pass


class _Budget:
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

    def __init__(self, tree: _Tree, limit: int):
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


def _gcd_caps(tree: _Tree, caps: Sequence[int]) -> tuple[int, ...]:
    """Budgets rounded down to a multiple of the sizes' gcd: no load can use the remainder."""
    g = 0
    for s in tree.sizes:
        g = math.gcd(g, s)
    if g <= 1:
        return tuple(caps)
    return tuple(c // g * g for c in caps)


def _exact(tree: _Tree, lim: _Limits, incumbent: _Plan | None, budget: _Budget,
           first_only: bool = False) -> tuple[_Plan | None, bool]:
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
    per_dev = _per_device_mincost(tree, lim)
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
    m = _objective_len(n)
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
            k = _key(loads, atoms, sw, items)
            if best[1] is None or k < best[1]:
                best[0] = _Plan(tuple(path), loads, sw, atoms)
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


# --------------------------------------------------------------------------------------------------
# Reservation for offloaded modules, and the driver


@dataclass(frozen=True)
class _Problem:
    tree: _Tree
    devices: tuple[Hashable, ...]
    caps: tuple[int, ...]
    offload: tuple[bool, ...]  # executed on device 0 (reserve="offload" only)
    max_switches: int | None
    exact: bool


def _solve_fixed(prob: _Problem, lim: _Limits, budget: _Budget, first_only: bool = False
                 ) -> tuple[_Plan | None, bool]:
    """Heuristic plan, then (small problems) the exact search seeded with it."""
    plan = _heuristic(prob.tree, lim, quick=first_only)
    if not prob.exact:
        return plan, False
    if first_only and plan is not None:
        return plan, True
    return _exact(prob.tree, lim, plan, budget, first_only=first_only)


def _solve(prob: _Problem, first_only: bool = False, budget_size: int = EXACT_BUDGET
           ) -> tuple[_Plan | None, int, bool]:
    """Best plan, the reservation it needs, and whether it is proved optimal."""
    n = len(prob.caps)
    budget = _Budget(budget_size)
    if not any(prob.offload):
        plan, proved = _solve_fixed(prob, _Limits(prob.caps, (_INF,) * n, prob.max_switches), budget, first_only)
        return plan, 0, proved
    tree = prob.tree
    mincost0 = tree.mincost()[0]
    candidates = sorted({0, *(s for s in tree.sizes if s <= prob.caps[0])})
    nonoff = sum(c for c, off in zip(prob.caps, prob.offload) if not off)
    lo = _smallest_possible_reserve(tree, candidates, nonoff)
    best: _Plan | None = None
    best_r = 0
    proved_all = True
    tries = 0
    for r in candidates[lo:]:
        lim = _reserve_limits(prob, r)
        if best is not None and _root_bound(tree, lim, mincost0) >= best.key:
            break
        if tree.forced(r) > nonoff - r:
            continue
        if prob.exact:
            plan, proved = _solve_fixed(prob, lim, budget, first_only)
        else:
            plan, proved = _heuristic(tree, lim, quick=True), False
        proved_all &= proved
        if plan is not None and (best is None or plan.key < best.key):
            best, best_r = plan, r
            if first_only:
                break
        if best is not None and not prob.exact:
            tries += 1
            if tries > _HEURISTIC_RESERVE_TRIES:
                proved_all = False
                break
    if best is not None and not prob.exact and not first_only:
        best = _better(best, _heuristic(tree, _reserve_limits(prob, best_r)))
    if best is not None:  # the room actually needed: the largest offloaded entry (<= candidate)
        best_r = max((tree.sizes[v] for v, d in best.entries if prob.offload[d]), default=0)
    return best, best_r, proved_all


def _reserve_limits(prob: _Problem, r: int) -> _Limits:
    caps = (prob.caps[0] - r, *prob.caps[1:])
    item = tuple(r if off else _INF for off in prob.offload)
    return _Limits(caps, item, prob.max_switches)


def _smallest_possible_reserve(tree: _Tree, candidates: list[int], nonoff: int) -> int:
    """Index of the first candidate for which the modules too big to offload could fit at all.

    ``forced`` only falls as the reservation grows, so this is a binary search.
    """
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if tree.forced(candidates[mid]) <= nonoff:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _clean(prob: _Problem, plan: _Plan, reserve: int) -> dict[str, Hashable]:
    """Merge siblings on one device into their parent, recursively (offloaded merges only up to
    the reservation, since a merged offloaded entry is brought to the first device whole)."""
    tree = prob.tree
    n = len(tree.names)
    dev: list[int | None] = [None] * n
    for v, d in plan.entries:
        dev[v] = d
    for v in range(n - 1, -1, -1):
        kids = tree.children[v]
        if dev[v] is not None or not kids:
            continue
        d0 = dev[kids[0]]
        if d0 is None or any(dev[c] != d0 for c in kids):
            continue
        if prob.offload[d0] and tree.sizes[v] > reserve:
            continue
        dev[v] = d0
    out: dict[str, Hashable] = {}
    stack = [0]
    while stack:
        v = stack.pop()
        if dev[v] is not None:
            out[tree.names[v]] = prob.devices[dev[v]]
        else:
            stack.extend(reversed(tree.children[v]))
    return out


def _needed(prob: _Problem) -> dict[Hashable, int | None]:
    """For each device, the smallest budget that (others unchanged) makes a placement exist."""
    total = prob.tree.mincost()[0]
    out: dict[Hashable, int | None] = {}
    for j, name in enumerate(prob.devices):
        def feasible(cap: int) -> bool:
            caps = prob.caps[:j] + (cap,) + prob.caps[j + 1:]
            trial = _Problem(prob.tree, prob.devices, caps, prob.offload, prob.max_switches, prob.exact)
            return _solve(trial, first_only=True, budget_size=_FEASIBILITY_BUDGET)[0] is not None

        lo = prob.caps[j]  # infeasible
        hi = max(lo + 1, int(total) + max(prob.tree.sizes) + lo)
        if not feasible(hi):
            out[name] = None
            continue
        tol = 1 if prob.exact else max(1, hi >> 12)
        while hi - lo > tol:
            mid = (lo + hi) // 2
            if feasible(mid):
                hi = mid
            else:
                lo = mid
        out[name] = hi
    return out


def _make_problem(module_sizes: Mapping[str, int], max_memory: Mapping[Hashable, int], no_split: Iterable[str],
                  max_switches: int | None, reserve: str | None) -> _Problem:
    if not max_memory:
        raise PlanError("max_memory names no device")
    for dev, cap in max_memory.items():
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise PlanError(f"device {dev!r}: budget must be a non-negative int of bytes, got {cap!r}")
    if max_switches is not None and (not isinstance(max_switches, int) or max_switches < 0):
        raise PlanError(f"max_switches must be None or a non-negative int, got {max_switches!r}")
    if reserve not in (None, "offload"):
        raise PlanError(f"reserve must be None or 'offload', got {reserve!r}")
    if isinstance(no_split, str):
        no_split = (no_split,)
    tree = _build_tree(module_sizes, no_split)
    devices = tuple(max_memory)
    offload = tuple(reserve == "offload" and i > 0 and str(d) in OFFLOAD_DEVICES for i, d in enumerate(devices))
    exact = len(tree.names) <= EXACT_MAX_MODULES
    return _Problem(tree, devices, tuple(max_memory.values()), offload, max_switches, exact)


def plan_placement(module_sizes: Mapping[str, int], max_memory: Mapping[Hashable, int], *,
                   no_split: Iterable[str] = (), max_switches: int | None = None,
                   reserve: str | None = None, method: str = "auto") -> Placement:
    """The uncleaned plan behind :func:`infer_device_map`, with loads and whether it is exact.

    ``method``: ``"auto"`` (exact up to :data:`EXACT_MAX_MODULES` modules), ``"exact"`` or
    ``"heuristic"`` (to compare them, as the tests do). Raises :class:`PlanError` when nothing fits.
    """
    prob = _make_problem(module_sizes, max_memory, no_split, max_switches, reserve)
    if method not in ("auto", "exact", "heuristic"):
        raise PlanError(f"method must be 'auto', 'exact' or 'heuristic', got {method!r}")
    if method != "auto":
        prob = _Problem(prob.tree, prob.devices, prob.caps, prob.offload, prob.max_switches, method == "exact")
    plan, reserve_bytes, proved = _solve(prob)
    if plan is None:
        _raise_no_fit(prob)
    entries = tuple((prob.tree.names[v], d) for v, d in plan.entries)
    return Placement(entries, plan.loads, plan.switches, reserve_bytes, proved and prob.exact)


def _raise_no_fit(prob: _Problem) -> None:
    needed = _needed(prob)
    budgets = ", ".join(f"{d}: {c:,}" for d, c in zip(prob.devices, prob.caps))
    need = ", ".join(f"{d}: {'no budget alone suffices' if v is None else f'{v:,}'}" for d, v in needed.items())
    how = "" if prob.exact else " (heuristic search: the model is too large for the exact one)"
    sw = "" if prob.max_switches is None else f" with at most {prob.max_switches} device changes"
    off = " with offloaded modules executed on the first device" if any(prob.offload) else ""
    raise PlanError(
        f"no placement of the model ({prob.tree.sizes[0]:,} bytes) fits the budgets {{{budgets}}}{sw}{off}"
        f"{how}; each device alone would need at least {{{need}}}",
        needed=needed,
    )


def infer_device_map(module_sizes: Mapping[str, int], max_memory: Mapping[Hashable, int], *,
                     no_split: Iterable[str] = (), max_switches: int | None = None,
                     reserve: str | None = None) -> dict[str, str]:
    """Place every module of a model on a device, as many bytes as possible on the earlier devices.

    ``module_sizes``: dotted module names to bytes, every prefix included, ``""`` the total, in
    execution order (accelerate's ``compute_module_sizes``). ``max_memory``: device to budget in
    bytes, fastest first. ``no_split``: modules (exact names, or fnmatch patterns such as
    ``"model.layers.*"``) that are never split. ``max_switches``: most device changes along execution
    order. ``reserve="offload"``: modules on ``cpu``/``disk`` run on the first device, which keeps
    room for the largest of them.

    Returns ``{module: device}`` in execution order, siblings on one device merged into their parent;
    the devices are ``max_memory``'s keys, unchanged. Deterministic. Raises :class:`PlanError` (with
    the smallest budget each device alone would need) when nothing fits.
    """
    prob = _make_problem(module_sizes, max_memory, no_split, max_switches, reserve)
    plan, reserve_bytes, _ = _solve(prob)
    if plan is None:
        _raise_no_fit(prob)
    return _clean(prob, plan, reserve_bytes)
