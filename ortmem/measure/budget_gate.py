"""A memory budget gate for CI: fail a test when creating (and once running) a session costs too much.

Measured in a fresh process (see :mod:`ortmem.measure.probe`) so the test runner's own heap, and
every model other tests loaded, do not leak into the number. Usage::

    from ortmem.measure.budget_gate import assert_session_peak_below
    assert_session_peak_below("model.onnx", 600 * 2**20)

or with the fixture (import it into a test module or ``conftest.py``)::

    from ortmem.measure.budget_gate import session_memory_budget  # noqa: F401

    def test_fits(session_memory_budget):
        session_memory_budget("model.onnx", 600 * 2**20, strategy="ort")
"""
from __future__ import annotations

import os
from typing import Any, Callable, Literal

from ortmem.base.units import MiB
from ortmem.measure.probe import ProbeResult, probe

Phase = Literal["peak", "create", "run"]


def _measured(result: ProbeResult, phase: Phase) -> int | None:
    return {"peak": result.peak_bytes, "create": result.peak_create_bytes, "run": result.peak_run_bytes}[phase]


def assert_session_peak_below(
    model_path: str | os.PathLike,
    budget_bytes: int,
    strategy: str = "ort",
    options: dict[str, Any] | None = None,
    *,
    phase: Phase = "peak",
    include_baseline: bool = True,
    timeout: float = 600.0,
) -> ProbeResult:
    """Probe ``strategy`` on ``model_path`` and assert its peak RSS is at most ``budget_bytes``.

    ``phase``: ``"peak"`` (creation and first run, default), ``"create"`` or ``"run"``.
    ``include_baseline``: the budget covers the whole process (interpreter + imports, as a
    deployment sees it) by default; ``False`` budgets only what the session adds over the baseline.
    Returns the :class:`ProbeResult` so a test can also check other numbers.
    """
    result = probe(strategy, model_path, options=options, timeout=timeout)
    measured = _measured(result, phase)
    if measured is None:
        raise ValueError(f"phase {phase!r} was not measured (options run=False?)")
    value = measured if include_baseline else measured - result.baseline_rss_bytes
    if value > budget_bytes:
        what = "peak RSS" if include_baseline else "peak RSS over the import baseline"
        raise AssertionError(
            f"{os.path.basename(os.fspath(model_path))} with strategy {strategy!r}: {what} "
            f"({phase}) {value / MiB:.1f} MiB exceeds budget {budget_bytes / MiB:.1f} MiB "
            f"by {(value - budget_bytes) / MiB:.1f} MiB. Measured: peak {result.peak_bytes / MiB:.1f} MiB "
            f"(creation {result.peak_create_bytes / MiB:.1f}, first run "
            f"{(result.peak_run_bytes or 0) / MiB:.1f}, helpers {result.helper_peak_create_bytes / MiB:.1f}), "
            f"baseline after imports {result.baseline_rss_bytes / MiB:.1f} MiB, "
            f"steady {result.steady_bytes / MiB:.1f} MiB, "
            f"anon peak {result.peak_anon_bytes / MiB:.1f} MiB, file peak {result.peak_file_bytes / MiB:.1f} MiB, "
            f"init {result.create_wall_s:.2f} s"
        )
    return result


try:
    import pytest
except ImportError:  # pytest is a test-only dependency: the assert function works without it
    session_memory_budget = None
else:

    @pytest.fixture
    def session_memory_budget() -> Callable[..., ProbeResult]:
        """The :func:`assert_session_peak_below` function, as a fixture (same arguments)."""
        return assert_session_peak_below
