"""The package's import graph and its constants: no cycle between its modules, no underscored name imported
from another module, no import pointing up the declared layers, and no constant defined in two modules.

Every import counts, one inside a function included (a lazy import is still a dependency); one under
``if TYPE_CHECKING:`` does not. Why a test: these rules keep the layers readable, and each is easy to
break by one import or one copied constant without anything else failing; this makes such a change
fail CI.
"""
from __future__ import annotations

import ast
import graphlib
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import ortmem
from tests.support.layers import LAYERS, layer_of

ROOT = Path(ortmem.__file__).resolve().parent

#: Imports that still point up, as (importer prefixes, imported prefix), each with its reason; the test
#: fails when one no longer matches any import (delete it here).
UPWARD_ALLOWED: dict[tuple[tuple[str, ...], str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _lazy_owner(name: str) -> Optional[str]:
    """The module a name read from the package root comes from (``from ortmem import InferenceSession``)."""
    owners = {**vars(ortmem)["_LAZY"], **vars(ortmem)["_OPTIONAL"]}
    return owners.get(name)


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[str] = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                     for n in ast.walk(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                if not target.startswith("ortmem"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    dst = sub if sub in mods else (target == "ortmem" and _lazy_owner(alias.name)) or target
                    if dst in mods and dst != name and not (path.name == "__init__.py" and dst.startswith(name + ".")):
                        edges[name].add(dst)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and sub not in mods and target != name:
                        private.append(f"{name} imports {target}.{alias.name}")
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in mods and a.name != name)
    return edges, private


def test_no_import_cycle():
    edges, _ = _graph()
    try:
        list(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_no_underscored_name_crosses_a_module():
    _, private = _graph()
    assert not private, "\n".join(private)


def _within(module: str, prefixes: str | tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in ((prefixes,) if isinstance(prefixes, str) else prefixes))


def test_imports_point_down_the_layers():
    edges, _ = _graph()
    upward = {(a, b) for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a)}
    allowed = {(a, b) for a, b in upward for ap, bp in UPWARD_ALLOWED if _within(a, ap) and _within(b, bp)}
    new = sorted(upward - allowed)
    assert not new, "imports pointing up:\n" + "\n".join(
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})" for a, b in new)
    gone = [pair for pair in UPWARD_ALLOWED if not any(_within(a, pair[0]) and _within(b, pair[1]) for a, b in upward)]
    assert not gone, f"no longer imported, remove from UPWARD_ALLOWED: {gone}"


# ------------------------------------------------------------------------------------ constants

#: Constant names that mean something different in each module that defines them.
PER_MODULE_NAMES: dict[str, str] = {
    "NAME": "each CLI subcommand module's name (the cli/ protocol)",
    "HELP": "each CLI subcommand module's help line (the cli/ protocol)",
}
_CONSTANT_NODES = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.operator,
                   ast.unaryop, ast.Load, ast.Call, ast.Name)
_BUILDERS = {"frozenset": frozenset, "set": set, "tuple": tuple, "dict": dict}


def _constant_value(node: ast.expr) -> Any:
    """The value of a literal expression (``1 << 20``, ``frozenset({...})``); None for anything that
    names another object (an alias or a computed value is not a second definition)."""
    for n in ast.walk(node):
        if not isinstance(n, _CONSTANT_NODES) or (isinstance(n, ast.Name) and n.id not in _BUILDERS):
            return None
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _BUILDERS):
            return None
    try:
        return repr(eval(compile(ast.Expression(node), "<constant>", "eval"), {"__builtins__": _BUILDERS}))  # noqa: S307
    except Exception:  # noqa: BLE001 - not a literal after all
        return None


def constant_definitions() -> dict[tuple[str, str], list[str]]:
    """(name without leading underscores, value) -> the modules defining it at module level. A constant
    is a name starting with a capital (``MiB``, ``WEIGHTS_FILE``, ``_ALIGN``) bound to a literal."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in sorted(_modules().items()):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = [t for t in node.targets if isinstance(t, ast.Name)], node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                name = t.id.lstrip("_")
                if not re.match(r"[A-Z]", name) or name in PER_MODULE_NAMES:
                    continue
                literal = _constant_value(value)
                if literal is not None:
                    found[(name, literal)].append(module)
    return found


def test_no_constant_is_defined_in_two_modules():
    twice = {f"{name} = {value}": mods for (name, value), mods in constant_definitions().items() if len(mods) > 1}
    assert not twice, "define once and import:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(twice.items()))
