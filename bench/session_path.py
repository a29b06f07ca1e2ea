"""How the session path walks through ortmem's modules: stays, entries per module, climbs back up.

Why: an architecture review followed ``model`` from ``InferenceSession.__init__`` through
every branch and counted where it went. This script makes that count repeatable instead of read by
eye. It creates real sessions of a small Llama-shaped QDQ model (:mod:`ortmem.measure.synth`) under
``sys.setprofile`` in fresh interpreters, one per start: a **cold** start (empty cache: convert and
publish an entry), a **second** start (the entry's first hit, before ORT's finished model of it exists) and a **warm**
start (the entry's finished model), plus ``cache=False`` (in memory).

What is counted (Python frames only; ORT's C++ is one call):

- the *current module* is the ortmem module of the innermost ortmem frame; a **move** is a change of it,
  named by the functions on both sides (``handoff.prepare -> store.cache.lookup``), and a loop that
  repeats a move counts it once, as reading the code would; the path is counted at module level: each
  distinct move from one module to another once, calls into the leaves of the import graph (modules
  that import no other ortmem module: errors, units, dtypes, digests, trust checks...) and into package
  ``__init__`` files left out, since a leaf cannot carry the path anywhere; ``passes``, ``ortmodel``
  and ``plan`` count as one unit each (the session path calls them through their public surface; how
  they are built inside is theirs, and the review that asked for this count found them reading well); a module's **entries** are the
  distinct moves into it;
- what runs under an import (module and class bodies of modules imported on the way) does not count:
  importing is not a step of the path; nor does what the loading core calls (:data:`LOADING_CORE`:
  ``load(path)`` reads ORT's external-data rules from ``ortmodel``): a call into the core is a use of
  the model, counted as a stay in the core, which is left out like a leaf;
- a **climb** is a stay in a module of a higher layer than the stay before it, where a module's layer
  is its height in ortmem's import graph (every ``import`` statement, function-level ones included:
  a module is one above the highest module it imports). A return from a lower layer to its caller is
  a climb, so a caller that asks a lower layer once and gets its answer climbs once; a path that
  bounces (handoff -> cache -> handoff -> cache) climbs on every bounce.

Run: ``python -m bench.session_path`` (from the repository root; a table per start) or
``--json`` for the raw counts.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

import ortmem
from tests.support.layers import LAYERS, layer_of

PACKAGE = Path(ortmem.__file__).resolve().parent

_CHILD = r"""
import json, os, sys, threading
from pathlib import Path
import numpy as np
import onnxruntime
import ortmem
pkg = str(Path(ortmem.__file__).resolve().parent)
seq = []
def module_of(filename):
    if not filename.startswith(pkg):
        return None
    rel = os.path.relpath(filename, os.path.dirname(pkg))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
cache = {}
last = [None]
def prof(frame, event, arg):
    if event not in ("call", "return"):
        return
    f = frame if event == "call" else frame.f_back
    while f is not None:
        code = f.f_code
        g = f
        while g is not None:  # anything running under an import (a module or class body) is not a step
            if g.f_code.co_name == "<module>" and g.f_code.co_filename != "<string>":
                return
            g = g.f_back
        m = cache.get(code.co_filename, 0)
        if m == 0:
            m = cache[code.co_filename] = module_of(code.co_filename)
        if m is not None:
            g = f.f_back
            while g is not None:  # what the loading core calls is part of that use, not a step of the path
                up = cache.get(g.f_code.co_filename, 0)
                if up == 0:
                    up = cache[g.f_code.co_filename] = module_of(g.f_code.co_filename)
                if up in core and up != m:
                    m, code = up, g.f_code
                g = g.f_back
            here = (m, code.co_name)
            if last[0] is not None and last[0][0] != m:
                seq.append([*last[0], *here])
            last[0] = here
            return
        f = f.f_back
model, cache_arg, core = sys.argv[1], sys.argv[2] == "1", set(json.loads(sys.argv[3]))
sys.setprofile(prof)
s = ortmem.InferenceSession(model, providers=["CPUExecutionProvider"], cache=cache_arg)
sys.setprofile(None)
feeds = {i.name: np.ones([d if isinstance(d, int) else 1 for d in i.shape], dtype=np.int64) for i in s.get_inputs()}
s.run(None, feeds)
from ortmem.store import finisher
finisher.wait_background(300)
print(json.dumps({"action": s.ortmem_action, "moves": seq}))
"""


def import_layers(package: Path = PACKAGE) -> dict[str, int]:
    """Each module's height in ortmem's import graph (0: imports no ortmem module)."""
    imports: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        name = ".".join(parts)
        base = parts if is_pkg else parts[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    root = base[: len(base) - node.level + 1]
                    mod = ".".join(root + ([mod] if mod else []))
                if mod.startswith("ortmem"):
                    found.add(mod)
                    found.update(f"{mod}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ortmem"))
        imports[name] = found
    known = set(imports)
    graph = {m: {d for d in deps if d in known and d != m} for m, deps in imports.items()}
    layers: dict[str, int] = {}

    def height(m: str, stack: frozenset = frozenset()) -> int:
        if m in layers:
            return layers[m]
        if m in stack:  # a cycle (tests/test_import_graph.py forbids them): count it once
            return 0
        h = 1 + max((height(d, stack | {m}) for d in graph[m]), default=-1)
        layers[m] = h
        return h

    for m in graph:
        height(m)
    return layers


#: The layers the session path is counted in module by module: the rest of ortmem is counted one unit
#: per layer (tests/support/layers.py), since the path calls them through their public surface.
SESSION_LAYERS = ("store", "session")
#: The loading core (docs/architecture.md, ../shared/design.md): the model's own data types and what they
#: are made of; calling them (``model.store``, ``ref.view()``, ``load(path)``) uses the model, it does not
#: take the path anywhere.
LOADING_CORE = ("root", "base", "onnxfile", "files")


def unit_of(module: str) -> Optional[str]:
    """What a stay in ``module`` counts as: the module itself in :data:`SESSION_LAYERS`, else its layer's
    name; None for the loading core (:data:`LOADING_CORE`: a call into it is a use, not a step) and for
    package ``__init__`` files (lazy attribute tables)."""
    if (PACKAGE / module.removeprefix("ortmem.").replace(".", "/") / "__init__.py").exists():
        return None
    layer = LAYERS[layer_of(module)][0]
    if layer in LOADING_CORE:
        return None
    return module if layer in SESSION_LAYERS else layer


def module_moves(moves: list[list[str]]) -> list[tuple[str, str]]:
    """The distinct moves between units (:func:`unit_of`) of one traced start."""
    path = [u for u in (unit_of(m) for m in _collapse(moves)) if u is not None]
    path = [m for i, m in enumerate(path) if i == 0 or path[i - 1] != m]
    return list(dict.fromkeys(zip(path, path[1:])))


def summarize(distinct: list[tuple[str, str]], layers: dict[str, int]) -> dict:
    """Counts over distinct module-to-module moves.

    A move is counted once however often the code makes it (a loop, or two functions of one module
    calling the same module), as reading the code module by module would.
    """
    entries = Counter(to_mod for _, to_mod in distinct)
    def rank(unit: str) -> tuple[int, int]:
        if unit.startswith("ortmem"):
            return layer_of(unit), layers.get(unit, 0)
        return next(i for i, (name, _) in enumerate(LAYERS) if name == unit), 0

    climbs = sum(1 for a, b in distinct if rank(b) > rank(a))
    modules = {m for move in distinct for m in move}
    return {"modules": len(modules), "moves": len(distinct), "climbs": climbs,
            "max_entries": max(entries.values(), default=0), "entries": dict(entries.most_common())}


def _collapse(moves: list[list[str]]) -> list[str]:
    """The sequence of current modules the moves walk through."""
    seq = [moves[0][0]] if moves else []
    for _, _, to_mod, _ in moves:
        seq.append(to_mod)
    return seq


def trace(model: Path, cache: bool, env: dict) -> dict:
    core = sorted(m for m in import_layers() if LAYERS[layer_of(m)][0] in LOADING_CORE)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(model), "1" if cache else "0", json.dumps(core)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure() -> dict[str, dict]:
    """Trace the four starts (cold, second, warm, ``cache=False``) of a small QDQ model in a fresh cache;
    the counts per start and over every branch together (:func:`summarize`)."""
    from ortmem.measure.synth import SynthConfig, write_model

    layers = import_layers()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(SynthConfig(storage="external"), Path(tmp) / "model.onnx")
        env = {**os.environ, "ORTMEM_CACHE_DIR": str(Path(tmp) / "cache")}
        every: list[tuple[str, str]] = []
        for label, cache in (("cold", True), ("second", True), ("warm", True), ("cache=False", False)):
            r = trace(Path(model), cache, env)
            moves = module_moves(r["moves"])
            every += moves
            results[label] = {"action": r["action"], **summarize(moves, layers)}
        results["every branch"] = {"action": "(all four)", **summarize(list(dict.fromkeys(every)), layers)}
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the raw counts as JSON")
    args = ap.parse_args(argv)
    results = measure()
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{'start':<12} {'action':<22} {'modules':>7} {'moves':>6} {'climbs':>6}  most entered")
    for label, r in results.items():
        top = ", ".join(f"{m.removeprefix('ortmem.')} {n}" for m, n in list(r["entries"].items())[:4])
        print(f"{label:<12} {r['action']:<22} {r['modules']:>7} {r['moves']:>6} {r['climbs']:>6}  {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
