"""Mutation fuzzing: ortmem.load gives a model or an OrtmemError; ortmem's session accepts
exactly the models plain ORT accepts and agrees with it on outputs. The default run is a few
thousand cases (seconds); ``python -m bench.fuzz`` is the long run (1e5 loads, 5e3 sessions).
"""
from __future__ import annotations

import pytest

from tests.support.fuzz_models import run_fuzz


def _report(tally) -> str:
    return "\n".join(tally.failures[:20])


@pytest.mark.parametrize("seed", [0, 1])
def test_mutated_models_load_or_fail_cleanly(tmp_path, seed):
    loads, _ = run_fuzz(loads=1500, sessions=0, seed=seed, folder=tmp_path)
    assert loads.cases == 1500 and loads.accepted > 100 and loads.refused > 100  # both sides exercised
    assert not loads.failures, _report(loads)


def test_ortmem_accepts_exactly_what_ort_accepts(tmp_path):
    _, sessions = run_fuzz(loads=0, sessions=400, seed=3, folder=tmp_path)
    assert sessions.cases == 400 and sessions.accepted > 60 and sessions.refused > 40
    assert sessions.converted > 40  # the comparisons include rewritten models, not only plain handoffs
    assert not sessions.failures, _report(sessions)
