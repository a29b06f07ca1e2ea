"""Bench results: per-strategy statistics, ratios, the JSON file format and the text table.

Private and shared memory are the headline, apart: *private* is anonymous memory (``RssAnon`` +
``RssShmem``: the heap, what each process costs on its own and what the OOM killer counts), *shared*
is file-backed memory (``RssFile``: mapped weights and libraries, page cache that every process
mapping the same file shares and the kernel can reclaim). A zero-copy or warm start moves memory
from the first to the second, so a single "peak RSS" ratio hides its win; every ratio is therefore
given for each kind. Worker tables (``bench --workers``) live in :mod:`ortmem.measure.workers`.

Why medians with min-max, and the fastest: under default glibc one model's peak can flip between
modes from run to run, and ORT's init on a QDQ model flips between two times in consecutive fresh
processes; so the spread is reported, init times are given as the fastest and the median (ratios of
both), and a ``bimodal`` flag is raised when a metric's samples split at a gap larger than
``stats.BIMODAL_GAP`` of their median (:func:`ortmem.measure.stats.split_modes`; ``modes`` says which
metric and where). ``spread`` (max/min of the peak) is kept as before.

JSON schema ``"ortmem.bench/2"`` (all sizes in bytes, times in seconds)::

    {
      "schema": "ortmem.bench/2",
      "created": "2025-01-01T12:00:00+00:00",        # ISO 8601, UTC
      "environment": {"python", "onnxruntime", "numpy", "ortmem", "platform", "libc",
                      "cpu_count", "mem_total_bytes", "ortmem_bytecode"},   # the last: ortmem.base.bytecode
      "repeat": 3,
      "memray": false,                               # whether an extra memray probe was made
      "order": [[model_path, strategy, repeat_index], ...],   # the execution order
      "models": [
        {"model": "/abs/model.onnx", "name": "model.onnx",
         "strategies": [
           {"strategy": "ort",
            "prepared_model": null,                  # made by a "once" preparation step (in a
                                                     # temporary folder, gone after the bench)
            "summary": {METRIC: {"median", "min", "max", "n"}},  # METRICS below
            "spread": 1.01,                          # max/min of peak_bytes
            "bimodal": false,                        # any metric in "modes"
            "modes": {METRIC: [[low...], [high...]]},  # metrics whose samples split (stats.split_modes)
            "same_output_as_ort": true,              # null when there is no ort result
            "ratios": {"ort": {RATIO_METRIC: x},     # median / reference median (create_wall_s: median
                                                     # of the rounds' own ratios); absent refs omitted
                       "twin": {...}},
            "ratios_fastest": {"ort": {"create_wall_s": x, "create_cpu_s": x}},  # fastest / ref's fastest
            "median_run": 1,                         # index into runs of the median-peak run
            "runs": [ProbeResult.to_dict(), ...],    # every field of ortmem.measure.ProbeResult,
                                                     # incl. timeline [[t, anon, file]], events,
                                                     # output_hash, heap_jitter_bytes
            "memray_run": ProbeResult.to_dict() | null,   # not part of the statistics
            "errors": ["..."]}
         ]}
      ],
      "workers": WorkersReport.to_dict() | null,     # bench --workers (ortmem.measure.workers)
      "whole_process": [WholeProcessReport.to_dict(), ...] | null   # bench --whole-process / --cross-check
    }

Version 2 added ``file_after_run_bytes`` to the runs, the private/shared ratio metrics and
``workers``; later additions within version 2: ``modes``, ``ratios_fastest``, ``whole_process``, and
in the runs ``create_imports``, ``leftover_*`` and ``round`` (the bench's round, pairing a run with the
reference's run of the same round; runs without one pair by position). ``summary``/``ratios``/``spread`` are derived from ``runs``: :func:`read_json`
recomputes them. A reader must reject an unknown ``schema`` string; :func:`read_json` reads
versions 1 and 2 (a version-1 file simply lacks the new fields). Fields may be added within a version.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from ortmem.base.units import MiB
from ortmem.measure.probe import ProbeResult
from ortmem.measure.stats import BIMODAL_GAP, AGREE_WITHIN, RatioStat, Stat, agreement, metric_modes, modes_text
from ortmem.measure.text_table import align
from ortmem.measure.whole_process import WholeProcessReport
from ortmem.measure.workers import WorkersReport

SCHEMA = "ortmem.bench/2"
READABLE_SCHEMAS = ("ortmem.bench/1", SCHEMA)
BIMODAL_SPREAD = 1.03  # kept for readers of ``spread``; the flag itself is stats.BIMODAL_GAP
REFERENCES = ("ort", "twin")
METRICS = (
    "peak_bytes",
    "peak_create_bytes",
    "peak_run_bytes",
    "steady_bytes",
    "rss_after_create_bytes",
    "anon_after_run_bytes",
    "file_after_run_bytes",
    "peak_anon_bytes",
    "peak_file_bytes",
    "baseline_rss_bytes",
    "create_wall_s",
    "create_cpu_s",
    "run_wall_s",
)
RATIO_METRICS = (
    "peak_bytes",
    "peak_create_bytes",
    "steady_bytes",
    "create_wall_s",
    "peak_anon_bytes",  # private, sampled peak over creation and first run
    "peak_file_bytes",  # shared, sampled peak
    "anon_after_run_bytes",  # private once the session has run
    "file_after_run_bytes",  # shared once the session has run
)
#: Times also compared fastest against fastest (``ratios_fastest``).
FASTEST_METRICS = ("create_wall_s", "create_cpu_s")
#: Times, whose median ratio is the median of the rounds' own ratios (``stats.RatioStat``: why); memory
#: ratios stay median over median (a peak does not drift with the machine's speed).
PAIRED_METRICS = FASTEST_METRICS


@dataclass
class StrategyResult:
    """All probes of one strategy on one model, plus what is derived from them."""

    strategy: str
    runs: list[ProbeResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    prepared_model: str | None = None
    memray_run: ProbeResult | None = None

    def stat(self, metric: str) -> Stat | None:
        return Stat.of(_metric(r, metric) for r in self.runs)

    def by_round(self, metric: str) -> dict[int, float]:
        """``metric`` of each run keyed by its round (its position in reports that predate rounds)."""
        out = {}
        for i, r in enumerate(self.runs):
            value = _metric(r, metric)
            if value is not None:
                out[i if r.round is None else r.round] = value
        return out

    @property
    def spread(self) -> float | None:
        s = self.stat("peak_bytes")
        return s.max / s.min if s and s.min > 0 else None

    @property
    def modes(self) -> dict[str, tuple[list[float], list[float]]]:
        """Metrics whose samples split into two modes (``stats.split_modes``), with the two groups."""
        out = {}
        for metric in BIMODAL_GAP:
            if metric in METRICS and (split := metric_modes((_metric(r, metric) for r in self.runs), metric)):
                out[metric] = split
        return out

    @property
    def bimodal(self) -> bool:
        return bool(self.modes)

    @property
    def retained_bytes(self) -> float | None:
        """Anonymous memory resident after creation but not in use: what the allocator keeps.

        Resident is the median over the plain runs (``RssAnon`` after creation minus the baseline);
        in use is what memray's run still had allocated on the heap when creation ended (the memray
        run itself is not used for RSS, because memray inflates it).
        """
        mem = self.memray_run.memray if self.memray_run else None
        anon = Stat.of(r.anon_after_create_bytes - r.baseline_anon_bytes for r in self.runs)
        if not mem or "in_use_heap_bytes" not in mem or anon is None:
            return None
        return anon.median - mem["in_use_heap_bytes"]

    @property
    def median_run(self) -> int | None:
        """Index of the run whose peak is the median (lower middle for an even count)."""
        if not self.runs:
            return None
        order = sorted(range(len(self.runs)), key=lambda i: self.runs[i].peak_bytes)
        return order[(len(order) - 1) // 2]


@dataclass
class ModelReport:
    model: str
    strategies: dict[str, StrategyResult] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return os.path.basename(self.model)

    def ratios(self, strategy: str) -> dict[str, dict[str, float]]:
        """Median of each ratio metric over the reference strategy's median, per reference; for times
        (:data:`PAIRED_METRICS`), the median of the rounds' own ratios."""
        return self._ratios(strategy, RATIO_METRICS, "median")

    def ratios_fastest(self, strategy: str) -> dict[str, dict[str, float]]:
        """Fastest of each time metric over the reference strategy's fastest, per reference."""
        return self._ratios(strategy, FASTEST_METRICS, "fastest")

    def _ratios(self, strategy: str, metrics: tuple[str, ...], which: str) -> dict[str, dict[str, float]]:
        """``which`` statistic (median, fastest) of each metric over the reference's, per reference."""
        out: dict[str, dict[str, float]] = {}
        mine = self.strategies[strategy]
        for ref in REFERENCES:
            other = self.strategies.get(ref)
            if other is None or not other.runs or not mine.runs:
                continue
            values = {}
            for m in metrics:
                if m in PAIRED_METRICS:
                    ratio = RatioStat.of(mine.by_round(m), other.by_round(m))
                    if ratio is not None:
                        values[m] = getattr(ratio, which)
                elif (a := mine.stat(m)) and (b := other.stat(m)) and getattr(b, which):
                    values[m] = getattr(a, which) / getattr(b, which)
            out[ref] = values
        return out

    def same_output_as_ort(self, strategy: str) -> bool | None:
        ref = self.strategies.get("ort")
        if ref is None or not ref.runs or not self.strategies[strategy].runs:
            return None
        ref_hashes = {r.output_hash for r in ref.runs}
        return all(r.output_hash in ref_hashes for r in self.strategies[strategy].runs)


@dataclass
class BenchReport:
    repeat: int
    models: list[ModelReport] = field(default_factory=list)
    order: list[tuple[str, str, int]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    memray: bool = False
    workers: WorkersReport | None = None
    whole_process: list[WholeProcessReport] | None = None

    def extend(self, later: "BenchReport") -> None:
        """Add the probes of ``later``, a run of further rounds on the same models and strategies."""
        self.repeat += later.repeat
        self.order.extend(later.order)
        mine = {mr.model: mr for mr in self.models}
        for mr in later.models:
            if mr.model not in mine:
                self.models.append(mr)
                continue
            for name, sr in mr.strategies.items():
                acc = mine[mr.model].strategies.setdefault(name, StrategyResult(sr.strategy))
                acc.runs.extend(sr.runs)
                acc.errors.extend(sr.errors)
                acc.prepared_model = acc.prepared_model or sr.prepared_model
                acc.memray_run = acc.memray_run or sr.memray_run


def _metric(run: ProbeResult, metric: str) -> float | None:
    value = getattr(run, metric)
    return None if value is None else float(value)


# --- JSON ----------------------------------------------------------------------------------------


def to_json_dict(report: BenchReport) -> dict[str, Any]:
    models = []
    for mr in report.models:
        strategies = []
        for name, sr in mr.strategies.items():
            summary = {m: vars(st) for m in METRICS if (st := sr.stat(m)) is not None}
            strategies.append(
                {
                    "strategy": name,
                    "prepared_model": sr.prepared_model,
                    "summary": summary,
                    "spread": sr.spread,
                    "bimodal": sr.bimodal,
                    "modes": {m: [low, high] for m, (low, high) in sr.modes.items()},
                    "retained_bytes": sr.retained_bytes,
                    "same_output_as_ort": mr.same_output_as_ort(name),
                    "ratios": mr.ratios(name),
                    "ratios_fastest": mr.ratios_fastest(name),
                    "median_run": sr.median_run,
                    "runs": [r.to_dict() for r in sr.runs],
                    "memray_run": sr.memray_run.to_dict() if sr.memray_run else None,
                    "errors": list(sr.errors),
                }
            )
        models.append({"model": mr.model, "name": mr.name, "strategies": strategies})
    return {
        "schema": SCHEMA,
        "created": report.created,
        "environment": report.environment,
        "repeat": report.repeat,
        "memray": report.memray,
        "order": [list(o) for o in report.order],
        "models": models,
        "workers": report.workers.to_dict() if report.workers else None,
        "whole_process": [w.to_dict() for w in report.whole_process] if report.whole_process else None,
    }


def write_json(report: BenchReport, path: str | os.PathLike) -> None:
    """Write the report in schema ``ortmem.bench/2`` (see the module docstring)."""
    with open(path, "w") as f:
        json.dump(to_json_dict(report), f, indent=1)
        f.write("\n")


def read_json(path: str | os.PathLike) -> BenchReport:
    """Load a report written by :func:`write_json`; derived fields are recomputed from the runs."""
    with open(path) as f:
        d = json.load(f)
    if d.get("schema") not in READABLE_SCHEMAS:
        raise ValueError(f"{os.fspath(path)}: schema {d.get('schema')!r}, expected one of {READABLE_SCHEMAS}")
    report = BenchReport(
        repeat=int(d["repeat"]),
        order=[tuple(o) for o in d.get("order", [])],
        environment=d.get("environment", {}),
        created=d.get("created", ""),
        memray=bool(d.get("memray", False)),
        workers=WorkersReport.from_dict(d["workers"]) if d.get("workers") else None,
        whole_process=[WholeProcessReport.from_dict(w) for w in d["whole_process"]] if d.get("whole_process") else None,
    )
    for md in d["models"]:
        mr = ModelReport(md["model"])
        for sd in md["strategies"]:
            mr.strategies[sd["strategy"]] = StrategyResult(
                strategy=sd["strategy"],
                runs=[ProbeResult.from_dict(r) for r in sd.get("runs", [])],
                errors=list(sd.get("errors", [])),
                prepared_model=sd.get("prepared_model"),
                memray_run=ProbeResult.from_dict(sd["memray_run"]) if sd.get("memray_run") else None,
            )
        report.models.append(mr)
    return report


# --- table ---------------------------------------------------------------------------------------


def _mib_range(st: Stat | None) -> str:
    if st is None:
        return "-"
    if st.n == 1 or round(st.min / MiB) == round(st.max / MiB):
        return f"{st.median / MiB:.0f}"
    return f"{st.median / MiB:.0f} ({st.min / MiB:.0f}-{st.max / MiB:.0f})"


def _s_range(st: Stat | None) -> str:
    if st is None:
        return "-"
    if st.n == 1:
        return f"{st.median:.3f}"
    return f"{st.median:.3f} ({st.min:.3f}-{st.max:.3f})"


def _fastest(st: Stat | None) -> str:
    return "-" if st is None else f"{st.fastest:.3f}"


def _mib(st: Stat | None) -> str:
    return "-" if st is None else f"{st.median / MiB:.0f}"


def _memray_line(name: str, sr: "StrategyResult") -> str:
    """One line: memray's heap high-water mark, what stayed in use, the allocator's retained
    memory, and the largest site, named by its first caller."""
    mem = sr.memray_run.memray
    line = f"memray {name}: heap high-water {mem['peak_bytes'] / MiB:.0f} MiB"
    if "in_use_heap_bytes" in mem:
        line += f", in use after creation {mem['in_use_heap_bytes'] / MiB:.0f} MiB heap"
        if sr.retained_bytes is not None:
            line += f" (resident anon - in use = retained {sr.retained_bytes / MiB:.0f} MiB)"
    if mem.get("top"):
        top = mem["top"][0]
        callers = [f for f in top["stack"][1:] if not f.startswith("[")]
        via = f" via {callers[0]}" if callers else ""
        line += (
            f"; largest site {top['bytes'] / MiB:.0f} MiB in {top['count']} {top['allocator']} "
            f"call(s) at {top['stack'][0] if top['stack'] else '?'}{via}"
        )
    return line


def _mode_flags(sr: "StrategyResult") -> list[str]:
    """``bimodal init 1.65|2.90 s (2+1)``: each split metric, its modes' medians and sizes."""
    out = []
    for metric, modes in sr.modes.items():
        if metric == "peak_bytes":
            out.append(f"bimodal peak {modes_text(modes, MiB, ' MiB', '.0f')}")
        else:
            out.append(f"bimodal init {modes_text(modes, 1.0, ' s')}")
    return out


def _ratio(ratios: dict[str, dict[str, float]], ref: str, metric: str) -> str:
    value = ratios.get(ref, {}).get(metric)
    return "-" if value is None else f"{value:.2f}"


#: Every column of a model's table, by header (``{ref}``: the reference's name), as ``--wide`` prints them.
WIDE_COLUMNS = ("strategy", "private pk", "shared pk", "private run", "shared run", "peak MiB", "init s", "first run s",
                "private run/{ref}", "private pk/{ref}", "shared pk/{ref}", "peak/{ref}", "init/{ref}", "init fastest s",
                "init fastest/{ref}", "out", "flags")
#: The columns of the default table: what a user reads first (the JSON report holds everything).
FIRST_COLUMNS = ("strategy", "peak MiB", "private run", "shared run", "init s", "peak/{ref}", "private run/{ref}",
                 "init/{ref}", "out", "flags")


def _strategy_flags(sr: StrategyResult) -> list[str]:
    """What the row's numbers need said beside them: modes, failures, how the start went."""
    flags = _mode_flags(sr)
    if sr.errors:
        flags.append(f"{len(sr.errors)} failed")
    if any(not r.hwm_reset for r in sr.runs):
        flags.append("hwm not reset")
    if any(r.helper_pids for r in sr.runs):
        flags.append("helpers")
    actions = sorted({r.ortmem_action for r in sr.runs if r.ortmem_action})
    if actions:  # what the ortmem session gave ORT: a warm strategy that missed its entry shows
        flags.append("/".join(actions))
    background = [r for r in sr.runs if r.background_wall_s is not None]
    if background:  # a cold start's finisher, after the measured phases (ortmem.store.finisher)
        flags.append(f"finisher {statistics.median(r.background_wall_s for r in background):.1f} s "
                     f"{statistics.median(r.background_peak_bytes or 0 for r in background) / 2**20:.0f} MiB")
    return flags


def _strategy_cells(mr: ModelReport, name: str, ref: str) -> dict[str, str]:
    """Every column of one strategy's row, by header (:data:`WIDE_COLUMNS`)."""
    sr = mr.strategies[name]
    ratios = mr.ratios(name)
    fastest = mr.ratios_fastest(name)
    same = mr.same_output_as_ort(name)
    return {
        "strategy": name,
        "private pk": _mib(sr.stat("peak_anon_bytes")),
        "shared pk": _mib(sr.stat("peak_file_bytes")),
        "private run": _mib_range(sr.stat("anon_after_run_bytes")),
        "shared run": _mib(sr.stat("file_after_run_bytes")),
        "peak MiB": _mib_range(sr.stat("peak_bytes")),
        "init s": _s_range(sr.stat("create_wall_s")),
        "first run s": _s_range(sr.stat("run_wall_s")),
        f"private run/{ref}": _ratio(ratios, ref, "anon_after_run_bytes"),
        f"private pk/{ref}": _ratio(ratios, ref, "peak_anon_bytes"),
        f"shared pk/{ref}": _ratio(ratios, ref, "peak_file_bytes"),
        f"peak/{ref}": _ratio(ratios, ref, "peak_bytes"),
        f"init/{ref}": _ratio(ratios, ref, "create_wall_s"),
        "init fastest s": _fastest(sr.stat("create_wall_s")),
        f"init fastest/{ref}": _ratio(fastest, ref, "create_wall_s"),
        "out": "-" if same is None else ("=ort" if same else "DIFF"),
        "flags": ", ".join(_strategy_flags(sr)),
    }


def render_table(report: BenchReport, *, wide: bool = False) -> str:
    """Plain-text table per model: private and shared memory apart, medians with (min-max), and
    ratios to the twin (to ``ort`` when there is no twin); then the worker table if any. By default
    the columns a user reads first (:data:`FIRST_COLUMNS`); ``wide``: every column, sampled peaks,
    the first run and the fastest init included."""
    blocks = []
    for mr in report.models:
        ref = "twin" if "twin" in mr.strategies else "ort"
        header = [c.format(ref=ref) for c in (WIDE_COLUMNS if wide else FIRST_COLUMNS)]
        rows = [header] + [[cells[c] for c in header]
                           for cells in (_strategy_cells(mr, name, ref) for name in mr.strategies)]
        lines = [f"{mr.name}  ({mr.model}), {report.repeat} fresh process(es) per strategy, medians (min-max)"
                 + (" and fastest" if wide else "")]
        lines += align(rows)
        for name, sr in mr.strategies.items():
            if sr.memray_run and sr.memray_run.memray:
                lines.append(_memray_line(name, sr))
        blocks.append("\n".join(lines))
    legend = (
        "private: anonymous memory (RssAnon+RssShmem), what each process costs alone; shared: file-backed "
        "(RssFile), page cache counted once per machine and reclaimable. "
        + ("pk: sampled peak over creation and first run; " if wide else "")
        + "run: after the first run. peak: VmHWM (private + shared) over creation and first run "
        "(+helpers). Ratios: memory, medians over the reference's medians; init, the median of each round's "
        "init over the reference's in the same round (pairs)"
        + ("; init fastest/ref: fastest over fastest. " if wide else ". ")
        + "bimodal: samples split at a gap over 3% and 2 MiB (memory) or 20% and 50 ms (time) of the median, "
        "modes' medians "
        "(counts). finisher: a cold start's background "
        "packing of ORT's weights after the first run (ortmem.store.finisher), s from the run's end and its "
        "sampled peak, outside every column."
        + ("" if wide else " --wide adds the sampled private and shared peaks, the first run, the fastest init and their ratios.")
    )
    out = blocks + ([legend] if report.models else [])
    if report.workers is not None:
        out.append(report.workers.render_table())
    for whole in report.whole_process or []:
        out.append(whole.render_table())
    return "\n\n".join(out)


def render_cross_check(report: BenchReport) -> str:
    """The probes' init against the whole processes' (``init~`` = wall minus a bare ``import
    onnxruntime``), in seconds and as ratios to ORT and to the twin where the run has one, fastest and
    paired median: where the two disagree, one of them is not measuring what a user's process pays
    (the issue's target: within 10 %). Each disagreement comes with the band chance alone gives it over
    these rounds (``stats.agreement``) and a verdict: yes (within 10 %), noise (outside, but the band
    reaches 0), NO (a real difference)."""
    header = ["model", "strategy", "ref", "init s", "init~ s", "init/ref", "init~/ref", "agree fastest", "agree median"]
    rows = [header]
    verdicts: list[str] = []
    wholes = {w.model: w for w in report.whole_process or []}
    for mr in report.models:
        whole = wholes.get(mr.model)
        if whole is None:
            continue
        probes = {name: sr.by_round("create_wall_s") for name, sr in mr.strategies.items()}
        inits = {name: whole.init_by_round(name) for name in mr.strategies}
        for ref in (r for r in REFERENCES if probes.get(r) and inits.get(r)):
            for name in mr.strategies:
                # not a reference against itself, nor ORT against the twin (the twin against ORT, inverted)
                if name in REFERENCES[: REFERENCES.index(ref) + 1] or not probes[name] or not inits[name]:
                    continue
                # no ratio where the reference's init~ is not positive (a tiny model: within noise of the import)
                ratios = [RatioStat.of(probes[name], probes[ref]), RatioStat.of(inits[name], inits[ref])]
                agree = agreement(probes, inits, name, ref)
                verdicts += [a.verdict for a in agree.values()]
                probe_init, whole_init = Stat.of(probes[name].values()), Stat.of(inits[name].values())
                rows.append([
                    mr.name, name, ref,
                    f"{probe_init.fastest:.3f}/{probe_init.median:.3f}", f"{whole_init.fastest:.3f}/{whole_init.median:.3f}",
                    *("-" if r is None else f"{r.fastest:.2f}/{r.median:.2f}" for r in ratios),
                    *(agree[k].text() if k in agree else "-" for k in ("fastest", "median")),
                ])
    lines = ["cross-check: probe init against whole-process init~, fastest/median (ratios: fastest over fastest / "
             "median of the rounds' own ratios); agree: whole-process ratio over probe ratio - 1, [the 95% "
             "band of chance over these rounds, resampled], yes: within "
             f"{AGREE_WITHIN:.0%}, noise: outside it but the band reaches 0, NO: outside both (about one ratio "
             "in twenty by chance; a fastest's band is narrower than its true spread)"]
    lines += align(rows)
    if len(rows) > 1:
        lines.append(f"agree within {AGREE_WITHIN:.0%}: {verdicts.count('yes')} of {len(verdicts)} ratios; "
                     f"within noise only: {verdicts.count('noise')}; disagree: {verdicts.count('NO')}")
    return "\n".join(lines)
