"""Which package ``import ortmem`` gives: this installed one, a folder that shadows it, or a program's own.

Why: Python resolves ``ortmem`` by the path of the program that runs, not by where ortmem is installed.
A folder named ``ortmem`` without ``__init__.py`` in the current folder (a clone's folder, seen from its
parent) becomes a namespace package that hides an editable install; its submodules still load, and
the first name read from the package itself (``__version__``) fails. :func:`problem` names that, so
the hook leaves the process's sessions to plain onnxruntime and the command says why, instead of an
``ImportError`` inside the program's session creation.

And the other way round: a program whose folder holds its own ``ortmem`` package must import that one
under ``python -m ortmem run``, as under plain python, while the hook keeps working with this one.
:func:`set_aside` takes this package's modules out of ``sys.modules`` before the program runs, and
:data:`OWN_MODULES` puts them back for the duration of the hook's own work (its installation, each
session it creates, the report), the program's modules set aside meanwhile. What a session does
after its creation runs with the program's modules in place.

The standard library only: the launcher imports this into every program it starts.
"""
from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any, Optional

#: The folder of this installed package (``.../ortmem``).
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
NAME = "ortmem"


def location(module: ModuleType) -> Optional[str]:
    """The folder a package was loaded from (a namespace package: its first folder), or a module's file."""
    file = getattr(module, "__file__", None)
    if file:
        return os.path.dirname(os.path.realpath(file)) if hasattr(module, "__path__") else os.path.realpath(file)
    folders = list(getattr(module, "__path__", None) or ())
    return os.path.realpath(folders[0]) if folders else None


def problem(package: Optional[ModuleType] = None) -> Optional[str]:
    """Why ``package`` (default: the ``ortmem`` this process imported) is not this installed package, in
    words that name the folder; None when it is."""
    package = package if package is not None else sys.modules.get(NAME)
    if package is None:
        return None
    where = location(package)
    if where == ROOT:
        return None
    if getattr(package, "__file__", None) is None:
        return f"a folder {where} (no __init__.py) shadows the installed package {ROOT}"
    kind = "package" if hasattr(package, "__path__") else "module"
    return f"a {kind} {where} shadows the installed package {ROOT}"


def found_location(name: str = NAME) -> Optional[str]:
    """Where ``import name`` would load the package from with ``sys.path`` and ``sys.meta_path`` as they
    are now, leaving ``sys.modules`` aside (a namespace package: its first folder); None when nothing
    finds it."""
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, None)
        except Exception:  # noqa: BLE001 - a third-party finder that cannot answer finds nothing
            continue
        if spec is None:
            continue
        if spec.origin and spec.has_location:
            return os.path.dirname(os.path.realpath(spec.origin)) if spec.submodule_search_locations is not None \
                else os.path.realpath(spec.origin)
        folders = list(spec.submodule_search_locations or ())
        return os.path.realpath(folders[0]) if folders else None
    return None


def _names() -> list[str]:
    return [n for n in list(sys.modules) if n == NAME or n.startswith(NAME + ".")]


class _OwnModules:
    """A context manager: this package's modules in ``sys.modules`` while it is open, once
    :func:`set_aside` has taken them out; nothing at all before that. Reentrant; one thread at a time
    (``sys.modules`` is the process's)."""

    def __init__(self) -> None:
        self.aside: Optional[dict[str, Any]] = None  # this package's modules, while set aside
        self.theirs: dict[str, Any] = {}
        self.depth = 0
        self.lock = threading.RLock()

    def set_aside(self) -> None:
        with self.lock:
            if self.aside is None:
                self.aside = {n: sys.modules.pop(n) for n in _names()}

    def __enter__(self) -> None:
        if self.aside is None:
            return
        self.lock.acquire()
        self.depth += 1
        if self.depth == 1:
            self.theirs = {n: sys.modules.pop(n) for n in _names()}
            sys.modules.update(self.aside)

    def __exit__(self, *exc: Any) -> None:
        if self.aside is None or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            self.aside = {n: sys.modules.pop(n) for n in _names()}  # with what the work imported
            sys.modules.update(self.theirs)
            self.theirs = {}
        self.lock.release()


#: ``with OWN_MODULES:`` around the hook's own work (see the module docstring).
OWN_MODULES = _OwnModules()


def set_aside() -> None:
    """Take this package's modules out of ``sys.modules``: ``import ortmem`` then resolves as it would
    in a process that never imported it; :data:`OWN_MODULES` brings them back for the hook's work."""
    OWN_MODULES.set_aside()


def leave_to_program() -> bool:
    """Set this package aside when the program's ``import ortmem`` (``sys.path`` set up for it) would load
    another one than the process has; True when it did."""
    current = sys.modules.get(NAME)
    if current is None:
        return False
    found = found_location()
    if found is None or found == location(current):
        return False
    set_aside()
    return True
