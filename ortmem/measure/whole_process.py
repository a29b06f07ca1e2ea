"""``ortmem bench --whole-process``: each strategy as a whole ``python -c "..."`` process, timed from outside.

Why: a probe (:mod:`ortmem.measure.probe`) times creation inside a process that has already imported
numpy and onnxruntime, which is what makes its memory phases exact; a user's process pays everything,
interpreter start, imports and teardown included. This mode measures what ``/usr/bin/time`` would:
for every strategy, ``python -c CODE`` (``CODE`` creates the session the strategy's way, as a user
writes it: :func:`ortmem.measure.strategies.whole_process_code`), its wall time from spawn to reap,
its CPU (user + sys) and its peak RSS from ``os.wait4``'s rusage (``ru_maxrss``, the number
``/usr/bin/time`` prints; for a process that waited for children it is the largest of them, as there).
Nothing runs inside the measured process but the strategy's code.

Private and shared apart: ``ru_maxrss`` is one number, anonymous and file-backed pages together, and
ortmem's claims are about the two apart (a warm start's weights are shared page cache, ORT's are
private heap). The launcher therefore also samples the measured process's ``/proc/PID/status`` every
:data:`SAMPLE_S` seconds while it waits for it and keeps the largest private (``RssAnon + RssShmem``)
and the largest shared (``RssFile``) resident memory, as the probes define them
(:mod:`ortmem.measure.report`). Reading ``status`` walks no page table and takes no lock the
process's page faults wait on (unlike ``smaps_rollup``), so the wall time is not disturbed. The two
peaks are sampled (a spike shorter than the period can be missed) and are the measured process's
own: a conversion helper it starts is in ``peak`` (the largest of the tree), not in them.

Why through a small launcher (:data:`LAUNCHER`, ``python -I -S``, a few MiB) and not spawned from the
bench itself: at ``exec`` Linux folds the high-water mark of the memory the new program replaces into
the process's ``ru_maxrss`` (``exec_mmap``: ``setmax_mm_hiwater_rss``), and that memory is a copy of the
spawning process's (``fork``) or the spawner's own (``vfork``/``posix_spawn``): spawned straight from
a large parent, ``python -c "import onnxruntime"`` reports the parent's size; from the launcher, what
``/usr/bin/time`` (itself a tiny process) reports. The launcher times spawn to reap with
``perf_counter`` and writes wall, user, sys, ``ru_maxrss`` and the exit code to a file.

Every run starts from the same state (:mod:`ortmem.measure.machine_state`): a strategy's preparation step
first (once, or before every run for ``prepare_scope="each"``), then ``os.sync()``, then the process;
any process its tree leaves behind is waited for before the next one starts. Plain ORT (``ort``) is
always measured in the same run, as the reference of every ratio, and so is a bare
``python -c "import onnxruntime"`` (``import-onnxruntime``): wall minus that wall estimates the init
(``init~``), the number to hold against the bench's own ``init`` column. The order is the bench's
(:func:`ortmem.measure.stats.schedule`: rounds, each rotated by one), so pairs alternate
``ort, ortmem | ortmem, ort | ...`` rather than strictly ``ort, ortmem, ort, ortmem``: strict
alternation would put each strategy on the same parity of consecutive processes, where ORT's
two-mode init can alternate.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ortmem.base.child_env import helper_environment
from ortmem.measure.failures import ProbeError
from ortmem.base.units import MiB
from ortmem.measure.probe import Prepared, prepare, prepare_once
from ortmem.measure.machine_state import Leftovers, flush_writes
from ortmem.measure.stats import RatioStat, Stat, metric_modes, modes_text, schedule
from ortmem.measure.strategies import Strategy, get_strategy, whole_process_code
from ortmem.measure.text_table import align

#: The reference every ratio is taken against.
REFERENCE = "ort"
#: The second reference, where the run has it: ORT on the model converted ahead of time, the floor
#: that ortmem's second and warm starts are held to.
TWIN = "twin"
#: The pseudo-strategy timing ``python -c "import onnxruntime"``: the fixed part of every ORT process.
BARE = "import-onnxruntime"
BARE_CODE = "import onnxruntime"
#: Metrics of one process, each summarised by fastest and median.
METRICS = ("wall_s", "cpu_s", "peak_bytes", "private_peak_bytes", "shared_peak_bytes")
#: Times, whose median ratio is the median of the rounds' own ratios (``stats.RatioStat``: why).
PAIRED_METRICS = ("wall_s", "cpu_s", "init_s")
#: Seconds between two samples of the measured process's private and shared resident memory.
SAMPLE_S = 0.005


@dataclass
class ProcessRun:
    """One whole process: seconds and bytes as ``os.wait4`` reports them."""

    strategy: str
    round: int
    wall_s: float
    user_s: float
    sys_s: float
    peak_bytes: int
    returncode: int
    started_unix: float
    leftover_pids: list[int] = field(default_factory=list)
    leftover_wait_s: float = 0.0
    prepare_wall_s: float | None = None
    #: Largest private (``RssAnon + RssShmem``) and shared (``RssFile``) resident memory of the measured
    #: process, sampled (None in reports written before they were measured).
    private_peak_bytes: int | None = None
    shared_peak_bytes: int | None = None

    @property
    def cpu_s(self) -> float:
        """User plus system CPU, as ``/usr/bin/time``'s two lines added."""
        return self.user_s + self.sys_s


@dataclass
class WholeProcessReport:
    """Every whole-process run on one model, per strategy, with the code each one ran."""

    model: str
    repeat: int
    order: list[tuple[str, int]] = field(default_factory=list)
    codes: dict[str, str] = field(default_factory=dict)
    runs: dict[str, list[ProcessRun]] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)

    def stat(self, strategy: str, metric: str) -> Stat | None:
        return Stat.of(getattr(r, metric) for r in self.runs.get(strategy, []))

    def by_round(self, strategy: str, metric: str) -> dict[int, float]:
        """``metric`` of each of ``strategy``'s runs, keyed by round (the pairs of :class:`RatioStat`)."""
        return {r.round: float(getattr(r, metric)) for r in self.runs.get(strategy, [])
                if getattr(r, metric) is not None}

    def init_by_round(self, strategy: str) -> dict[int, float]:
        """Each round's init estimate: the wall minus the bare ``import onnxruntime`` wall of the same
        round (its median where that round's failed): what creating the session added to a process
        that imports onnxruntime anyway."""
        walls, bare = self.by_round(strategy, "wall_s"), self.by_round(BARE, "wall_s")
        if strategy == BARE or not walls or not bare:
            return {}
        typical = statistics.median(bare.values())
        return {r: wall - bare.get(r, typical) for r, wall in walls.items()}

    def init_estimate(self, strategy: str) -> Stat | None:
        """Fastest and median of :meth:`init_by_round` (``init~``)."""
        return Stat.of(self.init_by_round(strategy).values())

    def ratios(self, strategy: str, reference: str = REFERENCE) -> dict[str, dict[str, float]]:
        """``{metric: {"fastest": x, "median": x}}`` against ``reference`` (:data:`REFERENCE` unless
        told) in this same run; ``init_s`` is the ratio of the init estimates. Times
        (:data:`PAIRED_METRICS`) are :class:`RatioStat`s, the median being the rounds' own ratios';
        memory is median over median."""
        out: dict[str, dict[str, float]] = {}
        for metric in METRICS + ("init_s",):
            if metric in PAIRED_METRICS:
                pick = self.init_by_round if metric == "init_s" else (lambda s, m=metric: self.by_round(s, m))
                ratio = RatioStat.of(pick(strategy), pick(reference))
                if ratio is not None:
                    out[metric] = {"fastest": ratio.fastest, "median": ratio.median}
                continue
            a, b = self.stat(strategy, metric), self.stat(reference, metric)
            if a is not None and b is not None and b.fastest > 0 and b.median > 0:
                out[metric] = {"fastest": a.fastest / b.fastest, "median": a.median / b.median}
        return out

    def modes(self, strategy: str) -> tuple[list[float], list[float]] | None:
        return metric_modes((r.wall_s for r in self.runs.get(strategy, [])), "wall_s")

    def extend(self, later: "WholeProcessReport") -> None:
        """Add the runs of ``later``, further rounds on the same model."""
        self.repeat += later.repeat
        self.order.extend(later.order)
        for name, runs in later.runs.items():
            self.runs.setdefault(name, []).extend(runs)
        for name, errors in later.errors.items():
            self.errors.setdefault(name, []).extend(errors)
        for name, code in later.codes.items():
            self.codes.setdefault(name, code)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "repeat": self.repeat,
            "order": [list(o) for o in self.order],
            "codes": dict(self.codes),
            "runs": {s: [asdict(r) for r in runs] for s, runs in self.runs.items()},
            "errors": {s: list(e) for s, e in self.errors.items()},
            "ratios": {s: self.ratios(s) for s in self.runs},  # derived: from_dict recomputes
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WholeProcessReport":
        return cls(
            model=d["model"],
            repeat=int(d["repeat"]),
            order=[tuple(o) for o in d.get("order", [])],
            codes=dict(d.get("codes", {})),
            runs={s: [ProcessRun(**r) for r in runs] for s, runs in d.get("runs", {}).items()},
            errors={s: list(e) for s, e in d.get("errors", {}).items()},
        )

    def render_table(self) -> str:
        """Fastest and median of wall, CPU and peak per strategy, the init estimate, ratios to ORT."""
        header = ["strategy", "wall s", "wall med", "cpu s", "cpu med", "peak MiB", "peak med", "private med",
                  "shared med", "init~ s", "init~ med", f"wall/{REFERENCE}", f"init~/{REFERENCE}", f"cpu/{REFERENCE}",
                  f"peak/{REFERENCE}", f"private/{REFERENCE}"] + ([f"init~/{TWIN}", f"peak/{TWIN}"] if TWIN in self.runs
                                                                  else []) + ["flags"]
        rows = [header]
        for name in self.runs:
            rows.append(self._row(name))
        lines = [f"whole processes: {os.path.basename(self.model)}  ({self.model}), {self.repeat} round(s), "
                 f"order rotated per round, sync before each; fastest, then median ('med')"]
        lines += align(rows)
        lines.append("wall/CPU/peak: os.wait4 of `python -c CODE` (what /usr/bin/time reports); private/shared: "
                     f"the measured process's largest RssAnon+RssShmem / RssFile, sampled every {SAMPLE_S * 1000:.0f} "
                     f"ms (MiB; not its helpers'); init~: wall minus the wall of `python -c \"{BARE_CODE}\"` "
                     f"({BARE}) of the same round; ratios to {REFERENCE} (and {TWIN}) in this run, fastest over fastest / times: median "
                     "of the rounds' own ratios (pairs), memory: median over median.")
        return "\n".join(lines)

    def _row(self, name: str) -> list[str]:
        wall, cpu, peak, private, shared = (self.stat(name, m) for m in METRICS)
        init = self.init_estimate(name)
        ratios = self.ratios(name)
        flags = []
        if (modes := self.modes(name)) is not None:
            flags.append(f"bimodal wall {modes_text(modes, 1.0, ' s')}")
        if self.errors.get(name):
            flags.append(f"{len(self.errors[name])} failed")
        waited = [r.leftover_wait_s for r in self.runs.get(name, []) if r.leftover_pids]
        if waited:
            flags.append(f"left processes, waited {max(waited):.1f} s")

        def pair(metric: str, against: dict[str, dict[str, float]] = ratios) -> str:
            r = against.get(metric)
            return "-" if r is None else f"{r['fastest']:.2f}/{r['median']:.2f}"

        to_twin = self.ratios(name, TWIN) if TWIN in self.runs else None
        twin = [pair("init_s", to_twin), pair("peak_bytes", to_twin)] if to_twin is not None else []
        return [
            name,
            _s(wall, "fastest"), _s(wall, "median"), _s(cpu, "fastest"), _s(cpu, "median"),
            _mib(peak, "fastest"), _mib(peak, "median"), _mib(private, "median"), _mib(shared, "median"),
            _s(init, "fastest"), _s(init, "median"), pair("wall_s"), pair("init_s"), pair("cpu_s"),
            pair("peak_bytes"), pair("private_peak_bytes"), *twin, ", ".join(flags),
        ]


def _s(st: Stat | None, which: str) -> str:
    return "-" if st is None else f"{getattr(st, which):.3f}"


def _mib(st: Stat | None, which: str) -> str:
    return "-" if st is None else f"{getattr(st, which) / MiB:.0f}"


#: ``python -I -S -c LAUNCHER RESULT_FILE PERIOD ARGV...``: spawn ARGV from this small process, sample
#: its private and shared resident memory every PERIOD seconds from a thread (through a descriptor of
#: its /proc folder, which cannot reach a later process that reuses the pid), reap it with ``wait4``,
#: and write "wall user sys maxrss_kib exit_code private_kib shared_kib" to RESULT_FILE (module
#: docstring: why).
LAUNCHER = """import os, sys, threading, time
out, period, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
peaks = [0, 0]
done = threading.Event()

def sample(proc):
    try:
        while not done.is_set():
            fd = os.open("status", os.O_RDONLY, dir_fd=proc)
            try:
                text = os.read(fd, 65536)
            finally:
                os.close(fd)
            kib = {k: int(v.split()[0]) for k, _, v in (l.partition(b":") for l in text.splitlines())
                   if k in (b"RssAnon", b"RssFile", b"RssShmem")}
            if kib:
                peaks[0] = max(peaks[0], kib.get(b"RssAnon", 0) + kib.get(b"RssShmem", 0))
                peaks[1] = max(peaks[1], kib.get(b"RssFile", 0))
            done.wait(period)
    except OSError:
        pass
    finally:
        os.close(proc)

t0 = time.perf_counter()
pid = os.posix_spawn(argv[0], argv, os.environ)
try:
    sampler = threading.Thread(target=sample, args=(os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY),))
    sampler.start()
except OSError:
    sampler = None
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
done.set()
if sampler is not None:
    sampler.join()
with open(out, "w") as f:
    f.write(f"{wall!r} {ru.ru_utime!r} {ru.ru_stime!r} {ru.ru_maxrss} {os.waitstatus_to_exitcode(status)} "
            f"{peaks[0]} {peaks[1]}")
"""


def time_process(code: str, *, timeout: float, log_path: str) -> tuple[ProcessRun, str]:
    """Run ``python -c code`` once (after ``os.sync()``) through :data:`LAUNCHER`, and wait for whatever
    it leaves running; returns the run (strategy and round left blank) and the tail of its output."""
    flush_writes()
    result_path = log_path + ".rusage"
    with open(log_path, "w+b") as log, Leftovers() as leftovers:
        started = time.time()
        launcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, result_path, str(SAMPLE_S),
                                     sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=helper_environment(), start_new_session=True)
        try:
            launcher.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)  # the measured process is in the launcher's group
            launcher.wait()
        left = leftovers.wait(timeout if launcher.returncode == 0 else 0.0)
        log.seek(0)
        tail = log.read()[-4000:].decode("utf-8", "replace")
    try:
        with open(result_path) as f:
            wall, user, sys_s, maxrss, rc, private_kib, shared_kib = f.read().split()
        os.unlink(result_path)
    except (OSError, ValueError):
        raise ProbeError(f"whole process timed out after {timeout:.0f} s or its launcher failed "
                         f"(exit code {launcher.returncode})", stderr=tail, returncode=launcher.returncode)
    run = ProcessRun(strategy="", round=-1, wall_s=float(wall), user_s=float(user), sys_s=float(sys_s),
                     peak_bytes=int(maxrss) * 1024, returncode=int(rc), started_unix=started,
                     leftover_pids=left.pids, leftover_wait_s=left.wait_s,
                     private_peak_bytes=int(private_kib) * 1024 or None, shared_peak_bytes=int(shared_kib) * 1024 or None)
    return run, tail


def run_whole_process(
    model: str | os.PathLike,
    strategies: Sequence[str] | None = None,
    repeat: int = 5,
    *,
    options: dict[str, Any] | None = None,
    timeout: float = 600.0,
    say: Callable[[str], None] | None = None,
    first_round: int = 0,
    prepared: Mapping[tuple[str, str], Prepared | ProbeError] | None = None,
) -> WholeProcessReport:
    """Time each strategy (plus ``ort`` and the bare import) as whole processes, ``repeat`` rounds
    numbered from ``first_round`` (see :func:`ortmem.measure.stats.schedule`); ``prepared`` as for
    :func:`ortmem.measure.bench.run_bench`."""
    options = dict(options or {})
    path = os.path.abspath(os.fspath(model))
    names = list(dict.fromkeys([REFERENCE, *(strategies or ["ortmem"]), BARE]))
    report = WholeProcessReport(path, repeat, order=[(s, r) for _, s, r in schedule([path], names, repeat, first_round)])
    report.runs = {s: [] for s in names}
    with tempfile.TemporaryDirectory(prefix="ortmem-whole-") as workdir:
        ready = {s: got for (m, s), got in (prepared or {}).items() if m == path and s in names}
        made = prepare_once([path], [s for s in names if s != BARE and s not in ready], options=options,
                            workdir=workdir, timeout=timeout)
        ready.update({s: got for (_, s), got in made.items()})
        for s in names:
            got = ready.get(s)
            if isinstance(got, ProbeError):
                report.errors.setdefault(s, []).append(f"prepare: {got}")
            elif s == BARE:
                report.codes[s] = BARE_CODE
            else:
                report.codes[s] = whole_process_code(get_strategy(s), got.model_path if got else path, options)
        for i, (s, r) in enumerate(report.order, 1):
            if s not in report.codes:
                continue
            try:
                run = _one(s, get_strategy(s) if s != BARE else None, path, options, report.codes[s], workdir, timeout)
            except ProbeError as e:
                report.errors.setdefault(s, []).append(str(e))
                if say:
                    say(f"[{i}/{len(report.order)}] whole process {s} #{r + 1}: FAILED {str(e).splitlines()[0]}")
                continue
            run.strategy, run.round = s, r
            report.runs[s].append(run)
            if say:
                say(f"[{i}/{len(report.order)}] whole process {s} #{r + 1}: wall {run.wall_s:.3f} s, cpu "
                    f"{run.cpu_s:.3f} s, peak {run.peak_bytes / MiB:.0f} MiB")
    return report


def _one(name: str, strat: Strategy | None, path: str, options: dict[str, Any], code: str, workdir: str,
         timeout: float) -> ProcessRun:
    """One timed process, after the strategy's per-run preparation if it has one."""
    prep_wall = None
    if strat is not None and strat.prepare is not None and strat.prepare_scope == "each":
        prepared = prepare(strat, path, options=options, workdir=workdir, timeout=timeout)
        prep_wall = prepared.wall_s
        code = whole_process_code(strat, prepared.model_path, options)
    run, tail = time_process(code, timeout=timeout, log_path=os.path.join(workdir, f"{name}.log"))
    if run.returncode != 0:
        raise ProbeError(f"whole process {name} failed with exit code {run.returncode}", stderr=tail,
                         returncode=run.returncode)
    run.prepare_wall_s = prep_wall
    return run
