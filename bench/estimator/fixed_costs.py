"""What ortmem's session path adds to a process before its first session: measured in fresh interpreters.

    python -m bench.estimator.fixed_costs [--repeat 5]

Each child imports numpy, onnxruntime and ``ortmem`` (which loads its exception types only: the
baseline of a plain-ORT program that has ortmem installed and imported), reads ``/proc/self/status``,
then imports ``ortmem.session`` (onnx, the loader, the cache, the passes: what a first
``ortmem.InferenceSession`` pays before it does anything) and reads it again. The medians are the
estimator's ``baseline_bytes`` (for reference: at run time the release probe's figure is used) and
``ortmem_import_bytes`` (``calibrate.py`` writes it into ``calibration.json``): the release probe
(:func:`ortmem.release_probe.import_baseline_bytes`) measures the process *with* the session path,
so plain ORT's baseline is that figure minus this one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import json
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out
import numpy, onnxruntime, ortmem
before = status()
import ortmem.session
after = status()
print(json.dumps({"before": before, "after": after}))
"""


def measure_imports(repeat: int = 5) -> dict[str, dict[str, int]]:
    """Medians over ``repeat`` fresh interpreters: ``baseline`` (numpy + onnxruntime + ortmem) and
    ``session_path`` (what ``import ortmem.session`` adds), each as VmRSS / RssAnon / RssFile bytes,
    plus the spread of the session path's VmRSS."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(repeat)]
    grew = [{k: r["after"][k] - r["before"][k] for k in r["before"]} for r in runs]
    keys = runs[0]["before"]
    return {
        "baseline": {k: int(statistics.median(r["before"][k] for r in runs)) for k in keys},
        "session_path": {k: int(statistics.median(g[k] for g in grew)) for k in keys},
        "session_path_spread": {"VmRSS": [min(g["VmRSS"] for g in grew), max(g["VmRSS"] for g in grew)]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    m = measure_imports(args.repeat)
    mib = 1 << 20
    print(f"fresh interpreters, median of {args.repeat}, MiB")
    for part in ("baseline", "session_path"):
        v = m[part]
        print(f"  {part:13s} rss {v['VmRSS'] / mib:6.1f}  private {v['RssAnon'] / mib:6.1f}  shared {v['RssFile'] / mib:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
