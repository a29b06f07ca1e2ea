"""Which contiguous runs of the graph go to which device: first-order stage costs, the candidate
plans (the weight placer with few device changes, a contiguous fill), and the post-pass that moves
cuts to module boundaries with few tensors alive across them (steps 4-6 of
:mod:`ortmem.plan.partition`'s docstring).

Everything here is first-order arithmetic on :class:`~ortmem.plan.partition.graph._Graph` positions;
checking a stage with the estimator is :mod:`ortmem.plan.partition.verify`'s job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ortmem.errors import PlanError
from ortmem.plan.partition.device_map import Placement, plan_placement
from ortmem.plan.partition.graph_modules import ModuleTree, activation_peak
from ortmem.plan.partition.graph import PartitionGraph

#: How many module boundaries either side of a cut the post-pass looks at.
CUT_WINDOW = 32


@dataclass
class CandidateStage:
    lo: int  # first position (execution order)
    hi: int  # one past the last
    device: int


@dataclass
class _Cost:
    weights: dict[str, int]
    weight_bytes: int
    activation_bytes: int
    workspace_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.workspace_bytes


class StageCosts:
    """First-order stage costs, memoised by span (the cut post-pass asks for many spans).

    A device's stages cost their weights, ``act_mult[device]`` times their activation peak (workspace
    included; :data:`~ortmem.plan.partition.verify.ARENA_STEADY` on verified CPU devices, where ORT's arena holds that much in steady
    state) and ``overhead[device]`` each. ``nodes[device]``: the machine a device is on (None: this
    one); a cut between devices of different nodes sends its tensors over the network.
    """

    def __init__(self, G: PartitionGraph, overhead: Sequence[int], act_mult: Sequence[float] | None = None,
                 nodes: Sequence[str | None] | None = None):
        self.G = G
        self.overhead = list(overhead)
        self.act_mult = list(act_mult) if act_mult is not None else [1.0] * len(self.overhead)
        self.nodes = list(nodes) if nodes is not None else [None] * len(self.overhead)
        self._memo: dict[tuple[int, int], _Cost] = {}
        self._zeros = [0] * len(G.order)

    def span(self, lo: int, hi: int) -> _Cost:
        key = (lo, hi)
        hit = self._memo.get(key)
        if hit is None:
            G = self.G
            w: dict[str, int] = {}
            for p in range(lo, hi):
                w.update(G.weights[p])
            members = list(range(lo, hi))
            with_ws = activation_peak(members, G.inputs_pos, G.consumers_pos, G.escapes, G.act, G.ws)
            without = activation_peak(members, G.inputs_pos, G.consumers_pos, G.escapes, G.act, self._zeros)
            hit = _Cost(w, sum(w.values()), without, max(0, with_ws - without))
            self._memo[key] = hit
        return hit

    def activations(self, stages: Sequence[CandidateStage], n_devices: int) -> list[int]:
        """First-order activation bytes per device (with ``act_mult``)."""
        out = [0] * n_devices
        for s in stages:
            c = self.span(s.lo, s.hi)
            out[s.device] += int(self.act_mult[s.device] * (c.activation_bytes + c.workspace_bytes))
        return out

    def device_totals(self, stages: Sequence[CandidateStage], n_devices: int) -> tuple[list[int], list[int]]:
        """(first-order bytes per device, shared-weight credit per device)."""
        totals = [0] * n_devices
        credit = [0] * n_devices
        seen: list[dict[str, int]] = [dict() for _ in range(n_devices)]
        for s in stages:
            c = self.span(s.lo, s.hi)
            totals[s.device] += (c.weight_bytes + int(self.act_mult[s.device] * (c.activation_bytes + c.workspace_bytes))
                                 + self.overhead[s.device])
            for k, b in c.weights.items():
                if k in seen[s.device]:
                    credit[s.device] += b
                else:
                    seen[s.device][k] = b
        return [t - c for t, c in zip(totals, credit)], credit


def _runs(devs: Sequence[int]) -> list[CandidateStage]:
    out: list[CandidateStage] = []
    for p, d in enumerate(devs):
        if out and out[-1].device == d:
            out[-1].hi = p + 1
        else:
            out.append(CandidateStage(p, p + 1, d))
    return out


def _leaf_devices(tree: ModuleTree, placement: Placement) -> dict[str, int]:
    entry = {m: d for m, d in placement.entries}
    out: dict[str, int] = {}
    for leaf in tree.nodes:
        m = leaf
        while m not in entry:
            if not m:
                raise PlanError(f"internal: module {leaf!r} has no device in the placement")
            m = m.rpartition(".")[0]
        out[leaf] = entry[m]
    return out


def _live_across(G: PartitionGraph) -> tuple[list[int], list[int]]:
    """For each cut position c (between positions c-1 and c): how many planned tensors, and how many
    bytes, are made before c and read at or after c."""
    n = len(G.order)
    count = [0] * (n + 2)
    nbytes = [0] * (n + 2)
    for p in range(n):
        if not G.consumers_pos[p]:
            continue
        last = max(G.consumers_pos[p])
        # one entry per node (its outputs together), as the costs are per node
        count[p + 1] += 1
        count[last + 1] -= 1
        nbytes[p + 1] += G.act[p]
        nbytes[last + 1] -= G.act[p]
    for c in range(1, n + 1):
        count[c] += count[c - 1]
        nbytes[c] += nbytes[c - 1]
    return count, nbytes


def module_boundaries(G: PartitionGraph, tree: ModuleTree) -> list[int]:
    mods = [tree.module_of[label] for label in G.labels]
    return [c for c in range(1, len(mods)) if mods[c] != mods[c - 1]]


def _normalise(stages: Sequence[CandidateStage]) -> list[CandidateStage]:
    """Drop empty stages and merge neighbours on one device."""
    out: list[CandidateStage] = []
    for s in stages:
        if s.hi <= s.lo:
            continue
        if out and out[-1].device == s.device:
            out[-1] = CandidateStage(out[-1].lo, s.hi, s.device)
        else:
            out.append(CandidateStage(s.lo, s.hi, s.device))
    return out


def _improve_cuts(stages: list[CandidateStage], G: PartitionGraph, costs: StageCosts, boundaries: list[int], caps: Sequence[int],
                  budgets: Sequence[int], slack: float) -> list[CandidateStage]:
    """Move each cut to the nearby module boundary that leaves the fewest bytes alive across cuts
    between *nodes* (network transfers; 0 when every device is on one machine), then the fewest
    tensors alive across all cuts, then the fewest bytes; moving a cut onto its neighbour removes a
    stage (see :mod:`ortmem.plan.partition`, step 6)."""
    import bisect

    count, nbytes = _live_across(G)
    n_dev = len(caps)
    nodes = costs.nodes

    def score(st: Sequence[CandidateStage]) -> tuple[int, int, int]:
        remote = sum(nbytes[s.lo] for prev, s in zip(st, st[1:]) if nodes[prev.device] != nodes[s.device])
        return remote, sum(count[s.lo] for s in st[1:]), sum(nbytes[s.lo] for s in st[1:])

    stages = _normalise(stages)
    start_totals, _ = costs.device_totals(stages, n_dev)
    k = 0
    while k < len(stages) - 1:
        left, right = stages[k], stages[k + 1]
        a, b, c = left.lo, left.hi, right.hi
        early = min(left.device, right.device)
        j = bisect.bisect_left(boundaries, b)
        cands = [x for x in boundaries[max(0, j - CUT_WINDOW): j + CUT_WINDOW + 1] if a < x < c and x != b]
        cands += [a, c]  # a stage handed whole to its neighbour's device
        best_key = (*score(stages), 0, 0)
        best = stages
        for x in cands:
            trial = _normalise([*stages[:k], CandidateStage(a, x, left.device), CandidateStage(x, c, right.device), *stages[k + 2:]])
            new, _ = costs.device_totals(trial, n_dev)
            if new[left.device] > caps[left.device] or new[right.device] > caps[right.device]:
                continue
            lost = max(0, start_totals[early] - new[early])  # against the planner's: slack is not spent twice
            if lost > slack * budgets[early]:
                continue
            key = (*score(trial), lost, abs(x - b))
            if key < best_key:
                best_key, best = key, trial
        if best is not stages:
            stages = best
            k = max(0, k - 1)  # a removed stage changes the previous cut's neighbourhood
            continue
        k += 1
    return stages


#: Device changes ``choose_stages`` allows beyond one stage per device (each extra one is another session).
EXTRA_SWITCHES = 2


def choose_stages(tree: ModuleTree, sizes: Mapping[str, int], G: PartitionGraph, costs: StageCosts, boundaries: list[int],
            names: Sequence[str], caps: Sequence[int], limits: Sequence[int], budgets: Sequence[int], slack: float
            ) -> tuple[Placement, dict[str, int], list[CandidateStage]]:
    """The placement to use, its leaf devices and its stages (after the cut post-pass).

    The planner alone would scatter small modules over every device that has a few bytes left (dozens
    of device changes): each change is another stage, another session with its fixed cost, more
    crossing tensors. So the number of changes is bounded: ``devices - 1`` (one stage per device, the
    exact search where it runs), then up to :data:`EXTRA_SWITCHES` more (the heuristic), e.g. an
    embedding too large for the fast devices on the CPU, the layers on the fast devices, the rest back
    on the CPU. Of the plans whose stages fit (first-order costs, per-stage overhead included), the one
    with the most bytes on the earlier devices wins; a plan with fewer changes wins when it keeps,
    device by device, all but ``slack`` of that plan's bytes on the earlier devices. When no plan fits
    (a device's stages need more than the planner's sizes said), the weight budgets of the devices
    that were over shrink by the excess and the plans are made again (a few times).
    """
    caps = list(caps)
    for _ in range(_REPAIRS):
        got = _choose_once(tree, sizes, G, costs, boundaries, names, caps, limits, budgets, slack)
        if got[3] is None:
            return got[0], got[1], got[2]
        over = got[3]
        caps = [max(0, c - o) for c, o in zip(caps, over)]
    got = _choose_once(tree, sizes, G, costs, boundaries, names, caps, limits, budgets, slack)
    return got[0], got[1], got[2]


#: Rounds of "shrink the weight budget of what was over" inside ``choose_stages``.
_REPAIRS = 3


def _choose_once(tree: ModuleTree, sizes: Mapping[str, int], G: PartitionGraph, costs: StageCosts, boundaries: list[int],
                 names: Sequence[str], caps: Sequence[int], limits: Sequence[int], budgets: Sequence[int],
                 slack: float) -> tuple[Placement, dict[str, int], list[CandidateStage], list[int] | None]:
    """One pass of :func:`choose_stages`; the last value is None when the plan fits, else the bytes each
    device is over in the plan with the most bytes on the earlier devices.

    Candidates: the planner with ``devices - 1`` .. ``devices - 1 + EXTRA_SWITCHES`` device changes,
    and a contiguous fill (:func:`_fill`: each device but the last takes one run of modules, as
    large as its budget allows, in preference order; what fits none goes to the last device). They
    are compared on the weight bytes their final stages put on the earlier devices.
    """
    n = len(names)
    max_memory = dict(zip(names, caps))

    def finish(stages: list[CandidateStage]) -> tuple[list[CandidateStage], bool, list[int], tuple[int, ...]]:
        st = _improve_cuts(stages, G, costs, boundaries, limits, budgets, slack)
        totals, _ = costs.device_totals(st, n)
        over = [max(0, t - lim) for t, lim in zip(totals, limits)]
        w = [0] * n
        for x in st:
            w[x.device] += costs.span(x.lo, x.hi).weight_bytes
        cum, acc = [], 0
        for x in w[:-1]:
            acc += x
            cum.append(acc)
        return st, not any(over), over, tuple(cum)

    def from_placement(p: Placement):
        leaf_dev = _leaf_devices(tree, p)
        devs = [leaf_dev[tree.module_of[label]] for label in G.labels]
        return (p, leaf_dev, *finish(_runs(devs)))

    def attempt(k: int, method: str):
        try:
            p = plan_placement(sizes, max_memory, max_switches=k, method=method)
        except PlanError:
            return None
        return from_placement(p)

    tried = [attempt(n - 1, "auto")] + [attempt(k, "heuristic") for k in range(n, n + EXTRA_SWITCHES)]
    if all(t is None for t in tried):  # the weights alone fit nowhere: the planner's error says what each
        plan_placement(sizes, max_memory)  # device would need (it raises)
    filled = _fill(G, costs, boundaries, limits)
    if filled is not None:
        leaf_dev: dict[str, int] = {}
        for x in filled:
            for q in range(x.lo, x.hi):
                leaf_dev.setdefault(tree.module_of[G.labels[q]], x.device)
        loads = [0] * n
        for m, d in leaf_dev.items():
            loads[d] += sizes[m]
        p = Placement(tuple(leaf_dev.items()), tuple(loads), max(0, len(filled) - 1))
        tried.append((p, leaf_dev, *finish(filled)))
    fitting = [t for t in tried if t is not None and t[3]]
    if not fitting:
        for k in range(n - 2, -1, -1):  # fewer stages, fewer sessions to pay for
            t = attempt(k, "auto")
            if t is not None and t[3]:
                fitting = [t]
                break
    if not fitting:
        last = max((t for t in tried if t is not None), key=lambda t: t[5])
        return last[0], last[1], last[2], last[4]
    best = max(fitting, key=lambda t: t[5])
    want = best[5]
    for t in sorted(fitting, key=lambda t: len(t[2])):
        if all(g >= w - slack * budgets[j] for j, (g, w) in enumerate(zip(t[5], want))):
            return t[0], t[1], t[2], None
    return best[0], best[1], best[2], None


def _fill(G: PartitionGraph, costs: StageCosts, boundaries: list[int], limits: Sequence[int]) -> list[CandidateStage] | None:
    """Contiguous fill in device preference order: each device but the last takes the longest run of
    whole modules from where the previous one stopped that fits its first-order limit; a module no
    remaining device can hold alone goes to the last device, and the last takes the rest."""
    n = len(limits)
    total = len(G.order)
    cuts = [0, *boundaries, total]
    last = n - 1
    out: list[CandidateStage] = []

    def fits(j: int, lo: int, hi: int) -> bool:
        return costs.device_totals([CandidateStage(lo, hi, j)], n)[0][j] <= limits[j]

    i, j = 0, 0
    while cuts[i] < total:
        if j >= last:
            out.append(CandidateStage(cuts[i], total, last))
            break
        lo = cuts[i]
        if not fits(j, lo, cuts[i + 1]):
            if any(fits(k, lo, cuts[i + 1]) for k in range(j + 1, last)):
                j += 1  # a later fast device can hold it: this one is done
            else:
                out.append(CandidateStage(lo, cuts[i + 1], last))
                i += 1
            continue
        good, step = i + 1, 1  # gallop, then bisect (costs grow with the run, near enough)
        while good + step < len(cuts) and fits(j, lo, cuts[good + step]):
            good += step
            step *= 2
        hi_bad = min(good + step, len(cuts))
        while hi_bad - good > 1:
            mid = (good + hi_bad) // 2
            if fits(j, lo, cuts[mid]):
                good = mid
            else:
                hi_bad = mid
        out.append(CandidateStage(lo, cuts[good], j))
        i, j = good, j + 1
    return _normalise(out) if out else None
