"""Plans and their order: the ``Placement`` result, the lexicographic objective, limits and the root bound.

Part of the placement search behind :mod:`ortmem.plan.partition.device_map` (its docstring
describes the model and the method)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ortmem.plan.partition.placement.tree import Tree


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
class Plan:
    entries: tuple[tuple[int, int], ...]  # (tree node, device) in execution order
    loads: tuple[int, ...]
    switches: int
    atoms: tuple[int, ...]  # bytes of atomic modules per device

    @property
    def key(self) -> tuple:
        return plan_key(self.loads, self.atoms, self.switches, len(self.entries))


def plan_key(loads: Sequence[int], atoms: Sequence[int], switches: int, items: int) -> tuple:
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


def objective_len(n: int) -> int:
    """How many leading entries of a key are bytes (what the exact search proves optimal)."""
    return 2 * (n - 1)


def plan_key_function(n: int):
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


def plan_from(entries: list[tuple[int, int]], tree: Tree, n_dev: int) -> Plan:
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
    return Plan(tuple(entries), tuple(loads), switches, tuple(atoms))


def better_plan(a: Plan | None, b: Plan | None) -> Plan | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if b.key < a.key else a


@dataclass(frozen=True)
class Limits:
    """Per-device budgets (after any reservation) and largest module each may take."""

    caps: tuple[int, ...]
    item: tuple[float, ...]
    max_switches: int | None


def root_bound(tree: Tree, lim: Limits, mincost0: float) -> tuple:
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


