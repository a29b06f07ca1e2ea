"""Honest memory measurement: each session creation in a fresh process, sampled from outside.

Public API: :func:`probe` (one strategy, one fresh process), :func:`run_bench` (interleaved
repeats, fastest and medians, table/JSON/plot in :mod:`ortmem.measure.bench`), whole processes timed
from outside (:func:`ortmem.measure.whole_process.run_whole_process`, ``ortmem bench --whole-process``),
the strategy registry (:mod:`ortmem.measure.strategies`), N worker processes on one model with summed
PSS (:func:`ortmem.measure.workers.run_workers`, ``ortmem bench --workers``) and a CI gate
(:mod:`ortmem.measure.budget_gate`).
Linux only: elsewhere :class:`ProbeUnsupported` is raised.

Why the names are lazy: the measured child imports ``ortmem.base.procfs`` and
``ortmem.measure.strategies`` before its clock starts; an eager package ``__init__`` would load the
parent's machinery (subprocess, tempfile, json, the probe) into every child's baseline, standard
library an ortmem session would otherwise have paid for inside its own creation.

``probe`` names both a module and its main function: ``ortmem.measure.probe`` is the function. Lazily,
the import system binds the *module* to the package whenever ``ortmem.measure.probe`` is first
imported, so :class:`_Package` turns that binding into the function.
"""
import sys
import types

from ortmem.base.lazy import lazy_attributes

#: public name -> module that owns it
_LAZY = {
    "ProbeError": "ortmem.measure.failures",
    "ProbeUnsupported": "ortmem.measure.failures",
    "Prepared": "ortmem.measure.probe",
    "ProbeResult": "ortmem.measure.probe",
    "prepare": "ortmem.measure.probe",
    "probe": "ortmem.measure.probe",
    "STRATEGIES": "ortmem.measure.strategies",
    "Strategy": "ortmem.measure.strategies",
    "get_strategy": "ortmem.measure.strategies",
    "register": "ortmem.measure.strategies",
    "run_bench": "ortmem.measure.bench",
    "run_whole_process": "ortmem.measure.whole_process",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


class _Package(types.ModuleType):
    """This package's module type: a submodule bound under a public function's name binds the function."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == f"{__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
