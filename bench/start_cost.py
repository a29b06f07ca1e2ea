"""What ``ortmem.InferenceSession`` adds to a session's creation, measured inside fresh processes.

    python -m bench.start_cost MODEL [--cache DIR | --fresh] [--repeat 21] [--options]

A whole-process comparison (``ortmem bench MODEL --whole-process``) moves by tens of milliseconds
between rounds on a shared 2-core machine, as much as ortmem's own part of a start that gains nothing.
This times the creation itself, in alternated fresh processes (``sync`` before each, the order
rotated per round), after numpy and onnxruntime are imported (a program imports them either way):

- ``ort``: ``onnxruntime.InferenceSession(MODEL, providers=["CPUExecutionProvider"])``;
- ``ortmem``: ``import ortmem`` and ``ortmem.InferenceSession(MODEL, providers=[...], cache=DIR)``, its
  imports counted, split into the time spent inside ORT's own session creation and ortmem's own part
  (everything else: imports, the decision, the record's or the store's checks, the trim).

``--options`` passes an empty ``SessionOptions()`` to both (ortmem then reads every config key this
release defines). ``--fresh`` gives each ortmem round an empty cache folder of its own (a first start:
the model's record, the store's miss, the work left for after a first run, which none makes here).
Each row gives the fastest and the median of the rounds, and the median of the
rounds' own differences; private memory (``RssAnon``) after creation, both processes' medians. The
cache is used as it is: fill it first (a first start, ``ortmem prepare``) to time a warm start.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
import numpy, onnxruntime
from onnxruntime.capi import onnxruntime_inference_collection as collection

kind, model, cache, with_options = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
inside = [0.0]
create = collection.InferenceSession._create_inference_session

def timed(self, *args, **kwargs):
    t = time.perf_counter()
    try:
        return create(self, *args, **kwargs)
    finally:
        inside[0] += time.perf_counter() - t

collection.InferenceSession._create_inference_session = timed
options = onnxruntime.SessionOptions() if with_options else None
t = time.perf_counter()
if kind == "ort":
    session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    action = "ort"
else:
    import ortmem
    session = ortmem.InferenceSession(model, options, providers=["CPUExecutionProvider"], cache=cache)
    action = session.ortmem_action
total = time.perf_counter() - t
anon = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
print(json.dumps({"total": total, "ort": inside[0], "action": action, "anon_kib": anon}))
"""


def _one(kind: str, model: str, cache: str, with_options: bool) -> dict:
    os.sync()
    done = subprocess.run([sys.executable, "-c", _CHILD, kind, model, cache, "1" if with_options else "0"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.start_cost", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--cache", default=None, help="ortmem's cache folder (default: $ORTMEM_CACHE_DIR's, as a session's)")
    p.add_argument("--repeat", "-n", type=int, default=21, help="rounds (default 21)")
    p.add_argument("--fresh", action="store_true", help="an empty cache folder for each ortmem round (first starts)")
    p.add_argument("--options", action="store_true", help="pass SessionOptions() to both")
    args = p.parse_args(argv)
    if args.fresh and args.cache is not None:
        p.error("--fresh makes its own cache folders: give no --cache")
    if args.cache is None:
        from ortmem.base.child_env import STORE_FOLDER, cache_folder

        args.cache = str(cache_folder() / STORE_FOLDER)
    rows: dict[str, list[dict]] = {"ort": [], "ortmem": []}
    for i in range(args.repeat):
        order = ["ort", "ortmem"] if i % 2 == 0 else ["ortmem", "ort"]
        for kind in order:
            if kind == "ortmem" and args.fresh:
                with tempfile.TemporaryDirectory(prefix="ortmem-start-cost-") as cache:
                    rows[kind].append(_one(kind, args.model, cache, args.options))
            else:
                rows[kind].append(_one(kind, args.model, args.cache, args.options))
        print(f"[{i + 1}/{args.repeat}] ort {rows['ort'][-1]['total'] * 1e3:.1f} ms, ortmem "
              f"{rows['ortmem'][-1]['total'] * 1e3:.1f} ms ({rows['ortmem'][-1]['action']})", file=sys.stderr)
    ort_total = [r["total"] * 1e3 for r in rows["ort"]]
    om_total = [r["total"] * 1e3 for r in rows["ortmem"]]
    om_inside = [r["ort"] * 1e3 for r in rows["ortmem"]]
    om_own = [t - o for t, o in zip(om_total, om_inside)]
    diff = [a - b for a, b in zip(om_total, ort_total)]
    actions = sorted({r["action"] for r in rows["ortmem"]})

    def line(name: str, values: list[float]) -> str:
        return f"{name:<34} {min(values):8.1f} {statistics.median(values):8.1f}"

    print(f"{args.model}: {args.repeat} rounds, {'SessionOptions()' if args.options else 'no SessionOptions'}, "
          f"{'an empty cache each round' if args.fresh else 'cache ' + args.cache}, ortmem_action {', '.join(actions)}")
    print(f"{'ms':<34} {'fastest':>8} {'median':>8}")
    print(line("ORT: creation", ort_total))
    print(line("ortmem: creation, imports counted", om_total))
    print(line("  of which inside ORT's creation", om_inside))
    print(line("  of which ortmem's own", om_own))
    print(f"{'ortmem - ORT, per round (median)':<34} {statistics.median(diff):17.1f}")
    anon_ort = statistics.median(r["anon_kib"] for r in rows["ort"]) / 1024
    anon_om = statistics.median(r["anon_kib"] for r in rows["ortmem"]) / 1024
    print(f"private memory after creation (median MiB): ORT {anon_ort:.1f}, ortmem {anon_om:.1f} ({anon_om - anon_ort:+.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
