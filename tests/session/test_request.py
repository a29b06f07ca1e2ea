"""What a request decides once from the caller's providers: the pre-packed route only where every node
runs on ORT's CPU kernels.

Pre-packed weights are CPU kernel layouts, so a session with a GPU provider (CUDA first, the CPU EP as
its fallback) must load a converted entry itself, never its pre-packed model, and never pack one on
its first hit. No GPU is needed to ask: the request is built from the ``providers`` argument alone,
and what it hands over is run here by a plain CPU session.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortmem.session.handoff import Handoff
from ortmem.session.decide import prepare
from ortmem.session.request import Request
from ortmem.ort.release import capabilities
from ortmem.store.finished_entries import finished_stems
from ortmem.store.start import Decision
from tests.support.builders import tiny_decoder
from tests.support.compare import assert_same_outputs
from tests.support.reference import CPU, run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
#: Sessions whose nodes may run elsewhere than on ORT's CPU kernels (names or (name, options) entries).
NOT_CPU_ONLY = [
    ["CUDAExecutionProvider", "CPUExecutionProvider"],
    [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"],
    ["DmlExecutionProvider", "CPUExecutionProvider"],
]


def _run(handoff: Handoff) -> list[np.ndarray]:
    with handoff.creation_options(None) as options:
        sess = ort.InferenceSession(handoff.model, options, providers=CPU)
    handoff.after_create()
    return sess.run(None, FEEDS)


@pytest.mark.parametrize("providers", NOT_CPU_ONLY, ids=["cuda", "cuda-options", "dml"])
def test_a_session_with_a_gpu_provider_never_asks_for_pre_packed_weights(tmp_path: Path, providers) -> None:
    request = Request.for_session(None, providers, cache=tmp_path / "cache")
    assert request.converting  # ORT fuses DQ+MatMul for these too: the entry is converted as for the CPU
    assert not request.prepacked
    cpu = Request.for_session(None, CPU, cache=tmp_path / "cache")
    assert cpu.prepacked == (cpu.settings.prepacking and capabilities().prepacked_save)


def test_a_gpu_session_loads_the_converted_entry_itself_and_packs_nothing(tmp_path: Path) -> None:
    """Started twice with CUDA first: the cold start converts, the second loads the entry itself
    ("cache-hit"), leaves nothing to finish for later and no finished model in it; a CPU-only request's
    start after a finished one, beside it, does load ORT's finished model where this ORT saves one (the
    route exists and is refused here)."""
    model = tiny_decoder(tmp_path / "src", storage="external")
    expected = run_plain(model, FEEDS)
    gpu = Request.for_session(None, NOT_CPU_ONLY[0], cache=tmp_path / "cache")
    cold = prepare(str(model), gpu)
    assert cold.action == Decision.CONVERTED and cold.report is not None
    assert_same_outputs(_run(cold), expected)
    warm = prepare(str(model), gpu)
    assert warm.action == Decision.CACHE_HIT and warm.cache_hit and warm.fallback is None
    assert warm.start is not None and warm.start.entry is not None
    assert warm.later is None and not finished_stems(warm.start.entry.path)
    assert_same_outputs(_run(warm), expected)

    cpu = Request.for_session(None, CPU, cache=tmp_path / "cache")
    cpu_cold = prepare(str(model), cpu)  # cold: an entry of its own (fp16 kernels differ by provider)
    cpu_cold.after_create()
    if cpu.prepacked:  # what the cold start's first run leaves to the background job, done here
        from ortmem.store import finisher

        finisher.run(cpu_cold.start.later if cpu_cold.start.later is not None else finisher.FinishLater(
            str(cpu.cache.root), cpu_cold.start.entry.key, kind="converted",
            settings={"level": 99, "config": {}, "disabled": [], "converting": True}))
    cpu_warm = prepare(str(model), cpu)
    assert cpu_warm.action == (Decision.FINISHED if cpu.prepacked else Decision.CACHE_HIT)
    assert_same_outputs(_run(cpu_warm), expected)
