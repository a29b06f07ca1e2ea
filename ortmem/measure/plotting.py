"""Resident memory over time, one panel per model, one colour per strategy (its median run);
with a worker sweep, one more panel of total memory against the number of workers.

Private memory (anonymous: heap, what the session really costs each process) is drawn solid,
shared memory (file-backed: mapped weights and libraries, page cache counted once per machine)
dashed, so zero-copy loading is visible as memory moving from the solid to the dashed line. Time 0
is the start of session creation in every run; a dotted vertical line marks the end of creation and
a shaded band the first run. In the worker panel, solid is total PSS and dashed total private;
extrapolated points (memory guard) are hollow and joined by dotted lines.

Each title starts at its panel's left edge and is wrapped where it would pass the figure's right edge
(the legends sit right of the panels, so a centred title wider than its panel was cut on both sides).
"""
from __future__ import annotations

import os
import textwrap
from typing import TYPE_CHECKING, Any

from ortmem.base.units import MiB

if TYPE_CHECKING:
    from ortmem.measure.bench import BenchReport

DPI = 110


def plot(report: "BenchReport", path_png: str | os.PathLike) -> None:
    """Draw ``report`` (:func:`figure`) into a PNG file."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    try:
        fig.savefig(path_png, dpi=DPI)
    finally:
        plt.close(fig)


def figure(report: "BenchReport") -> Any:
    """The figure :func:`plot` saves, laid out, its titles fitted (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    models = [mr for mr in report.models if any(sr.runs for sr in mr.strategies.values())]
    workers = report.workers if report.workers and any(not r.error for r in report.workers.runs) else None
    if not models and not workers:
        raise ValueError("nothing to plot: no successful runs in the report")
    panels = len(models) + (1 if workers else 0)
    # laid out at the resolution it is saved at, so the titles are measured as they are drawn
    fig, axes = plt.subplots(panels, 1, figsize=(11, 4.8 * panels), squeeze=False, dpi=DPI)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    titles = []
    for ax, mr in zip(axes[:, 0], models):
        handles = []
        t_max = 0.0
        for k, (name, sr) in enumerate(mr.strategies.items()):
            idx = sr.median_run
            if idx is None:
                continue
            run = sr.runs[idx]
            color = colors[k % len(colors)]
            lead = min(0.1, 0.1 * max(run.events.get("run_end", run.events.get("create_end", 0.1)), 0.1))
            pts = [p for p in run.timeline if p[0] >= -lead]
            if not pts:
                continue
            t = [p[0] for p in pts]
            anon = [p[1] / MiB for p in pts]
            file_ = [p[2] / MiB for p in pts]
            t_max = max(t_max, t[-1])
            ax.plot(t, anon, color=color, lw=2.0, solid_capstyle="butt")
            ax.plot(t, file_, color=color, lw=1.6, ls="--")
            ce = run.events.get("create_end")
            if ce is not None:
                ax.axvline(ce, color=color, ls=":", lw=1.2)
            rs, re = run.events.get("run_start"), run.events.get("run_end")
            if rs is not None and re is not None:
                ax.axvspan(rs, max(re, rs + 0.004 * max(t_max, 1e-3)), color=color, alpha=0.15, lw=0)
            label = (
                f"{name}: private {run.peak_anon_bytes / MiB:.0f} MiB peak, "
                f"{(run.anon_after_run_bytes or 0) / MiB:.0f} after run; shared {run.peak_file_bytes / MiB:.0f} MiB "
                f"peak; init {run.create_wall_s:.2f} s"
            )
            handles.append(Line2D([], [], color=color, lw=2.5, label=label))
        handles += [
            Line2D([], [], color="0.3", lw=2.0, label="private: anonymous (RssAnon+RssShmem)"),
            Line2D([], [], color="0.3", lw=1.6, ls="--", label="shared: file-backed (RssFile)"),
            Line2D([], [], color="0.3", lw=1.2, ls=":", label="session created"),
            Patch(color="0.3", alpha=0.2, label="first run"),
        ]
        ax.set_xlabel("time since session creation started (s)")
        ax.set_ylabel("resident memory (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=min(ax.get_xlim()[0], 0))
        ax.grid(True, alpha=0.3)
        interval = next(r for s in mr.strategies.values() for r in s.runs).sample_interval_s
        titles.append(ax.set_title(
            f"{mr.name}: resident memory of the process tree\n"
            f"median-peak run of {report.repeat} fresh process(es) per strategy, sampled every "
            f"{interval * 1000:.0f} ms",
            fontsize=11, loc="left",
        ))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    if workers:
        titles.append(_plot_workers(axes[-1, 0], workers, colors))
    fit_titles(fig, titles)
    return fig


def fit_titles(fig: Any, titles: list[Any], margin: float = 0.01) -> None:
    """Lay the figure out, then wrap each left-aligned title until it ends inside the figure (a long
    model name, a narrow panel beside its legend), and lay it out again for the taller titles.
    ``margin``: the part of the figure's width kept clear at the right (glyphs drawn a pixel wider)."""
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    right = fig.bbox.x1 * (1 - margin)
    for title in titles:
        lines = title.get_text().splitlines()
        width = max(len(line) for line in lines)
        while title.get_window_extent(renderer).x1 > right and width > 16:
            width -= 4
            title.set_text("\n".join(textwrap.fill(line, width, break_on_hyphens=False) for line in lines))
    fig.tight_layout()


def _plot_workers(ax, workers, colors) -> Any:  # noqa: ANN001  (matplotlib types stay lazy)
    """Total PSS (solid) and total private (dashed) against N, per strategy; returns the panel's title."""
    from matplotlib.lines import Line2D

    handles = []
    for k, name in enumerate(workers.strategies()):
        color = colors[k % len(colors)]
        runs = sorted((r for r in workers.runs if r.strategy == name and not r.error), key=lambda r: r.n)
        measured = [r for r in runs if not r.extrapolated]
        for attr, ls in (("total_pss_bytes", "-"), ("total_private_bytes", "--")):
            ax.plot([r.n for r in measured], [getattr(r, attr) / MiB for r in measured], color=color, ls=ls,
                    marker="o")
            guessed = measured[-1:] + [r for r in runs if r.extrapolated]
            if len(guessed) > 1:
                ax.plot([r.n for r in guessed], [getattr(r, attr) / MiB for r in guessed], color=color, ls=":",
                        marker="o", markerfacecolor="none")
        last = runs[-1] if runs else None
        label = name if last is None else (
            f"{name}: {last.n} workers {last.total_pss_bytes / MiB:.0f} MiB PSS, "
            f"{last.total_private_bytes / MiB:.0f} private" + (" (extrapolated)" if last.extrapolated else ""))
        handles.append(Line2D([], [], color=color, lw=2.5, label=label))
    handles += [
        Line2D([], [], color="0.3", lw=2.0, label="total PSS (private + shared)"),
        Line2D([], [], color="0.3", lw=1.6, ls="--", label="total private (Pss_Anon+Pss_Shmem)"),
        Line2D([], [], color="0.3", ls=":", marker="o", markerfacecolor="none", label="extrapolated (memory guard)"),
    ]
    ax.set_xlabel("worker processes")
    ax.set_ylabel("memory summed over the workers (MiB)")
    ax.set_xticks(workers.counts)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    mode = "started together" if workers.together else "started one after the other"
    title = ax.set_title(f"{os.path.basename(workers.model)}: N worker processes, {mode}, each with a session "
                         "that has run once", fontsize=11, loc="left")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    return title
