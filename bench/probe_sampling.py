"""Does the probe's memory sampling move the init it measures, and does a probe agree with a whole process?

    python -m bench.probe_sampling MODEL [--rounds 6] [-s twin -s ortmem-warm]

Why: in one cross-check (docs/benchmarks.md, session 15) the twin's probe init came out above its
whole-process init~ while the warm start's came out below, which would flatter ortmem against the twin
in the bench if it held. A probe's parent samples the child's ``/proc`` every 10 ms from a thread; a
whole process is sampled every 5 ms by a small launcher. Each round, per strategy (order reversed every
other round), back to back: a probe sampled every 10 ms and one sampled every 0.5 s (order alternated),
then the strategy's whole process and a bare ``import onnxruntime`` (its wall subtracted: ``init~``).
Each strategy is prepared once. Prints every round, then fastest and median of each column.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from ortmem.measure.probe import prepare, probe
from ortmem.measure.strategies import get_strategy, whole_process_code
from ortmem.measure.whole_process import BARE_CODE, time_process

INTERVALS = (0.01, 0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-s", "--strategy", action="append", dest="strategies")
    args = ap.parse_args(argv)
    names = args.strategies or ["twin", "ortmem-warm"]
    samples: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="probe-sampling-") as work:
        prepared = {s: prepare(get_strategy(s), args.model, options={}, workdir=tempfile.mkdtemp(dir=work))
                    for s in names}
        for r in range(args.rounds):
            for s in names if r % 2 == 0 else names[::-1]:
                for interval in INTERVALS if r % 2 == 0 else INTERVALS[::-1]:
                    result = probe(s, args.model, options={}, sample_interval=interval, prepared=prepared[s], workdir=work)
                    samples.setdefault((s, f"probe every {interval} s"), []).append(result.create_wall_s)
                code = whole_process_code(get_strategy(s), prepared[s].model_path, {})
                run, _ = time_process(code, timeout=600, log_path=os.path.join(work, "whole.log"))
                bare, _ = time_process(BARE_CODE, timeout=600, log_path=os.path.join(work, "bare.log"))
                samples.setdefault((s, "whole process init~"), []).append(run.wall_s - bare.wall_s)
            print(f"round {r + 1}: " + ", ".join(f"{s} {label} {v[-1]:.3f}" for (s, label), v in samples.items()),
                  flush=True)
    for (s, label), v in samples.items():
        print(f"{s:14s} {label:22s} fastest {min(v):.3f} s  median {statistics.median(v):.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
