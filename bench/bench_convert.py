"""Conversion throughput (GB/s of quantized weight bytes) per weight variant.

``pytest bench/bench_convert.py --benchmark-only``; the throughput is in each result's ``extra_info``.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import ortmem
from ortmem.store.writer import write_converted
from ortmem.ort.settings import session_settings
from ortmem.passes.nbits import packing as nb
from ortmem.passes.engine import plan_conversion

from bench.synth_models import synth_model

VARIANTS = {
    "int4": {},
    "uint4+zp": {"weight_type": "uint4", "zero_points": True},
    "int8": {"weight_type": "int8"},
    "int2": {"weight_type": "int2"},
    "int4-block128": {"block_size": 128},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_convert_demo_model(benchmark, variant):
    """Whole-model conversion into a folder (model.onnx + weights.bin), demo size (0.24 GB of int4)."""
    path = synth_model("demo", **VARIANTS[variant])
    with ortmem.load(path) as model:
        plan = plan_conversion(model, session_settings())
    out = Path(tempfile.mkdtemp(prefix="ortmem-bench-"))

    def run():
        for p in out.iterdir():
            p.unlink()
        # a fresh load and plan each round: the conversion releases each source span it has read
        with ortmem.load(path) as model:
            return write_converted(model, plan_conversion(model, session_settings()), out)

    report = benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info["source_bytes"] = plan.converted_source_bytes
    benchmark.extra_info["gb_per_s"] = plan.converted_source_bytes / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["kernel_and_write_gb_per_s_last"] = report.throughput_gbps
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_kernel(benchmark, bits):
    """The packing kernel alone on one 4096x4096 weight, into a warm preallocated buffer."""
    K = N = 4096
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, size=K * N * bits // 8, dtype=np.uint8)
    shp = nb.matmulnbits_shapes(K, N, bits, 32, False)
    out = np.empty(shp.B, np.uint8)
    benchmark(nb.pack_B, w, K, N, bits, True, 32, out=out)
    benchmark.extra_info["gb_per_s"] = w.nbytes / benchmark.stats.stats.median / 1e9
