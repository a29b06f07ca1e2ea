"""Session creation per strategy and model size, each round in a fresh process.

The timing pytest-benchmark records is the probe's whole round trip; the numbers that matter are in
``extra_info``: peak RSS above the import baseline, steady RSS, creation time, all from the probe.
Save and compare runs with ``--benchmark-autosave`` and ``--benchmark-compare``.
"""
from __future__ import annotations

import tempfile

import pytest

from ortmem.measure.probe import prepare, probe
from ortmem.measure.strategies import get_strategy

STRATEGIES = ["ort", "ort-hygiene", "twin", "ortmem", "ortmem-warm", "ortmem-nocache"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_session_creation(benchmark, llama_qdq, strategy):
    workdir = tempfile.mkdtemp(prefix="ortmem-bench-")
    strat = get_strategy(strategy)
    prepared = prepare(strat, llama_qdq, workdir=workdir) if strat.prepare and strat.prepare_scope == "once" else None
    results = []

    def run():
        p = prepare(strat, llama_qdq, workdir=workdir) if strat.prepare and strat.prepare_scope == "each" else prepared
        results.append(probe(strat, llama_qdq, prepared=p))

    benchmark.pedantic(run, rounds=3, iterations=1)
    best = sorted(results, key=lambda r: r.peak_bytes)[len(results) // 2]
    benchmark.extra_info.update({
        "peak_above_baseline_mib": best.peak_above_baseline_bytes / 2**20,
        "steady_mib": best.steady_bytes / 2**20,
        "create_wall_s": best.create_wall_s,
        "output_hash": best.output_hash,
    })
