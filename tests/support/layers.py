"""ortmem's layers, read from its folders: the import-graph test checks that imports point down them, and
``bench/session_path.py`` counts the session path's moves over them.

The order is the package's architecture (docs/architecture.md): each folder may import itself and the
folders before it, never one after it. ``intercept`` and ``serve`` share a level (neither imports the
other). The package root holds only ``__init__`` (lazy names), ``errors`` (the bottom) and ``__main__``
(the top).
"""
from __future__ import annotations

from pathlib import Path

import ortmem

#: The folders, bottom first; a tuple is one level of folders that do not import each other.
ORDER: tuple[tuple[str, ...], ...] = (
    ("base",), ("onnxfile",), ("files",), ("ort",), ("passes",), ("store",), ("session",),
    ("intercept", "serve"), ("measure",), ("plan",), ("cli",),
)

_PACKAGE = Path(ortmem.__file__).resolve().parent
_FOLDERS = {p.name for p in _PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
assert _FOLDERS == {f for level in ORDER for f in level}, f"folders without a layer: {_FOLDERS}"

#: (name, module prefixes) per layer, bottom first: the root's own modules at both ends.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("root", ("ortmem", "ortmem.errors")),
    *(("|".join(level), tuple(f"ortmem.{f}" for f in level)) for level in ORDER),
    ("main", ("ortmem.__main__",)),
)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer (its longest listed prefix)."""
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{module} is in no layer"
    return layer
