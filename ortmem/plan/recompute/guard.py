"""The guard: the original and the rewrite measured under ORT's defaults in fresh processes.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any, Mapping

import onnx

from ortmem.ort.recorded_settings import apply_session_changes, recorded_settings


class _Runs:
    """A session whose ``run`` runs ``n`` times: ``ortmem.measure.probe`` measures one ``run`` call,
    and the default peak is a matter of several runs (the arena grows, memory patterns kick in)."""

    def __init__(self, sess: Any, n: int) -> None:
        self._sess, self._n = sess, max(1, n)

    def get_inputs(self):
        return self._sess.get_inputs()

    def get_outputs(self):
        return self._sess.get_outputs()

    def run(self, names, feeds):
        out = None
        for _ in range(self._n):
            out = self._sess.run(names, feeds)
        return out


def _probe_session(model_path: str, options: Mapping[str, Any], *, live: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if live:
        from ortmem.base.hygiene import set_malloc_thresholds

        set_malloc_thresholds(mmap_threshold=128 << 10, trim_threshold=128 << 10)
        so.enable_cpu_mem_arena = False
        so.enable_mem_pattern = False
    apply_session_changes(so, recorded_settings(onnx.load(model_path, load_external_data=False)))
    return _Runs(ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"]), int(options.get("runs", 1)))


def probe_default(model_path: str, options: dict) -> Any:
    """Probe strategy (``"ortmem.plan.recompute:probe_default"``): ORT's defaults (arena, memory
    patterns, ``ORT_ENABLE_ALL``) with the settings the model records, ``options["runs"]`` runs."""
    return _probe_session(model_path, options, live=False)


def probe_live(model_path: str, options: dict) -> Any:
    """Probe strategy: arena and memory patterns off, glibc's thresholds pinned at 128 KiB, so resident
    memory follows the live set."""
    return _probe_session(model_path, options, live=True)


@dataclass
class Verdict:
    """Fresh-process measurements of a rewrite against the model it replaces, ORT's defaults."""

    original_bytes: list[int]  # resident memory over the runs above resident memory after creation
    rewritten_bytes: list[int]
    tolerance_bytes: int
    ok: bool

    @property
    def saved_bytes(self) -> int:
        return int(statistics.median(self.original_bytes) - statistics.median(self.rewritten_bytes))


def verify(original: str | os.PathLike, rewritten: str | os.PathLike, dims: Mapping[str, int], *, runs: int = 3,
           repeat: int = 2, tolerance_bytes: int | None = None, options: Mapping[str, Any] | None = None) -> Verdict:
    """Measure both models the way users run them (ORT defaults, ``runs`` runs, each model in
    ``repeat`` fresh processes) and say whether the rewrite keeps the default peak (median resident
    memory of the runs above resident memory after creation) within ``tolerance_bytes`` of the
    original's (default: 2% of it, at least 2 MiB: the same file measures up to 2.5 MiB apart between
    sets of fresh processes under ORT's defaults, docs/recompute.md). A planner's live-set prediction
    cannot see what ORT's arena and memory patterns do with a new layout (power-of-two arena growth,
    the pattern block, kernel scratch taken beside it), so a rewrite is shipped only when this says so."""
    from ortmem.measure.probe import probe

    opts = {"dims": dict(dims), "runs": runs, **dict(options or {})}
    res = {}
    for key, path in (("original", original), ("rewritten", rewritten)):
        vals = []
        for _ in range(max(1, repeat)):
            r = probe("ortmem.plan.recompute:probe_default", os.fspath(path), options=opts)
            vals.append(int(r.peak_run_bytes or 0) - int(r.rss_after_create_bytes))
        res[key] = vals
    base = statistics.median(res["original"])
    tol = max(2 << 20, int(0.02 * base)) if tolerance_bytes is None else tolerance_bytes
    ok = statistics.median(res["rewritten"]) <= base + tol
    return Verdict(res["original"], res["rewritten"], tol, ok)


