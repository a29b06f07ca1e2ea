"""What ortmem's session path adds to a process before its first session: measured in fresh interpreters.

    python -m bench.estimator.fixed_costs [--repeat 5]

Each child imports numpy, onnxruntime and ``ortmem`` (which loads its exception types only: the
baseline of a plain-ORT program that has ortmem installed and imported), reads ``/proc/self/status``,
imports ``ortmem.session.inference`` (the handoff and the store's lookup: what every first
``ortmem.InferenceSession`` pays, a warm start's whole import, no onnx) and reads it again, then
imports what a start that converts adds (onnx, the loader, the passes, the publisher:
:data:`ortmem.measure.release_probe.CONVERSION_MODULES`) and reads it a third time. The medians are the estimator's
``baseline_bytes`` (for reference: at run time the release probe's figure is used),
``ortmem_import_bytes`` and ``ortmem_convert_import_bytes`` (``calibrate.py`` writes them into
``calibration.json``): the release probe (:func:`ortmem.measure.release_probe.import_baseline_bytes`) measures
the process *with* both, so plain ORT's baseline is that figure minus the two.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from ortmem.measure.release_probe import CONVERSION_MODULES

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
import ortmem.session.inference
after = status()
import importlib
for module in CONVERSION_MODULES:
    importlib.import_module(module)
converting = status()
print(json.dumps({"before": before, "after": after, "converting": converting}))
"""


def measure_imports(repeat: int = 5) -> dict[str, dict[str, int]]:
    """Medians over ``repeat`` fresh interpreters: ``baseline`` (numpy + onnxruntime + ortmem),
    ``session_path`` (what ``import ortmem.session.inference`` adds) and ``conversion`` (what a converting start
    imports beyond it), each as VmRSS / RssAnon / RssFile bytes, plus the spread of each VmRSS."""
    child = f"CONVERSION_MODULES = {CONVERSION_MODULES!r}\n{_CHILD}"
    runs = [json.loads(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(repeat)]
    keys = runs[0]["before"]
    out: dict[str, dict] = {"baseline": {k: int(statistics.median(r["before"][k] for r in runs)) for k in keys}}
    for part, (start, end) in (("session_path", ("before", "after")), ("conversion", ("after", "converting"))):
        grew = [{k: r[end][k] - r[start][k] for k in keys} for r in runs]
        out[part] = {k: int(statistics.median(g[k] for g in grew)) for k in keys}
        out[f"{part}_spread"] = {"VmRSS": [min(g["VmRSS"] for g in grew), max(g["VmRSS"] for g in grew)]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    m = measure_imports(args.repeat)
    mib = 1 << 20
    print(f"fresh interpreters, median of {args.repeat}, MiB")
    for part in ("baseline", "session_path", "conversion"):
        v = m[part]
        print(f"  {part:13s} rss {v['VmRSS'] / mib:6.1f}  private {v['RssAnon'] / mib:6.1f}  shared {v['RssFile'] / mib:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
