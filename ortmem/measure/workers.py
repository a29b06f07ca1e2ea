"""``ortmem bench --workers N``: N fresh worker processes on one model, measured together.

Why: a server runs several processes on one model (gunicorn/uvicorn workers, a process pool). What
each of them costs is its *private* memory (anonymous: heap, ORT's packed weights), while weights
mapped from a file are *shared*: the page cache holds them once for every process. One process's
RSS cannot show this; the sum of PSS over the workers can (a page mapped by k processes counts 1/k
in each). Measured when every worker has created its session and run it once, from
``/proc/<pid>/smaps_rollup`` (``Pss_Anon + Pss_Shmem`` = private, ``Pss_File`` = shared).

Workers start all at once (``together``, the way a process manager forks them) or one after the
other (``stagger``: the next starts when the previous is ready). While they start, the machine's
used memory (``MemTotal - MemAvailable``) is sampled: its rise is what starting them cost the
machine at the worst moment, creation peaks included.

Memory guard: before a larger N, the private peak per worker seen at the smallest N (its own
``VmHWM - RssFile``, so other processes on the machine do not skew it) is scaled up; if that
would pass ``GUARD_FRACTION`` of the memory available now (or a ``budget`` the caller sets, e.g. on
a machine shared with others), the run is not made and its totals are
extrapolated (private per worker times N, shared once) and marked ``extrapolated``. This is how a
7B-class sweep stops plain ORT before it would exhaust the machine.

Results are part of the bench JSON (``"workers"`` in schema ``ortmem.bench/2``, see
:mod:`ortmem.measure.report`)::

    {"model": "/abs/model.onnx", "counts": [1, 2, 4, 8], "together": true,
     "runs": [{"strategy", "n", "together", "extrapolated", "error",
               "total_pss_bytes", "total_private_bytes", "total_shared_bytes",
               "private_per_worker_bytes",            # the largest worker's Pss_Anon + Pss_Shmem
               "ready_wall_s",                        # first start to last worker ready
               "used_before_bytes", "peak_used_bytes",  # machine MemTotal - MemAvailable
               "workers": [{"pid", "create_wall_s", "run_wall_s", "ready_s", "output_hash",
                            "pss", "pss_anon", "pss_file", "pss_shmem", "rss", "converted",
                            "peak_private"}]}]}   # VmHWM - RssFile when ready
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Sequence

from ortmem.base.child_env import helper_environment
from ortmem.base import procfs
from ortmem.measure.failures import ProbeError
from ortmem.base.units import MiB
from ortmem.measure.probe import Prepared, prepare
from ortmem.measure.machine_state import Leftovers, flush_writes
from ortmem.measure.strategies import get_strategy
from ortmem.measure.text_table import align

DEFAULT_STRATEGIES = ("ort", "twin", "ortmem-warm")
DEFAULT_SWEEP = (1, 2, 4, 8)
GUARD_FRACTION = 0.8


@dataclass
class WorkerReading:
    """One worker, read when all workers were ready. Bytes and seconds."""

    pid: int
    create_wall_s: float
    run_wall_s: float
    ready_s: float  # since the first worker was started
    output_hash: str
    pss: int
    pss_anon: int
    pss_file: int
    pss_shmem: int
    rss: int
    converted: bool = False  # an ortmem session that converted the model (cold start, no cache hit)
    peak_private: int = 0  # VmHWM - RssFile when ready: the worker's own private peak, about
    ortmem_action: str | None = None  # an ortmem session's ``ortmem_action`` (None for others)

    @property
    def private(self) -> int:
        return self.pss_anon + self.pss_shmem


@dataclass
class WorkersRun:
    """N workers of one strategy. Totals are sums over the workers (or extrapolated, see module)."""

    strategy: str
    n: int
    together: bool
    total_pss_bytes: int = 0
    total_private_bytes: int = 0
    total_shared_bytes: int = 0
    private_per_worker_bytes: int = 0
    ready_wall_s: float | None = None
    used_before_bytes: int | None = None
    peak_used_bytes: int | None = None
    extrapolated: bool = False
    error: str | None = None
    workers: list[WorkerReading] = field(default_factory=list)

    @property
    def peak_rise_bytes(self) -> int | None:
        """How much the machine's used memory rose while the workers started."""
        if self.peak_used_bytes is None or self.used_before_bytes is None:
            return None
        return max(self.peak_used_bytes - self.used_before_bytes, 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkersRun":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["workers"] = [WorkerReading(**w) for w in d.get("workers", [])]
        return cls(**kw)


@dataclass
class WorkersReport:
    model: str
    counts: list[int]
    together: bool
    runs: list[WorkersRun] = field(default_factory=list)

    def run(self, strategy: str, n: int) -> WorkersRun | None:
        return next((r for r in self.runs if r.strategy == strategy and r.n == n and not r.error), None)

    def strategies(self) -> list[str]:
        return list(dict.fromkeys(r.strategy for r in self.runs))

    def same_output(self, run: WorkersRun) -> bool | None:
        """Every worker's output equals plain ORT's (any ``ort`` worker); None without ORT."""
        ref = {w.output_hash for r in self.runs if r.strategy == "ort" for w in r.workers}
        if not ref or not run.workers:
            return None
        return all(w.output_hash in ref for w in run.workers)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "counts": list(self.counts), "together": self.together,
                "runs": [r.to_dict() for r in self.runs]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkersReport":
        return cls(d["model"], list(d["counts"]), bool(d["together"]),
                   [WorkersRun.from_dict(r) for r in d.get("runs", [])])

    def render_table(self) -> str:
        """One row per (strategy, N): totals over the workers, private and shared apart, ratios to
        the same strategy at one worker and to the twin (else ``ort``) at the same N."""
        ref = "twin" if "twin" in self.strategies() else "ort"
        header = ["strategy", "N", "total PSS", "private", "shared", "private/worker", "+private/extra",
                  "PSS/1 worker", f"PSS/{ref}", f"private/{ref}", "ready s", "machine rise", "out", "note"]
        rows = [header]
        for r in self.runs:
            if r.error:
                rows.append([r.strategy, str(r.n)] + ["-"] * (len(header) - 3) + [f"FAILED: {r.error[:60]}"])
                continue
            one = self.run(r.strategy, min(self.counts))
            base = self.run(ref, r.n)
            extra = ("-" if one is None or r.n == one.n else
                     f"{(r.total_private_bytes - one.total_private_bytes) / (r.n - one.n) / MiB:.0f}")
            same = self.same_output(r)
            rows.append([
                r.strategy, str(r.n), f"{r.total_pss_bytes / MiB:.0f}", f"{r.total_private_bytes / MiB:.0f}",
                f"{r.total_shared_bytes / MiB:.0f}", f"{r.private_per_worker_bytes / MiB:.0f}", extra,
                _div(r.total_pss_bytes, one.total_pss_bytes if one else None),
                _div(r.total_pss_bytes, base.total_pss_bytes if base else None),
                _div(r.total_private_bytes, base.total_private_bytes if base else None),
                "-" if r.ready_wall_s is None else f"{r.ready_wall_s:.2f}",
                "-" if r.peak_rise_bytes is None else f"{r.peak_rise_bytes / MiB:.0f}",
                "-" if same is None else ("=ort" if same else "DIFF"),
                _note(r),
            ])
        mode = "started together" if self.together else "started one after the other"
        lines = [f"workers on {os.path.basename(self.model)}, {mode}; MiB, summed PSS when all were ready"]
        lines += align(rows)
        lines.append(
            "private: Pss_Anon+Pss_Shmem (each worker's own); shared: Pss_File (page cache, counted once); "
            "PSS/1 worker: total PSS over one worker's (N=1 row); machine rise: peak of MemTotal-MemAvailable "
            "while starting, over before; extrapolated: not run, N x private per worker + shared (memory guard); converted: workers that "
            "converted the model (the others read the cache)"
        )
        return "\n".join(lines)


def _note(run: WorkersRun) -> str:
    if run.extrapolated:
        return "extrapolated"
    converted = sum(w.converted for w in run.workers)
    return f"{converted} converted" if converted else ""


def _div(a: float, b: float | None) -> str:
    return "-" if not b else f"{a / b:.2f}"


# --- measuring -----------------------------------------------------------------------------------


class _UsedMemorySampler:
    """The machine's used memory, sampled from a thread while workers start."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.before = procfs.machine_used_bytes()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ortmem-meminfo", daemon=True)

    def __enter__(self) -> "_UsedMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            used = procfs.machine_used_bytes()
            if used is not None and (self.peak is None or used > self.peak):
                self.peak = used


def measure_workers(
    strategy: str,
    model_path: str | os.PathLike,
    n: int,
    *,
    together: bool = True,
    prepared: Prepared | None = None,
    options: dict[str, Any] | None = None,
    timeout: float = 600.0,
) -> WorkersRun:
    """Start ``n`` fresh workers of ``strategy`` on the model, read them all once all are ready.

    Raises :class:`ProbeError` when a worker fails or times out (all workers are stopped first).
    """
    strat = get_strategy(strategy)
    model_path = os.path.abspath(os.fspath(model_path))
    spec = {"create": strat.create, "model": prepared.model_path if prepared else model_path,
            "options": options or {}, "sys_path": [p for p in sys.path if p]}
    arg = json.dumps(spec)
    run = WorkersRun(strategy=strat.name, n=n, together=together)
    procs: list[subprocess.Popen] = []
    ready: dict[int, dict[str, Any]] = {}
    flush_writes()  # the same starting state as a probe's (ortmem.measure.machine_state)
    with (tempfile.TemporaryDirectory(prefix="ortmem-workers-") as tmp, _UsedMemorySampler() as sampler,
          Leftovers() as leftovers):
        logs = [open(os.path.join(tmp, f"worker-{i}.log"), "w+b") for i in range(n)]
        sel = selectors.DefaultSelector()
        t0 = time.monotonic()
        deadline = t0 + timeout

        def start(i: int) -> None:
            p = subprocess.Popen([sys.executable, "-m", "ortmem.measure.worker_child", arg],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[i],
                                 env=helper_environment())  # never hooked: the strategy makes the session
            procs.append(p)
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ, len(procs) - 1)

        def wait_ready(count: int) -> None:
            while len(ready) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProbeError(f"{strat.name}: workers not ready after {timeout:.0f} s")
                for key, _ in sel.select(timeout=min(left, 1.0)):
                    i = key.data
                    line = key.fileobj.readline()  # type: ignore[union-attr]
                    sel.unregister(key.fileobj)
                    if not line:
                        procs[i].wait()
                        logs[i].seek(0)
                        tail = logs[i].read()[-4000:].decode("utf-8", "replace")
                        raise ProbeError(f"{strat.name}: worker {i} exited with code {procs[i].returncode}",
                                         stderr=tail, returncode=procs[i].returncode)
                    ready[i] = json.loads(line)

        try:
            if together:
                for i in range(n):
                    start(i)
                wait_ready(n)
            else:
                for i in range(n):
                    start(i)
                    wait_ready(i + 1)
            run.ready_wall_s = max(r["ready_monotonic"] for r in ready.values()) - t0
            for i, p in enumerate(procs):
                sm = procfs.read_smaps_rollup(p.pid) or {}
                r = ready[i]
                run.workers.append(WorkerReading(
                    pid=p.pid, create_wall_s=r["create_wall_s"], run_wall_s=r["run_wall_s"],
                    ready_s=r["ready_monotonic"] - t0, output_hash=r["output_hash"], pss=sm.get("Pss", 0),
                    pss_anon=sm.get("Pss_Anon", 0), pss_file=sm.get("Pss_File", 0),
                    pss_shmem=sm.get("Pss_Shmem", 0), rss=sm.get("Rss", 0),
                    converted=bool(r.get("converted")), peak_private=int(r.get("peak_private", 0)),
                    ortmem_action=r.get("ortmem_action"),
                ))
        finally:
            if len(ready) < len(procs):  # failed or timed out: stop the others now, not after creation
                for p in procs:
                    p.kill()
            for p in procs:
                if p.stdin:
                    p.stdin.close()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                if p.stdout:
                    p.stdout.close()
            sel.close()
            for f in logs:
                f.close()
            leftovers.wait(timeout)  # e.g. a cold start's background finisher: not into the next run
    run.used_before_bytes, run.peak_used_bytes = sampler.before, sampler.peak
    run.total_pss_bytes = sum(w.pss for w in run.workers)
    run.total_private_bytes = sum(w.private for w in run.workers)
    run.total_shared_bytes = sum(w.pss_file for w in run.workers)
    run.private_per_worker_bytes = max((w.private for w in run.workers), default=0)
    return run


def extrapolate(measured: WorkersRun, n: int) -> WorkersRun:
    """The totals ``n`` workers would have, from a measured run: private scales with the workers,
    shared (the file pages every worker maps) is held once."""
    per_worker = measured.total_private_bytes / measured.n
    private = int(per_worker * n)
    return WorkersRun(
        strategy=measured.strategy, n=n, together=measured.together, extrapolated=True,
        total_pss_bytes=private + measured.total_shared_bytes, total_private_bytes=private,
        total_shared_bytes=measured.total_shared_bytes, private_per_worker_bytes=measured.private_per_worker_bytes,
    )


def predicted_rise(measured: WorkersRun, n: int) -> int:
    """What starting ``n`` workers together would take from the machine, scaled from a measured run:
    the largest worker's own private peak (creation included) or the run's private total per worker,
    whichever is larger, times n. The workers' own numbers, not the machine's used memory, which
    other processes on a shared machine move."""
    peak = max((w.peak_private for w in measured.workers), default=0)
    per_worker = max(peak, measured.total_private_bytes / measured.n)
    return int(per_worker * n)


def run_workers(
    model: str | os.PathLike,
    strategies: Sequence[str] | None = None,
    counts: Sequence[int] = DEFAULT_SWEEP,
    *,
    together: bool = True,
    options: dict[str, Any] | None = None,
    timeout: float = 600.0,
    guard: bool = True,
    budget: int | None = None,
    say: Callable[[str], None] | None = None,
) -> WorkersReport:
    """Measure every strategy at every worker count (interleaved: per N, each strategy in turn).

    Each strategy's preparation runs once, unmeasured (``prepare_scope="each"`` ones, like the cold
    ``ortmem``, before every N: N workers then start on an empty cache). With ``guard`` a run the
    machine could not hold (or that would pass ``budget`` bytes) is extrapolated instead (module
    docstring). A failing run is recorded
    with its error and the sweep goes on.
    """
    names = list(dict.fromkeys(strategies or DEFAULT_STRATEGIES))
    counts = sorted(set(int(c) for c in counts))
    if not counts or counts[0] < 1:
        raise ValueError("worker counts must be positive")
    path = os.path.abspath(os.fspath(model))
    report = WorkersReport(path, counts, together)
    say = say or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="ortmem-workers-prep-") as workdir:
        prepared: dict[str, Prepared | None] = {}
        first: dict[str, WorkersRun] = {}
        for n in counts:
            for s in names:
                strat = get_strategy(s)
                if s in first and guard:
                    available = procfs.machine_available_bytes()
                    limits = [GUARD_FRACTION * available] if available is not None else []
                    limits += [budget] if budget else []
                    need = predicted_rise(first[s], n)
                    if limits and need > min(limits):
                        run = extrapolate(first[s], n)
                        report.runs.append(run)
                        say(f"workers {s} x{n}: extrapolated (would need ~{need / MiB:.0f} MiB, limit "
                            f"{min(limits) / MiB:.0f} MiB)")
                        continue
                try:
                    if strat.prepare is not None and (s not in prepared or strat.prepare_scope == "each"):
                        prepared[s] = prepare(strat, path, options=options, workdir=workdir, timeout=timeout)
                    os.sync()  # a conversion's dirty pages would slow whichever workers start next
                    run = measure_workers(s, path, n, together=together, prepared=prepared.get(s),
                                          options=options, timeout=timeout)
                except ProbeError as e:
                    report.runs.append(WorkersRun(strategy=strat.name, n=n, together=together, error=str(e)))
                    say(f"workers {s} x{n}: FAILED {str(e).splitlines()[0]}")
                    continue
                report.runs.append(run)
                first.setdefault(s, run)
                say(f"workers {s} x{n}: total PSS {run.total_pss_bytes / MiB:.0f} MiB (private "
                    f"{run.total_private_bytes / MiB:.0f}, shared {run.total_shared_bytes / MiB:.0f}), "
                    f"ready in {run.ready_wall_s:.2f} s")
    return report
