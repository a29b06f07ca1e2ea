"""Resident memory over time, one panel per model, one colour per strategy (its median run).

Anonymous memory (heap: what the session really costs) is drawn solid, file-backed memory
(mapped weights and libraries: reclaimable) dashed, so zero-copy loading is visible as memory
moving from the solid to the dashed line. Time 0 is the start of session creation in every run;
a dotted vertical line marks the end of creation and a shaded band the first run.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .probe import MiB

if TYPE_CHECKING:
    from .bench import BenchReport


def plot(report: "BenchReport", path_png: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    models = [mr for mr in report.models if any(sr.runs for sr in mr.strategies.values())]
    if not models:
        raise ValueError("nothing to plot: no successful runs in the report")
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 4.8 * len(models)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
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
                f"{name}: peak {run.peak_bytes / MiB:.0f} MiB, steady {run.steady_bytes / MiB:.0f} MiB, "
                f"init {run.create_wall_s:.2f} s"
            )
            handles.append(Line2D([], [], color=color, lw=2.5, label=label))
        handles += [
            Line2D([], [], color="0.3", lw=2.0, label="anonymous (RssAnon+RssShmem)"),
            Line2D([], [], color="0.3", lw=1.6, ls="--", label="file-backed (RssFile)"),
            Line2D([], [], color="0.3", lw=1.2, ls=":", label="session created"),
            Patch(color="0.3", alpha=0.2, label="first run"),
        ]
        ax.set_xlabel("time since session creation started (s)")
        ax.set_ylabel("resident memory (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=min(ax.get_xlim()[0], 0))
        ax.grid(True, alpha=0.3)
        interval = next(r for s in mr.strategies.values() for r in s.runs).sample_interval_s
        ax.set_title(
            f"{mr.name}: resident memory of the process tree\n"
            f"median-peak run of {report.repeat} fresh process(es) per strategy, sampled every "
            f"{interval * 1000:.0f} ms",
            fontsize=11,
        )
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
