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
polynomial in the bytes' bits); repeated layers keep the distinct load vectors few. On
decoder-shaped trees the search usually proves its plan optimal with one device change allowed, less
often with more changes or devices; each search stops after :data:`EXACT_BUDGET`
expansions and then returns the best plan found (never worse than the heuristic's) with
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
kept room for a later module survives. It plans a graph of ten thousand modules in under a second,
and its first device's bytes come close to the exact search's (the later devices' less close: the
lexicographic order lets the first device's last kilobytes decide what is left for the second).

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

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

from ortmem.errors import PlanError
from ortmem.plan.partition.placement.exact import EXACT_BUDGET, SearchBudget, exact_plan
from ortmem.plan.partition.placement.plans import Limits, Placement, Plan, better_plan, root_bound
from ortmem.plan.partition.placement.sequence import heuristic_plan
from ortmem.plan.partition.placement.tree import INF, Tree, build_tree

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
#: Budget of each feasibility search behind PlanError's per-device minimum.
_FEASIBILITY_BUDGET = 20_000
#: In heuristic mode, how many reservation candidates are solved after the first feasible one.
_HEURISTIC_RESERVE_TRIES = 4


# --------------------------------------------------------------------------------------------------
# Reservation for offloaded modules, and the driver


@dataclass(frozen=True)
class _Problem:
    tree: Tree
    devices: tuple[Hashable, ...]
    caps: tuple[int, ...]
    offload: tuple[bool, ...]  # executed on device 0 (reserve="offload" only)
    max_switches: int | None
    exact: bool


def _solve_fixed(prob: _Problem, lim: Limits, budget: SearchBudget, first_only: bool = False
                 ) -> tuple[Plan | None, bool]:
    """Heuristic plan, then (small problems) the exact search seeded with it."""
    plan = heuristic_plan(prob.tree, lim, quick=first_only)
    if not prob.exact:
        return plan, False
    if first_only and plan is not None:
        return plan, True
    return exact_plan(prob.tree, lim, plan, budget, first_only=first_only)


def _solve(prob: _Problem, first_only: bool = False, budget_size: int = EXACT_BUDGET
           ) -> tuple[Plan | None, int, bool]:
    """Best plan, the reservation it needs, and whether it is proved optimal."""
    n = len(prob.caps)
    budget = SearchBudget(budget_size)
    if not any(prob.offload):
        plan, proved = _solve_fixed(prob, Limits(prob.caps, (INF,) * n, prob.max_switches), budget, first_only)
        return plan, 0, proved
    tree = prob.tree
    mincost0 = tree.mincost()[0]
    candidates = sorted({0, *(s for s in tree.sizes if s <= prob.caps[0])})
    nonoff = sum(c for c, off in zip(prob.caps, prob.offload) if not off)
    lo = _smallest_possible_reserve(tree, candidates, nonoff)
    best: Plan | None = None
    best_r = 0
    proved_all = True
    tries = 0
    for r in candidates[lo:]:
        lim = _reserve_limits(prob, r)
        if best is not None and root_bound(tree, lim, mincost0) >= best.key:
            break
        if tree.forced(r) > nonoff - r:
            continue
        if prob.exact:
            plan, proved = _solve_fixed(prob, lim, budget, first_only)
        else:
            plan, proved = heuristic_plan(tree, lim, quick=True), False
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
        best = better_plan(best, heuristic_plan(tree, _reserve_limits(prob, best_r)))
    if best is not None:  # the room actually needed: the largest offloaded entry (<= candidate)
        best_r = max((tree.sizes[v] for v, d in best.entries if prob.offload[d]), default=0)
    return best, best_r, proved_all


def _reserve_limits(prob: _Problem, r: int) -> Limits:
    caps = (prob.caps[0] - r, *prob.caps[1:])
    item = tuple(r if off else INF for off in prob.offload)
    return Limits(caps, item, prob.max_switches)


def _smallest_possible_reserve(tree: Tree, candidates: list[int], nonoff: int) -> int:
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


def _clean(prob: _Problem, plan: Plan, reserve: int) -> dict[str, Hashable]:
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
    tree = build_tree(module_sizes, no_split)
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
