"""The long fuzz run: mutated models through ``ortmem.load`` and through both sessions.

    python -m bench.fuzz                         # 100,000 loads + 5,000 sessions (about 10 minutes)
    python -m bench.fuzz --loads 2000 --sessions 200 --seed 3

Prints the counts and every failure (a non-OrtmemError out of ortmem, a model whose validity ortmem
changes, outputs that differ from plain ORT); exits 1 if there is any. The mutations and verdicts
are those of the default test run (tests/support/fuzz_models.py, tests/passes/test_validity.py), only more of them.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.support.fuzz_models import run_fuzz


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=100_000)
    ap.add_argument("--sessions", type=int, default=5_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ortmem-fuzz-") as d:
        loads, sessions = run_fuzz(loads=args.loads, sessions=args.sessions, seed=args.seed, folder=Path(d),
                                   progress=lambda line: print(line, flush=True))
    print(f"onnxruntime {ort.__version__}, seed {args.seed}, {time.perf_counter() - start:.0f} s")
    print(f"ortmem.load: {loads.cases} cases, {loads.accepted} loaded, {loads.refused} OrtmemError, "
          f"{len(loads.failures)} failures")
    print(f"sessions: {sessions.cases} cases, {sessions.accepted} accepted by both ({sessions.converted} converted), "
          f"{sessions.refused} refused by both, {len(sessions.failures)} failures")
    for line in loads.failures + sessions.failures:
        print("  " + line)
    return 1 if loads.failures or sessions.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
