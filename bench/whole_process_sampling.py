"""Does ``--whole-process``'s memory sampling move the time it measures?

    python -m bench.whole_process_sampling [--rounds 30] [--code "import onnxruntime"]

Times ``python -c CODE`` through the whole-process launcher (:func:`ortmem.measure.whole_process.time_process`),
alternating sampling every :data:`~ortmem.measure.whole_process.SAMPLE_S` seconds with a period so long
that the launcher samples once; prints fastest, first quartile and median wall of each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from ortmem.measure import whole_process


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--code", default="import onnxruntime")
    args = ap.parse_args(argv)
    sampled, once = whole_process.SAMPLE_S, 1e6
    walls: dict[float, list[float]] = {sampled: [], once: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for period in ((sampled, once) if r % 2 else (once, sampled)):
                whole_process.SAMPLE_S = period
                run, _ = whole_process.time_process(args.code, timeout=600, log_path=os.path.join(tmp, "log"))
                walls[period].append(run.wall_s)
    whole_process.SAMPLE_S = sampled
    for period, label in ((sampled, f"sampled every {sampled * 1000:.0f} ms"), (once, "sampled once")):
        v = sorted(walls[period])
        print(f"{label:22s} fastest {v[0]:.4f} s  q1 {v[len(v) // 4]:.4f} s  median {statistics.median(v):.4f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
