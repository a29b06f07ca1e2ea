"""The package's import graph: no cycle between its modules (an import inside a function counts; one under
``if TYPE_CHECKING:`` does not) and no underscored name imported from another module.

Why a test: both rules keep the layers readable (ortmodel and the loading core at the bottom, passes and
plan above, session, measure and the CLI on top) and were broken before; this makes a regression fail CI.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import ortmem

ROOT = Path(ortmem.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


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
                    dst = sub if sub in mods else target
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
