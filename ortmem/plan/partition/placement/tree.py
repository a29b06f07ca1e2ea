"""The module tree as the search sees it: placeable modules in execution preorder, spans, sizes, ``no_split``.

Part of the placement search behind :mod:`ortmem.plan.partition.device_map` (its docstring
describes the model and the method)."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable, Mapping

from ortmem.errors import PlanError


INF = float("inf")


@dataclass(frozen=True)
class Tree:
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

    def mincost(self, limit: float = INF) -> list[float]:
        """Cheapest cover of positions ``p..`` using modules of at most ``limit`` bytes (inf: none)."""
        n = self.n_positions
        best = [INF] * (n + 1)
        best[n] = 0
        for p in range(n - 1, -1, -1):
            b = INF
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
            b = INF
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


def build_tree(module_sizes: Mapping[str, int], no_split: Iterable[str]) -> Tree:
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
    return Tree(tuple(names), tuple(node_sizes), tuple(tuple(k) for k in kids), tuple(parent),
                 tuple(first), tuple(end), tuple(tuple(s) for s in starts), tuple(min_atom),
                 tuple(atom_bytes), additive)


