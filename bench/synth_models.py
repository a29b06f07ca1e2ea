"""Models for the pytest-benchmark suites (``pytest bench/ --benchmark-only``).

Models come from ``ortmem.measure.synth`` and are generated once into ``$ORTMEM_CACHE_DIR/synth``. Set
``ORTMEM_BENCH_SIZES=demo,0.6,1.6`` to choose the Llama-shaped sizes (default: demo, which keeps a
full run to a few minutes on 2 cores).
"""
from __future__ import annotations

import os

from ortmem.store.cache import cache_root
from ortmem.measure.synth import SynthConfig, cached_model

PRESETS = {"demo": SynthConfig.demo, "0.6": SynthConfig.llama_0_6gb, "1.6": SynthConfig.llama_1_6gb}


def sizes() -> list[str]:
    return [s.strip() for s in os.environ.get("ORTMEM_BENCH_SIZES", "demo").split(",") if s.strip()]


def synth_model(size: str, **kw) -> str:
    return str(cached_model(PRESETS[size](storage="external", **kw), cache_root() / "synth"))


