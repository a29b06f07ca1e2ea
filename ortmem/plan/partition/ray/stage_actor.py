"""What runs inside one stage's Ray actor: one :class:`ortmem.InferenceSession` for one stage file,
and the actor process's own memory, measured where it lives.

Kept free of driver logic so that a restarted actor (Ray re-runs ``__init__`` on the same node
after the process died) is exactly a fresh one: ``__init__`` only records the baseline; the session
is created by :meth:`StageWorker.load` (called by the pipeline on start, and by the first ``run``
after a restart).
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ortmem.errors import StageFailedError
from ortmem.base import procfs


def missing_files(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Those of ``paths`` that are not files here (run on each node before any actor exists)."""
    return [str(p) for p in paths if not Path(p).is_file()]


class StageWorker:
    """One stage: its files on this node, its session, its memory (``memory()``).

    The baseline for the stage's memory is this process's RSS when :meth:`load` starts (imports
    done, inside a Ray task); the stage's peak is ``VmHWM`` above it over creation and over the runs
    since (``VmHWM`` reset at both starts), as :mod:`ortmem.measure.probe` counts a session."""

    def __init__(self, stage: int, node: str | None, folder: str, stage_file: str, weights_file: str,
                 providers: list[Any], session_kwargs: dict[str, Any],
                 sess_options: Callable[[], Any] | None = None):
        import onnxruntime  # noqa: F401  (imported before the baseline, as the probe does)

        # the whole session path before the baseline, as the probe does: the stage's memory is its
        # session's, not ortmem's imports (the session class alone defers them to the first start)
        from ortmem.session import decide, handoff, request  # noqa: F401
        from ortmem.session.inference import InferenceSession  # noqa: F401
        from ortmem.store import verdict  # noqa: F401

        self.stage, self.node = stage, node
        self.folder = Path(folder)
        self.files = [self.folder / stage_file, self.folder / weights_file]
        self.providers, self.session_kwargs, self.sess_options = providers, session_kwargs, sess_options
        self.session = None
        self.mem: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}

    def load(self) -> dict[str, Any]:
        """Create the session (once) and return :meth:`memory`."""
        if self.session is None:
            from ortmem.session.inference import InferenceSession

            missing = missing_files(self.files)
            if missing:
                raise StageFailedError(f"missing on this node: {missing}", stage=self.stage, node=self.node,
                                       file=missing[0])
            # the baseline: after imports, inside a Ray task (this call), so Ray's own task
            # machinery is not charged to the stage
            self.mem["baseline"] = self._status()
            self.mem["baseline_rss_bytes"] = self.mem["baseline"]["rss_bytes"]
            procfs.reset_hwm()
            t0 = time.perf_counter()
            opts = self.sess_options() if self.sess_options is not None else None
            self.session = InferenceSession(str(self.files[0]), opts, providers=self.providers, **self.session_kwargs)
            self.mem["create_s"] = time.perf_counter() - t0
            self.mem["create"] = self._status()
            procfs.reset_hwm()
            self.mem["runs"] = 0
        return self.memory()

    def io(self) -> tuple[list[tuple[str, str, list]], list[tuple[str, str, list]]]:
        """(inputs, outputs) of the stage's session as (name, type, shape)."""
        self.load()
        return ([(a.name, a.type, list(a.shape)) for a in self.session.get_inputs()],
                [(a.name, a.type, list(a.shape)) for a in self.session.get_outputs()])

    def providers_used(self) -> list[str]:
        self.load()
        return list(self.session.get_providers())

    def run(self, output_names: Sequence[str], input_names: Sequence[str], *arrays: Any) -> Any:
        """Run the stage; Ray stores each output as its own object (``num_returns=len(output_names)``)."""
        self.load()
        outs = self.session.run(list(output_names), dict(zip(input_names, arrays)))
        self.mem["runs"] += 1
        self.mem["last_input_bytes"] = {n: int(getattr(a, "nbytes", 0)) for n, a in zip(input_names, arrays)}
        return outs[0] if len(outs) == 1 else tuple(outs)

    def memory(self) -> dict[str, Any]:
        """Baseline (after imports), creation (peak and after) and steady state (peak over the runs
        and now) of this actor's process, bytes: private (``RssAnon``: the heap), shared (``RssFile``:
        mapped weights, pre-packed weights, libraries) and ``object_store_bytes`` (``RssShmem``: pages
        of the node's Ray object store this process touched, reading inputs and writing outputs; the
        store is bounded by the node's ``object_store_memory``, not by the stage). ``peak_bytes`` is
        ``VmHWM`` and counts all three."""
        out = dict(self.mem)
        if self.session is not None:
            out["steady"] = self._status()
        if "baseline_rss_bytes" in out:
            out["peak_above_baseline_bytes"] = max(
                [out[k]["peak_bytes"] for k in ("create", "steady") if k in out] or [0]) - out["baseline_rss_bytes"]
        return out

    def pid(self) -> int:
        return os.getpid()

    @staticmethod
    def _status() -> dict[str, int]:
        s = procfs.read_status("self") or {}
        return {"peak_bytes": s.get("VmHWM", 0), "rss_bytes": s.get("VmRSS", 0), "private_bytes": s.get("RssAnon", 0),
                "shared_bytes": s.get("RssFile", 0), "object_store_bytes": s.get("RssShmem", 0)}
