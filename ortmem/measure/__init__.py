"""Honest memory measurement: each session creation in a fresh process, sampled from outside.

Public API: :func:`probe` (one strategy, one fresh process), :func:`run_bench` (interleaved
repeats, medians, table/JSON/plot in :mod:`ortmem.measure.bench`), the strategy registry
(:mod:`ortmem.measure.strategies`), N worker processes on one model with summed PSS
(:func:`ortmem.measure.workers.run_workers`, ``ortmem bench --workers``) and a CI gate
(:mod:`ortmem.measure.gate`).
Linux only: elsewhere :class:`ProbeUnsupported` is raised.
"""
from .errors import ProbeError, ProbeUnsupported
from .probe import Prepared, ProbeResult, prepare, probe
from .strategies import STRATEGIES, Strategy, get_strategy, register

__all__ = [
    "ProbeError",
    "ProbeUnsupported",
    "Prepared",
    "ProbeResult",
    "prepare",
    "probe",
    "STRATEGIES",
    "Strategy",
    "get_strategy",
    "register",
    "run_bench",
]


def __getattr__(name: str):
    # bench pulls in statistics/plotting helpers; keep it out of the measured child's imports.
    if name == "run_bench":
        from .bench import run_bench

        return run_bench
    raise AttributeError(name)
