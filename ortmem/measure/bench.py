"""Benchmark runner: interleaved fresh-process probes, table / JSON / plot.

Why vary the heap layout between rounds: under glibc, ORT's peak depends on where the heap
starts (a few KiB of padding before the imports moves the peak by whole weight tensors), and two
identical fresh processes start from the same layout. Round ``i`` therefore pads every strategy's
child by the same ``heap_jitter`` (seeded, 0-64 KiB): strategies are compared on equal layouts and
the repeats sample the distribution instead of one point of it. ``jitter=False`` turns this off.

Why rounds, rotated (A B C, B C A, C A B, ...) rather than each strategy in a block or one fixed
order: the machine drifts (page cache, other tenants, thermal state), and a fixed order puts each
strategy after the same other one every round (after its writes, or on the same parity of consecutive
processes): :mod:`ortmem.measure.stats`. Every probe starts from the same state, writes flushed and no
earlier probe's background process alive (:mod:`ortmem.measure.machine_state`, applied in
:func:`~ortmem.measure.probe.probe`).

``--whole-process`` times each strategy as a whole ``python -c`` process instead
(:mod:`ortmem.measure.whole_process`); ``--cross-check`` runs both and sets their init ratios side by side.

Results, their JSON schema (``"ortmem.bench/2"``) and the table live in
:mod:`ortmem.measure.report`; they are re-exported here. ``--workers``/``--workers-sweep`` add a
table of N worker processes on one model (:mod:`ortmem.measure.workers`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ortmem.base.units import MiB, bytes_arg, pair_arg
from ortmem.measure.failures import ProbeError
from ortmem.measure.probe import Prepared, ProbeResult, prepare_once, probe
from ortmem.measure.report import (  # noqa: F401  (re-exported: the bench's public API)
    BIMODAL_SPREAD,
    METRICS,
    SCHEMA,
    BenchReport,
    ModelReport,
    Stat,
    StrategyResult,
    read_json,
    render_cross_check,
    render_table,
    to_json_dict,
    write_json,
)
from ortmem.measure.stats import schedule  # noqa: F401  (re-exported)
from ortmem.measure.strategies import default_strategies, get_strategy
from ortmem.measure.whole_process import WholeProcessReport, run_whole_process
from ortmem.base.bytecode import ensure_bytecode
from ortmem.measure.workers import DEFAULT_STRATEGIES as WORKER_STRATEGIES
from ortmem.measure.workers import DEFAULT_SWEEP, run_workers

JITTER_MAX = 64 * 1024
SYNTH_PRESETS = ("demo", "llama_0_6gb", "llama_1_6gb", "llama_7b")  # SynthConfig class methods


def environment() -> dict[str, Any]:
    """What the numbers depend on, so two reports can be compared knowingly."""
    import numpy
    import onnxruntime

    import ortmem

    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
        "ortmem": getattr(ortmem, "__version__", None),
        "platform": platform.platform(),
        "libc": " ".join(platform.libc_ver()),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem_total,
    }


def _progress_line(i: int, n: int, model: str, strategy: str, rep: int, r: ProbeResult | None, err: str = "") -> str:
    head = f"[{i}/{n}] {os.path.basename(model)} {strategy} #{rep + 1}"
    if r is None:
        return f"{head}: FAILED {err.splitlines()[0] if err else ''}"
    run = f", first run {r.run_wall_s:.3f} s" if r.run_wall_s is not None else ""
    return (
        f"{head}: peak {r.peak_bytes / MiB:.1f} MiB (+{r.peak_above_baseline_bytes / MiB:.1f} over "
        f"baseline), steady {r.steady_bytes / MiB:.1f} MiB, init {r.create_wall_s:.3f} s{run}"
    )


def run_bench(
    models: Sequence[str | os.PathLike],
    strategies: Sequence[str] | None = None,
    repeat: int = 3,
    *,
    memray: bool = False,
    progress: bool = True,
    options: dict[str, Any] | None = None,
    timeout: float = 600.0,
    sample_interval: float = 0.01,
    jitter: bool = True,
    seed: int = 0,
    first_round: int = 0,
    prepared: Mapping[tuple[str, str], Prepared | ProbeError] | None = None,
) -> BenchReport:
    """Probe every (model, strategy) ``repeat`` times, interleaved, each in a fresh process.

    Preparation steps with ``prepare_scope="once"`` run once per model before its repeats (not
    measured); ``"each"`` ones run inside every probe. With ``memray=True`` one extra probe per
    (model, strategy) runs under memray after the clean repeats and is kept apart from the
    statistics, because memray's own bookkeeping inflates RSS.
    A failing probe is recorded in ``errors`` and the bench goes on. Round ``i`` pads every
    child's heap by ``jitters[i]`` bytes (module docstring) unless ``jitter=False``. ``first_round``
    numbers the rounds from there (rotation and jitter as in one run of them all: ``--cross-check``
    runs the bench one round at a time). ``prepared`` holds "once" preparations already made
    (:func:`~ortmem.measure.probe.prepare_once`), which the caller keeps alive (``--cross-check``
    prepares once for every round of both methods); the others are made here.
    """
    names = list(dict.fromkeys(strategies)) if strategies else default_strategies()
    rng = random.Random(seed)
    jitters = [rng.randrange(0, JITTER_MAX, 16) if jitter else 0 for _ in range(first_round + repeat)]
    paths = [os.path.abspath(os.fspath(m)) for m in models]
    report = BenchReport(
        repeat=repeat,
        order=schedule(paths, names, repeat, first_round),
        environment=environment(),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        memray=memray,
    )
    total = len(report.order) + (len(paths) * len(names) if memray else 0)
    done = 0

    def say(line: str) -> None:
        if progress:
            print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="ortmem-bench-") as workdir:
        for path in paths:
            mr = ModelReport(path, {s: StrategyResult(get_strategy(s).name) for s in names})
            report.models.append(mr)
            ready = {s: got for (m, s), got in (prepared or {}).items() if m == path and s in names}
            made = prepare_once([path], [s for s in names if s not in ready], options=options, workdir=workdir,
                                timeout=timeout, say=say)
            ready.update({s: got for (_, s), got in made.items()})
            for s, got in ready.items():
                if isinstance(got, ProbeError):
                    mr.strategies[s].errors.append(f"prepare: {got}")
                else:
                    mr.strategies[s].prepared_model = got.model_path
            todo = [(m, s, i) for (m, s, i) in report.order if m == path]
            extra = [(path, s, -1) for s in names] if memray else []
            for m, s, i in todo + extra:
                sr = mr.strategies[s]
                done += 1
                if any(e.startswith("prepare:") for e in sr.errors):
                    continue
                try:
                    r = probe(
                        s,
                        path,
                        options=options,
                        memray=i < 0,
                        sample_interval=sample_interval,
                        timeout=timeout,
                        prepared=ready.get(s),
                        workdir=workdir,
                        heap_jitter=jitters[i] if i >= 0 else 0,
                    )
                except ProbeError as e:
                    sr.errors.append(str(e))
                    say(_progress_line(done, total, m, s, i, None, str(e)))
                    continue
                if i < 0:
                    sr.memray_run = r
                    say(f"[{done}/{total}] {os.path.basename(m)} {s} memray: heap peak "
                        f"{(r.memray or {}).get('peak_bytes', 0) / MiB:.1f} MiB")
                else:
                    r.round = i
                    sr.runs.append(r)
                    say(_progress_line(done, total, m, s, i, r))
    return report



def _interleaved(probes: Callable[[int, int], BenchReport], whole: Callable[[int, int], list[WholeProcessReport]],
                 repeat: int) -> tuple[BenchReport, list[WholeProcessReport]]:
    """``--cross-check``: round by round, the probes' round then the whole processes' round.

    Why: run as two blocks (every probe round, then every whole-process round), the two modes would
    meet ORT at different moments, and ORT's init drifts within a run while the other strategies
    hold, so the ratios to ORT would disagree. The strategies' "once" preparations are made before
    the first round and serve every round of both methods (:func:`~ortmem.measure.probe.prepare_once`),
    so no round pays for them twice and the warm start's probes and whole processes read the same
    entries; "each" ones still run before every probe."""
    report, wholes = probes(1, 0), whole(1, 0)
    for r in range(1, repeat):
        report.extend(probes(1, r))
        for acc, part in zip(wholes, whole(1, r)):
            acc.extend(part)
    return report, wholes


def plot(report: BenchReport, path_png: str | os.PathLike) -> None:
    """Resident memory over time per strategy (median run), and total memory against the number of
    workers when the report has a worker sweep; see :mod:`ortmem.measure.plotting`."""
    from ortmem.measure.plotting import plot as _plot

    _plot(report, path_png)


# --- command line --------------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _count_list(text: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8] (positive worker counts)."""
    return [_positive(part.strip()) for part in text.split(",") if part.strip()]


def _kv(text: str) -> tuple[str, str]:
    return pair_arg(text, "KEY=VALUE")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``ortmem bench MODEL... [--strategy S]... [--repeat N] [--json F] [--plot F]``."""
    parser.add_argument("models", nargs="*", metavar="MODEL", help="ONNX model file(s)")
    parser.add_argument("--demo", action="store_true",
                        help="generate (once) the built-in synthetic Llama-shaped int4 QDQ model (~0.3 GB) and "
                        "compare ort, twin, ortmem and ortmem-warm on it")
    parser.add_argument("--synth", action="append", default=[], choices=SYNTH_PRESETS, metavar="PRESET",
                        help="also bench a generated synthetic Llama-shaped int4 QDQ model (external data, made once "
                        "into the cache): " + ", ".join(SYNTH_PRESETS))
    parser.add_argument(
        "--strategy", "-s", action="append", dest="strategies", metavar="S",
        help="strategy name or module:function (repeatable; default: "
        + ", ".join(default_strategies()) + ")",
    )
    parser.add_argument("--repeat", "-n", type=int, default=3, help="fresh processes per strategy (default 3; 0: only the worker table)")
    parser.add_argument("--json", metavar="FILE", help="write the report (schema ortmem.bench/2): every measurement")
    parser.add_argument("--wide", action="store_true",
                        help="every column: sampled private and shared peaks, first run, fastest init, their ratios "
                        "(default: strategy, peak, private and shared after the first run, init, ratios, output)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot resident memory over time")
    parser.add_argument("--memray", action="store_true", help="one extra probe per strategy under memray")
    parser.add_argument("--dim", action="append", type=_kv, default=[], metavar="NAME=N",
                        help="size of a symbolic input dimension (default batch=1, others 8)")
    parser.add_argument("--session-config", action="append", type=_kv, default=[], metavar="KEY=VALUE",
                        help="ORT session config entry passed to the strategies")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per probe (default 600)")
    parser.add_argument("--no-jitter", action="store_true",
                        help="start every repeat from the same heap layout (default: vary it per round)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    whole = parser.add_mutually_exclusive_group()
    whole.add_argument("--whole-process", action="store_true",
                       help="instead of probes, time each strategy as a whole `python -c` process (wall, CPU, "
                       "peak RSS from wait4, as /usr/bin/time), -n rounds, plain ORT and a bare `import "
                       "onnxruntime` always included; fastest and median, ratios to ORT")
    whole.add_argument("--cross-check", action="store_true",
                       help="probes and whole processes both, and their init ratios to ORT side by side")
    workers = parser.add_argument_group(
        "workers", "N fresh worker processes on the (first) model, each creating a session and running it; "
        "summed PSS, private and shared, when all are ready (strategies default to "
        + ", ".join(WORKER_STRATEGIES) + "; -s picks others)")
    workers.add_argument("--workers", type=_positive, metavar="N", help="measure N workers per strategy")
    workers.add_argument("--workers-sweep", nargs="?", type=_count_list, const=list(DEFAULT_SWEEP), metavar="N,N,...",
                         help="measure each worker count (default " + ",".join(map(str, DEFAULT_SWEEP)) + ")")
    start = workers.add_mutually_exclusive_group()
    start.add_argument("--together", dest="together", action="store_true", default=True,
                       help="start the workers all at once, as a process manager does (default)")
    start.add_argument("--stagger", dest="together", action="store_false",
                       help="start each worker when the previous one is ready")
    workers.add_argument("--memory-budget", type=bytes_arg, metavar="BYTES",
                         help="extrapolate worker counts predicted to need more than this (e.g. 12GiB), as well "
                         "as those over 80%% of the available memory")
    workers.add_argument("--no-memory-guard", action="store_true",
                         help="run every worker count even where the machine would run out of memory "
                         "(default: extrapolate those, marked)")


def main(args: argparse.Namespace) -> int:
    """Run the bench, print the table; 1 if any probe failed, 2 for an unknown strategy, else 0."""
    counts = _worker_counts(args)
    args.models = list(args.models) + [synth_model(preset) for preset in args.synth]
    if args.demo:
        args.models = list(args.models) + [demo_model()]
        args.strategies = args.strategies or ["ort", "twin", "ortmem", "ortmem-warm"]
        args.plot = args.plot or str(Path(args.models[-1]).with_name("demo-bench.png"))
        counts = counts or [1, 4]
    if not args.models:
        print("ortmem bench: give MODEL path(s) or --demo", file=sys.stderr)
        return 2
    if args.repeat <= 0 and not counts:
        print("ortmem bench: -n 0 needs --workers or --workers-sweep", file=sys.stderr)
        return 2
    if args.whole_process and args.plot and not counts:
        print("ortmem bench: --plot draws the probes' memory over time; --whole-process makes no probes",
              file=sys.stderr)
        return 2
    options: dict[str, Any] = {}
    if args.dim:
        options["dims"] = {k: int(v) for k, v in args.dim}
    if args.session_config:
        options["session_config"] = dict(args.session_config)
    for s in args.strategies or []:
        try:
            get_strategy(s)
        except KeyError as e:
            print(f"ortmem bench: {e.args[0]}", file=sys.stderr)
            return 2
    bytecode = ensure_bytecode()
    if not args.quiet:
        print(bytecode, file=sys.stderr, flush=True)
    say = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))

    shared: dict[tuple[str, str], Prepared | ProbeError] = {}

    def probes(rounds: int, first: int = 0) -> BenchReport:
        return run_bench(args.models, args.strategies, rounds, memray=args.memray and first == 0,
                         progress=not args.quiet, options=options, timeout=args.timeout,
                         jitter=not args.no_jitter, first_round=first, prepared=shared)

    def whole(rounds: int, first: int = 0) -> list[WholeProcessReport]:
        return [run_whole_process(m, args.strategies or default_strategies(), rounds, options=options,
                                  timeout=args.timeout, say=say, first_round=first, prepared=shared)
                for m in args.models]

    if args.repeat > 0 and args.cross_check and not args.whole_process:
        with tempfile.TemporaryDirectory(prefix="ortmem-cross-check-") as work:
            shared.update(prepare_once(args.models, args.strategies or default_strategies(), options=options,
                                       workdir=work, timeout=args.timeout, say=say))
            report, wholes = _interleaved(probes, whole, args.repeat)
        report.whole_process = wholes
    elif args.repeat > 0 and not args.whole_process:
        report = probes(args.repeat)
    else:  # -n 0: the worker table only; --whole-process: no probes
        report = BenchReport(repeat=args.repeat if args.whole_process else 0, environment=environment(),
                             created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    report.environment["ortmem_bytecode"] = bytecode
    if args.repeat > 0 and args.whole_process:
        report.whole_process = whole(args.repeat)
    if counts:
        say = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
        worker_strategies = args.strategies if args.strategies and not args.demo else None
        report.workers = run_workers(args.models[0], worker_strategies, counts, together=args.together,
                                     options=options, timeout=args.timeout, guard=not args.no_memory_guard,
                                     budget=args.memory_budget, say=say)
    print(render_table(report, wide=args.wide))
    if args.cross_check and report.whole_process:
        print()
        print(render_cross_check(report))
    if args.json:
        write_json(report, args.json)
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(f"json: {args.json}")
    failed = any(sr.errors for mr in report.models for sr in mr.strategies.values())
    failed = failed or bool(report.workers and any(r.error for r in report.workers.runs))
    failed = failed or any(w.errors for w in report.whole_process or [])
    return 1 if failed else 0


def _worker_counts(args: argparse.Namespace) -> list[int]:
    """Worker counts asked for: ``--workers N`` and/or ``--workers-sweep 1,2,4,8``."""
    counts = list(args.workers_sweep or [])
    if args.workers:
        counts.append(args.workers)
    return sorted(set(counts))


def demo_model() -> str:
    """The demo's model: SynthConfig.demo() as external data, generated once into the cache."""
    return synth_model("demo")


def synth_model(preset: str) -> str:
    """A SynthConfig preset (``SYNTH_PRESETS``) as external data, generated once into the cache."""
    from ortmem.store.cache import cache_root
    from ortmem.base.progress import progress_bar
    from ortmem.measure.synth import SynthConfig, cached_model

    config = getattr(SynthConfig, preset)(storage="external")
    with progress_bar(f"generating the {preset} model") as bar:
        return str(cached_model(config, cache_root() / "synth", progress=bar))
