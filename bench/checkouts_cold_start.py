"""A cold start of two ortmem checkouts side by side, and plain ORT, as whole processes.

    git worktree add /tmp/ortmem-old <commit>
    python -m bench.checkouts_cold_start MODEL /tmp/ortmem-old . --rounds 8

Why: a change to the conversion is judged by what a user's first start costs, and this VM's timings
drift by tens of percent within minutes, so the two versions are measured in the same sitting,
alternated. Each round runs ``python -c "import onnxruntime as o; o.InferenceSession(MODEL)"`` and
``python -c "import ortmem; ortmem.InferenceSession(MODEL)"`` with each checkout on ``PYTHONPATH``,
in an order rotated per round. Each checkout has a cache folder of its own, emptied of converted
entries before every start, with ``sync`` first. A first, unreported round fills each cache's
release probe. Prints fastest and median wall and peak RSS (``os.wait4``, as ``/usr/bin/time``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("old", help="a checkout of ortmem (its root, put on PYTHONPATH)")
    ap.add_argument("new", help="another checkout")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    model = os.path.abspath(args.model)
    runs = {
        "ort": (f"import onnxruntime as o; o.InferenceSession({model!r})", os.path.abspath(args.new)),
        "old": (f"import ortmem; ortmem.InferenceSession({model!r})", os.path.abspath(args.old)),
        "new": (f"import ortmem; ortmem.InferenceSession({model!r})", os.path.abspath(args.new)),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(prefix="ortmem-checkouts-") as work:
        for r in range(args.rounds + 1):
            names = list(runs)
            for name in names[r % 3:] + names[: r % 3]:
                cache = os.path.join(work, name)
                shutil.rmtree(os.path.join(cache, "converted"), ignore_errors=True)
                os.sync()
                code, path = runs[name]
                env = {**os.environ, "ORTMEM_CACHE_DIR": cache, "PYTHONPATH": path}
                start = time.perf_counter()
                proc = subprocess.Popen([sys.executable, "-c", code], env=env)
                _, status, usage = os.wait4(proc.pid, 0)
                wall = time.perf_counter() - start
                if os.waitstatus_to_exitcode(status) != 0:
                    print(f"{name} failed with exit code {os.waitstatus_to_exitcode(status)}", file=sys.stderr)
                    return 1
                if r:
                    results[name].append((wall, usage.ru_maxrss / 1024))
    print(f"{os.path.basename(model)}, {args.rounds} rounds, whole processes, fastest / median")
    for name, values in results.items():
        walls = [w for w, _ in values]
        peaks = [p for _, p in values]
        print(f"{name:4s} wall {min(walls):.3f} / {statistics.median(walls):.3f} s   peak {statistics.median(peaks):.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
