"""Print the allocator-hygiene table of docs/hygiene.md from `ortmem bench --memray --json` reports.

    python docs/scripts/hygiene_table.py run1.json [run2.json ...]
"""
from __future__ import annotations

import statistics
from pathlib import Path
import sys

from ortmem.measure.report import read_json

MiB = 1 << 20


def main(paths: list[str]) -> None:
    print("| model | strategy | peak MiB | resident after creation (anon above baseline) | memray in use after creation | retained | resident / in use |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        report = read_json(path)
        for mr in report.models:
            for name, sr in mr.strategies.items():
                mem = sr.memray_run.memray if sr.memray_run else None
                if not sr.runs or not mem or "in_use_heap_bytes" not in mem:
                    continue
                resident = statistics.median(r.anon_after_create_bytes - r.baseline_anon_bytes for r in sr.runs)
                in_use = mem["in_use_heap_bytes"]
                peak = statistics.median(r.peak_bytes for r in sr.runs)
                print(f"| {Path(mr.model).parent.name}/{mr.name} | {name} | {peak / MiB:.0f} | {resident / MiB:.0f} | {in_use / MiB:.0f} | "
                      f"{(resident - in_use) / MiB:.0f} | {resident / in_use:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
