"""Measure one way of creating a session in a fresh Python process.

Why a fresh process per measurement: glibc keeps freed memory in its arenas and raises its mmap
threshold after large frees, ORT caches allocators and thread pools, and the OS page cache and
already-faulted library pages all carry over. A second session in the same process measures the
first one's leftovers. See docs/measurement.md.

What is counted (all bytes):

* ``peak_create_bytes``: the child's own ``VmHWM`` over session creation (kernel-exact; reset after
  imports, so it starts at the baseline RSS) **plus** the helper processes' peak (below).
* ``peak_run_bytes``: the same over the first ``run`` (``VmHWM`` reset again after creation).
* Helper processes (anything the strategy spawns): the parent samples ``/proc/<pid>/status`` of the
  child's whole process tree every ``sample_interval`` s. Where helpers were seen alive during
  creation, ``peak_create_bytes`` is the larger of the child's own ``VmHWM`` and the tree's largest
  sampled RSS (what ran at once; a sample is a lower bound of the instant it was taken), and
  ``helper_peak_create_bytes`` is the helpers' own ``VmHWM`` as last seen, summed. Where none was
  seen (each lived less than an interval), ``RUSAGE_CHILDREN``'s ``ru_maxrss`` is added to the
  child's ``VmHWM`` whole, an upper bound. A forked helper's RSS also counts pages it still shares
  with its parent (``helper_pids`` tells you when this applies).
* ``peak_anon_bytes`` / ``peak_file_bytes`` / ``timeline``: sampled sums over the tree, ``anon`` =
  ``RssAnon + RssShmem`` (heap: not reclaimable), ``file`` = ``RssFile`` (mapped files: reclaimable).
  The bench calls the first *private* (what each process costs alone, what the OOM killer sees) and
  the second *shared* (page cache: counted once per machine however many processes map it).
  Sampled values are lower bounds of the true peak (a spike shorter than the interval is missed);
  ``VmHWM`` is the authoritative peak.

The child resets ``VmHWM`` twice (after imports, after creation), which also lowers the kernel's
lifetime ``ru_maxrss``: an outside ``/usr/bin/time -v`` then misses a creation peak that exceeded
the first run's peak. ``peak_bytes`` (the max of both phases) is the lifetime peak after imports.
Checked against ``/usr/bin/time -v`` on the same child with ``options={"run": False}`` (one reset),
embedded and external (docs/measurement.md).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Sequence

from ortmem.base.child_env import helper_environment
from ortmem.base import procfs
from ortmem.measure.failures import ProbeError, ProbeUnsupported
from ortmem.measure.machine_state import Leftovers, flush_writes
from ortmem.measure.strategies import Strategy, get_strategy
from ortmem.base.units import MiB


@dataclass
class Prepared:
    """Result of a strategy's unmeasured preparation step."""

    model_path: str
    wall_s: float


@dataclass
class ProbeResult:
    """One measured session creation + first run. Bytes and seconds; see the module docstring."""

    strategy: str
    model: str
    prepared_model: str | None
    options: dict[str, Any]
    pid: int
    hwm_reset: bool
    memray_enabled: bool  # RSS numbers of a memray run include memray's own overhead
    baseline_rss_bytes: int
    baseline_anon_bytes: int
    baseline_file_bytes: int
    create_wall_s: float
    create_cpu_s: float
    peak_create_bytes: int
    main_peak_create_bytes: int
    helper_peak_create_bytes: int
    rss_after_create_bytes: int
    anon_after_create_bytes: int
    file_after_create_bytes: int
    run_wall_s: float | None = None
    run_cpu_s: float | None = None
    peak_run_bytes: int | None = None
    helper_peak_run_bytes: int | None = None
    rss_after_run_bytes: int | None = None
    anon_after_run_bytes: int | None = None  # RssAnon (+RssShmem) after the first run, this process only
    file_after_run_bytes: int | None = None  # RssFile after the first run, this process only
    peak_bytes: int = 0
    peak_anon_bytes: int = 0
    peak_file_bytes: int = 0
    peak_tree_sampled_bytes: int = 0
    helper_pids: list[int] = field(default_factory=list)
    sample_interval_s: float = 0.01
    n_samples: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t s, anon B, file B)
    events: dict[str, float] = field(default_factory=dict)  # seconds relative to create_start
    output_hash: str | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    memray: dict[str, Any] | None = None
    prepare_wall_s: float | None = None
    #: A background process the strategy left running after the first run (a cold start's packing of
    #: ORT's weights, ``ortmem.store.finisher``): seconds from the end of the run until it finished,
    #: and its peak RSS sampled after the run (not part of any peak above: it ran after the measured
    #: phases; ``RUSAGE_CHILDREN`` cannot tell it, since a spawned child's high-water mark includes
    #: the parent's pages it shared until ``exec``).
    background_wall_s: float | None = None
    background_peak_bytes: int | None = None
    started_unix: float | None = None  # wall-clock start of the child, to check run order
    #: The bench's round this probe ran in (``stats.schedule``), pairing it with the reference's probe
    #: of the same round (``stats.RatioStat``); None outside a bench and in reports that lack it.
    round: int | None = None
    heap_jitter_bytes: int = 0  # heap padding before imports (see probe())
    #: Modules first imported during creation, by package (``onnx``, ``ortmem.session.inference``, ...): the lazy
    #: imports a user's first call pays, measured inside ``create_wall_s`` and the creation peak.
    create_imports: list[str] = field(default_factory=list)
    #: ``session.ortmem_action`` of an ortmem session (what it gave ORT: "finished", "cache-hit",
    #: "as-is", ...); None for other sessions.
    ortmem_action: str | None = None
    #: Processes the child's tree left running after it exited (re-parented to the bench, see
    #: :mod:`ortmem.measure.machine_state`), how long the probe waited for them, and any it had to kill.
    leftover_pids: list[int] = field(default_factory=list)
    leftover_wait_s: float | None = None

    @property
    def peak_above_baseline_bytes(self) -> int:
        """What the session cost at its worst, over what the interpreter and imports already held."""
        return self.peak_bytes - self.baseline_rss_bytes

    @property
    def steady_bytes(self) -> int:
        """Resident memory once the session has run once (after creation if there was no run)."""
        return self.rss_after_run_bytes if self.rss_after_run_bytes is not None else self.rss_after_create_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["timeline"] = [list(p) for p in self.timeline]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProbeResult":
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["timeline"] = [tuple(p) for p in d.get("timeline", [])]
        return cls(**kwargs)


def _check_supported() -> None:
    reason = procfs.unsupported_reason()
    if reason:
        raise ProbeUnsupported(reason)


def _run_child(spec: dict[str, Any], workdir: str, timeout: float, sample_interval: float | None):
    """Start the child, optionally sample its tree, wait for it and for every process it left behind
    (:class:`~ortmem.measure.machine_state.Leftovers`); return (result dict, samples)."""
    result_path = os.path.join(workdir, f"result-{os.getpid()}-{id(spec)}.json")
    log_path = result_path[:-5] + ".log"
    spec = {**spec, "result_path": result_path, "sys_path": [p for p in sys.path if p]}
    with open(log_path, "w+b") as log, Leftovers() as leftovers:
        t_spawn = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "ortmem.measure.probe_child"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a timeout can kill the helpers too
            env=helper_environment(),  # never hooked: the strategy alone decides how the session is made
        )
        sampler = procfs.TreeSampler(proc.pid, sample_interval).start() if sample_interval else None
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        finally:
            samples = sampler.stop() if sampler else []
        left = leftovers.wait(timeout if rc is not None else 0.0)
        log.seek(0)
        tail = log.read()[-8000:].decode("utf-8", "replace")
    try:
        if rc is None:
            raise ProbeError(f"child timed out after {timeout:.0f} s", stderr=tail)
        if rc != 0 or not os.path.exists(result_path):
            raise ProbeError(f"child failed with exit code {rc}", stderr=tail, returncode=rc)
        with open(result_path) as f:
            res = json.load(f)
        if "events" in res:
            res["events"]["spawned"] = t_spawn
        res["leftover_pids"], res["leftover_wait_s"] = left.pids, left.wait_s
        res["leftover_killed"] = left.killed
        return res, samples
    finally:
        for p in (result_path, log_path):
            if os.path.exists(p):
                os.unlink(p)


def prepare(
    strategy: str | Strategy,
    model_path: str | os.PathLike,
    *,
    options: dict[str, Any] | None = None,
    workdir: str | os.PathLike,
    timeout: float = 3600.0,
) -> Prepared:
    """Run a strategy's preparation step in its own process (unmeasured).

    Without a preparation step the model is used as is. ``workdir`` must outlive the probes that
    use the prepared model, so the caller owns it.
    """
    strat = get_strategy(strategy)
    model_path = os.path.abspath(os.fspath(model_path))
    if strat.prepare is None:
        return Prepared(model_path, 0.0)
    spec = {
        "mode": "prepare",
        "prepare": strat.prepare,
        "model": model_path,
        "options": options or {},
        "workdir": os.fspath(workdir),
    }
    res, _ = _run_child(spec, os.fspath(workdir), timeout, None)
    return Prepared(os.path.abspath(res["prepared_model"]), float(res["wall_s"]))


def prepare_once(
    models: Sequence[str | os.PathLike],
    strategies: Sequence[str],
    *,
    options: dict[str, Any] | None,
    workdir: str | os.PathLike,
    timeout: float,
    say: Callable[[str], None] | None = None,
) -> dict[tuple[str, str], Prepared | ProbeError]:
    """Every "once" preparation of ``strategies`` on ``models``, each in a folder of its own under
    ``workdir`` (which the caller keeps until the last probe), keyed by (absolute model path,
    strategy); a preparation that failed is its :class:`ProbeError`, for the caller to record. The one
    way the bench, the whole-process mode and ``--cross-check`` (once for every round of both methods)
    prepare; strategies without a "once" step are left out."""
    out: dict[tuple[str, str], Prepared | ProbeError] = {}
    for model in models:
        path = os.path.abspath(os.fspath(model))
        for name in dict.fromkeys(strategies):
            strat = get_strategy(name)
            if strat.prepare is None or strat.prepare_scope != "once":
                continue
            try:
                sub = tempfile.mkdtemp(prefix=f"prep-{len(out)}-", dir=workdir)
                out[(path, name)] = ready = prepare(strat, path, options=options, workdir=sub, timeout=timeout)
                line = f"prepared {os.path.basename(path)} for {name} in {ready.wall_s:.1f} s"
            except ProbeError as e:
                out[(path, name)] = e
                line = f"prepare {os.path.basename(path)} for {name}: FAILED {str(e).splitlines()[0] if str(e) else ''}"
            if say:
                say(line)
    return out


def probe(
    strategy: str | Strategy,
    model_path: str | os.PathLike,
    *,
    options: dict[str, Any] | None = None,
    memray: bool = False,
    sample_interval: float = 0.01,
    timeout: float = 600.0,
    prepared: Prepared | None = None,
    workdir: str | os.PathLike | None = None,
    heap_jitter: int = 0,
) -> ProbeResult:
    """Create one session with ``strategy`` in a fresh process, run it once, and measure it.

    ``options`` (JSON-serialisable) go to the strategy and to input generation (``dims``,
    ``int_high``; ``run=False`` skips the first run). ``prepared`` reuses an earlier
    :func:`prepare`; otherwise the strategy's preparation step (if any) runs first, unmeasured.
    ``memray=True`` runs creation under ``memray.Tracker(native_traces=True)`` and fills
    ``result.memray``; its RSS numbers then include memray's own overhead (``memray_enabled``).

    ``heap_jitter`` bytes are allocated (and kept) in the child before its imports. Why: ORT's
    peak under glibc depends on the heap layout it starts from; on a 65 MiB model, padding the
    child's heap by 0-64 KiB moves the peak between +84 and +132 MiB above baseline, in steps of one
    weight tensor, while identical processes repeat the same number. Repeats at one layout therefore
    understate the spread a user will see; :func:`~ortmem.measure.bench.run_bench` gives each round
    a different jitter (the same for every strategy within a round).

    Raises :class:`ProbeUnsupported` off Linux and :class:`ProbeError` when the child fails.
    """
    _check_supported()
    strat = get_strategy(strategy)
    options = dict(options or {})
    model_path = os.path.abspath(os.fspath(model_path))
    with tempfile.TemporaryDirectory(prefix="ortmem-probe-", dir=workdir) as tmp:
        started = time.time()
        if prepared is None:
            prepared = prepare(strat, model_path, options=options, workdir=tmp, timeout=timeout)
        spec: dict[str, Any] = {
            "mode": "probe",
            "create": strat.create,
            "model": prepared.model_path,
            "options": options,
            "run": bool(options.get("run", True)),
            "heap_jitter": int(heap_jitter),
        }
        if memray:
            spec["memray_path"] = os.path.join(tmp, "creation.memray")
        flush_writes()  # after the preparation, which may have written a whole cache entry
        raw, samples = _run_child(spec, tmp, timeout, sample_interval)
    res = _assemble(strat, model_path, prepared, options, memray, sample_interval, raw, samples)
    res.started_unix = started
    res.heap_jitter_bytes = int(heap_jitter)
    return res


def _assemble(
    strat: Strategy,
    model_path: str,
    prepared: Prepared,
    options: dict[str, Any],
    memray: bool,
    interval: float,
    raw: dict[str, Any],
    samples: list[procfs.TreeSample],
) -> ProbeResult:
    """Combine the child's own numbers with the parent's samples of its process tree."""
    ev = raw["events"]
    t0 = ev["create_start"]
    t_create_end = ev["create_end"]
    t_end = ev.get("run_end", t_create_end)
    main = raw["pid"]
    slack = 2 * interval  # a sample taken just after an event still belongs to that phase
    # A cold start's background finisher (ortmem.store.finisher) is spawned as the first run returns:
    # until its exec, /proc shows the measured process's own memory under its pid (a 1.6 GB model's
    # run peak once read 1.96x), and afterwards it is reported apart (background_peak_bytes).
    background = set(raw.get("background_pids") or ())
    all_samples = samples
    if background:
        samples = [procfs.TreeSample(s.t, {pid: p for pid, p in s.procs.items() if pid not in background})
                   for s in samples]

    def helper_peak(lo: float, hi: float) -> int:
        last_hwm: dict[int, int] = {}
        for s in samples:
            if lo <= s.t <= hi + slack:
                for pid, p in s.procs.items():
                    if pid != main:
                        last_hwm[pid] = max(last_hwm.get(pid, 0), p.hwm)
        return sum(last_hwm.values())

    def background_peak() -> int:
        """The finishers' own high-water marks: each one's last reading (exec starts a new memory map
        with its own mark, so the last reading is the finisher's, not its parent's)."""
        last: dict[int, int] = {}
        for s in all_samples:
            for pid in background & s.procs.keys():
                last[pid] = s.procs[pid].hwm
        return sum(last.values())

    def helpers_after(t: float) -> tuple[int, int]:
        """Helpers' (anon, file) in the first sample at or after ``t``."""
        for s in samples:
            if s.t >= t:
                helpers = [p for pid, p in s.procs.items() if pid != main]
                return sum(p.anon for p in helpers), sum(p.file for p in helpers)
        return 0, 0

    # Sampled points up to the last event (after it the child hashes, writes and tears down),
    # plus the child's own exact readings at create_end / run_end.
    timeline = [
        (s.t - t0, sum(p.anon for p in s.procs.values()), sum(p.file for p in s.procs.values()))
        for s in samples
        if s.t <= t_end
    ]
    for t_ev, own in ((t_create_end, raw["after_create"]), (ev.get("run_end"), raw.get("after_run"))):
        if t_ev is not None and own is not None:
            ha, hf = helpers_after(t_ev)
            timeline.append((t_ev - t0, own["anon"] + ha, own["file"] + hf))
    timeline = sorted((round(t, 4), a, f) for t, a, f in timeline)

    ac = raw["after_create"]
    sampled_helpers = helper_peak(t0, t_create_end)
    if sampled_helpers:
        # Helpers seen alive: what ran at once is in the tree's samples. A cold start's conversion
        # helper (ortmem.session.cold_start_child) exits before ORT creates the session: adding its
        # peak to the session's counted 315 MiB that never coexisted with the session's 1101.
        helper_create = sampled_helpers
        tree_create = max((sum(q.anon + q.file for q in s.procs.values()) for s in samples
                           if t0 <= s.t <= t_create_end + slack), default=0)
        peak_create = max(ac["hwm"], tree_create)
    else:  # none sampled (each lived less than an interval): counted whole, an upper bound
        helper_create = ac.get("children_maxrss", 0)
        peak_create = ac["hwm"] + helper_create

    window = [p for p in timeline if p[0] >= 0]
    tree_anon = [a for _, a, _ in window]
    tree_file = [f for _, _, f in window]
    helper_pids = sorted({pid for s in samples for pid in s.procs if pid != main})

    res = ProbeResult(
        strategy=strat.name,
        model=model_path,
        prepared_model=prepared.model_path if prepared.model_path != model_path else None,
        options=options,
        pid=main,
        hwm_reset=bool(raw["hwm_reset"]),
        memray_enabled=memray,
        baseline_rss_bytes=raw["baseline"]["rss"],
        baseline_anon_bytes=raw["baseline"]["anon"],
        baseline_file_bytes=raw["baseline"]["file"],
        create_wall_s=raw["create_wall_s"],
        create_cpu_s=raw["create_cpu_s"],
        peak_create_bytes=peak_create,
        main_peak_create_bytes=ac["hwm"],
        helper_peak_create_bytes=helper_create,
        rss_after_create_bytes=ac["rss"] + sum(helpers_after(t_create_end)),
        anon_after_create_bytes=ac["anon"],
        file_after_create_bytes=ac["file"],
        peak_bytes=peak_create,
        peak_anon_bytes=max(tree_anon, default=0),
        peak_file_bytes=max(tree_file, default=0),
        peak_tree_sampled_bytes=max((a + f for a, f in zip(tree_anon, tree_file)), default=0),
        helper_pids=helper_pids,
        sample_interval_s=interval,
        n_samples=len(samples),
        timeline=timeline,
        events={k: round(v - t0, 4) for k, v in ev.items()},
        output_hash=raw.get("output_hash"),
        outputs=raw.get("outputs", []),
        memray=raw.get("memray"),
        prepare_wall_s=prepared.wall_s if prepared.wall_s else None,
        background_wall_s=raw.get("background_wall_s"),
        background_peak_bytes=background_peak() if background else None,
        create_imports=list(raw.get("create_imports", [])),
        ortmem_action=raw.get("ortmem_action"),
        leftover_pids=list(raw.get("leftover_pids", [])),
        leftover_wait_s=raw.get("leftover_wait_s"),
    )
    ar = raw.get("after_run")
    if ar is not None:
        grew = ar.get("children_maxrss", 0) > ac.get("children_maxrss", 0)
        helper_run = max(helper_peak(t_create_end, t_end), ar["children_maxrss"] if grew else 0)
        res.run_wall_s = raw["run_wall_s"]
        res.run_cpu_s = raw["run_cpu_s"]
        res.helper_peak_run_bytes = helper_run
        res.peak_run_bytes = ar["hwm"] + helper_run
        res.rss_after_run_bytes = ar["rss"] + sum(helpers_after(t_end))
        res.anon_after_run_bytes = ar["anon"]
        res.file_after_run_bytes = ar["file"]
        res.peak_bytes = max(peak_create, res.peak_run_bytes)
    return res
