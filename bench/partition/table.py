"""Markdown table of a ``measure.py`` result: per stage, budget, the plan's estimate, measured peaks.

    python -m bench.partition.table bench/partition/p100_qdq_3dev.json
"""
from __future__ import annotations

import json
import sys

MiB = 2**20


def table(path: str) -> str:
    d = json.load(open(path))
    stages = {f"stage {s['index']} ({s['device']})": s for s in d["plan"]["stages"]}
    probes = {r["what"]: r for r in d["probes"]}
    out = ["| stage | device | nodes | weights (MiB, file) | budget | plan's estimate | measured: creation + 1 run "
           "| measured: creation + 3 runs | under budget |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in stages.items():
        r1, r3 = probes.get(name), probes.get(name + ", 3 runs")
        peak1 = r1["peak_above_baseline_bytes"] if r1 else None
        peak3 = r3["peak_above_baseline_bytes"] if r3 else None
        worst = max(x for x in (peak1, peak3) if x is not None)
        budget = r1["budget_bytes"]
        out.append(f"| {s['index']} | {s['device']} | {s['nodes']} ({s['first_node']} .. {s['last_node']}) | "
                   f"{s['weight_bytes'] / MiB:.2f} | {budget / MiB:.2f} | {s['estimated_bytes'] / MiB:.2f} | "
                   f"{peak1 / MiB:.2f} | {'-' if peak3 is None else f'{peak3 / MiB:.2f}'} | "
                   f"{'yes' if worst <= budget else '**no**'} |")
    for name in ("whole model (ortmem)", "pipeline, all stages"):
        r = probes.get(name)
        if r:
            out.append(f"| {name} | | | | | | {r['peak_above_baseline_bytes'] / MiB:.2f} | | |")
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
        print()
