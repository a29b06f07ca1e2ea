"""Package attributes imported from their owning module on first use (PEP 562).

Why: a package ``__init__`` that imports its modules eagerly makes every user of one name pay for
all of them — ``import ortmem`` would load the planners, and building the CLI's parser would load the
estimator, the partitioner and the recompute planner together. A package that declares
``__getattr__, __dir__ = lazy_attributes(__name__, {...})`` exports its small public surface by name
and imports a module only when one of its names is read.

A public name must not equal the name of a module in the same package: once that module is imported,
Python binds the module itself to the package attribute and the lazy lookup is never asked.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, owners: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``owners`` maps each public name to the module
    (relative to ``package``) that defines it; a name read once is stored in the package's globals."""

    def __getattr__(name: str) -> Any:
        owner = owners.get(name)
        if owner is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(owner, package), name)
        setattr(sys.modules[package], name, value)  # later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(owners))

    return __getattr__, __dir__
