"""Predicted vs measured activation savings of ``ortmem recompute`` (docs/recompute.md's table).

    python -m bench.recompute.models $WORK/models
    python -m bench.recompute.measure $WORK/models bench/recompute/results.jsonl --repeat 3 --runs 5
    python -m bench.recompute.measure --table bench/recompute/results.jsonl

Per model and variant (``recompute``: cheap ops, no budget; ``order``: recompute plus the
peak-minimizing order), the original and the rewritten model are measured the same ways, one process
at a time:

Baseline: the model file as given. The plan is made on ORT's optimized graph of it
(``ortmem.plan.estimate.liveness.ort_optimized``), whose node order is the order ORT ran the given file in, so
the predicted "original" is that run. For reference the re-saved optimized graph alone (run with
``DEFAULT``) is measured too.

* **ORT profiling, arena on, memory patterns off** (in this process, ``ORT_ENABLE_ALL``): the arena's
  in-use peak of each run above what it held before the run (``ortmem.plan.estimate.node_stats._arena_peak``), max
  over ``--runs`` runs. This is "ORT profiling's arena peak".
* **ORT defaults** (arena, memory patterns, ``ORT_ENABLE_ALL``), profiling: the first run's in-use peak
  and what the arena holds after ``--runs`` runs (its power-of-two growth and the memory pattern's block).
* **Fresh processes, RSS** (``ortmem.measure.probe``, ``--repeat`` each, medians): resident memory over
  ``--runs`` runs above resident memory after creation, with (a) arena and memory patterns off and
  glibc's thresholds pinned, so resident memory follows the live set (strategy
  ``ortmem.plan.recompute:probe_live``), and (b) ORT's defaults (``probe_default``, what the guard
  ``ortmem.plan.recompute.verify`` measures).

Outputs of the rewritten model are compared with the original's, byte for byte, under ORT's defaults.
Each rewritten model runs with the settings it records (``ortmem.plan.recompute.recorded_settings``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

MiB = 1 << 20


def _feeds(path: str, dims: dict, options: dict) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    from ortmem.ort.feeds import make_inputs

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = make_inputs(sess, {"dims": dims, **options})
    if "attention_mask" in feeds:
        feeds["attention_mask"] = np.ones_like(feeds["attention_mask"])
    return feeds


def arena_profile(path: str, feeds: dict, *, runs: int, pattern: bool) -> dict[str, Any]:
    """Per-run arena in-use peaks (above what the arena held before the run) and the arena held."""
    import onnxruntime as ort

    from ortmem.plan.recompute import apply_session_changes, recorded_settings
    from ortmem.plan.estimate.node_stats import _arena_peak

    with tempfile.TemporaryDirectory(prefix="ortmem-rc-prof-") as tmp:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.enable_mem_pattern = pattern
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "p")
        apply_session_changes(so, recorded_settings(onnx.load(path, load_external_data=False)))
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
        del sess
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = sorted((e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    peaks, held = [], 0
    for r in model_runs:
        evs = [e for e in nodes if r["ts"] <= e["ts"] <= r["ts"] + r.get("dur", 0)]
        p = _arena_peak(evs)
        if p is not None:
            peaks.append(p)
        held = max([held] + [int(e["args"].get("mem_arena_held", 0) or 0) for e in evs])
    return {"peaks": peaks, "held": held}


def same_outputs(a: str, b: str, feeds: dict) -> bool:
    """Outputs of ``b`` (run with the settings it records) equal ``a``'s byte for byte, ORT defaults."""
    import onnxruntime as ort

    from ortmem.plan.recompute import apply_session_changes, recorded_settings

    outs = []
    for p in (a, b):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        apply_session_changes(so, recorded_settings(onnx.load(p, load_external_data=False)))
        outs.append(ort.InferenceSession(p, so, providers=["CPUExecutionProvider"]).run(None, feeds))
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(*outs))


def rss(path: str, strategy: str, dims: dict, options: dict, runs: int, repeat: int) -> dict[str, Any]:
    from ortmem.measure.probe import probe

    vals = []
    for _ in range(repeat):
        r = probe(f"ortmem.plan.recompute:{strategy}", path, options={"dims": dims, "runs": runs, **options})
        vals.append(int(r.peak_run_bytes or 0) - int(r.rss_after_create_bytes))
    return {"median": int(statistics.median(vals)), "all": vals}


def measure_model(name: str, spec: dict, out_dir: Path, *, variants: list[str], runs: int, repeat: int) -> list[dict]:
    from ortmem.plan import recompute as rc

    from ortmem.plan.estimate.liveness import ort_optimized

    path, dims, options = spec["path"], spec["dims"], spec.get("options", {})
    feeds = _feeds(path, dims, options)
    records = []
    base_cache: dict[str, Any] = {}
    opt_path = out_dir / f"{name}.opt.onnx"
    t0 = time.perf_counter()
    opt = ort_optimized(path, opt_path)  # what ORT runs; the rewritten models reference its .data
    optimize_s = time.perf_counter() - t0
    for variant in variants:
        t0 = time.perf_counter()
        res = rc.plan(str(opt_path), dims, order=(variant == "order"))
        plan_s = time.perf_counter() - t0
        rw = out_dir / f"{name}.{variant}.onnx"
        if res.changed:
            onnx.save(rc.materialize(res, opt), rw)
        else:  # nothing worth applying: the CLI writes nothing and the user keeps the file as given
            rw = Path(path)
        (out_dir / f"{name}.{variant}.summary.txt").write_text(rc.render(res) + "\n")
        rec: dict[str, Any] = {
            "model": name, "variant": variant, "dims": dims, "plan": res.plan, "order_applied": res.order_applied,
            "execution_order": res.execution_order, "session_changes": res.session_changes(), "plan_seconds": plan_s,
            "optimize_seconds": optimize_s,
            "predicted": {"original": res.original_peak_bytes, "rewritten": res.peak_bytes, "saved": res.saved_bytes},
            "changed": res.changed,
            "bit_identical": same_outputs(path, str(rw), feeds),
        }
        for key, fn in [
            ("arena_nopattern", lambda p: arena_profile(p, feeds, runs=runs, pattern=False)),
            ("arena_defaults", lambda p: arena_profile(p, feeds, runs=runs, pattern=True)),
            ("rss_live", lambda p: rss(p, "probe_live", dims, options, runs, repeat)),
            ("rss_defaults", lambda p: rss(p, "probe_default", dims, options, runs, repeat)),
        ]:
            if key not in base_cache:  # "file": the model as given (what users run today, the baseline);
                # "original": ORT's optimized graph of it, re-saved, run with DEFAULT (for reference)
                base_cache[key] = (fn(str(opt_path)), fn(path))
            rec[key] = {"original": base_cache[key][0], "file": base_cache[key][1], "rewritten": fn(str(rw))}
        records.append(rec)
        print(_row(rec), flush=True)
    return records


def _value(m: dict, key: str) -> float:
    return (max(m["peaks"]) if key.startswith("arena") else m["median"]) / MiB


def _saved(rec: dict, key: str, base: str = "original") -> tuple[float, float, float]:
    """(baseline, rewritten, saved) in MiB for one measurement."""
    a, b = _value(rec[key][base], key), _value(rec[key]["rewritten"], key)
    return a, b, a - b


def _row(rec: dict) -> str:
    p = rec["predicted"]
    cells = [rec["model"], rec["variant"],
             f"{p['original'] / MiB:.1f} -> {p['rewritten'] / MiB:.1f} (saves {p['saved'] / MiB:.1f}, "
             f"{100 * p['saved'] / max(p['original'], 1):.0f}%)"]
    for key in ("arena_nopattern", "rss_live", "arena_defaults", "rss_defaults"):
        a, b, s = _saved(rec, key, "file")
        cells.append(f"{a:.1f} -> {b:.1f} (saves {s:.1f})")
    held = (rec["arena_defaults"]["file"]["held"] / MiB, rec["arena_defaults"]["rewritten"]["held"] / MiB)
    cells.append(f"{held[0]:.0f} -> {held[1]:.0f}")
    oa, oar = _value(rec["arena_nopattern"]["original"], "arena"), _value(rec["rss_defaults"]["original"], "rss")
    cells.append(f"{oa:.1f} / {oar:.1f}")
    cells.append(("yes" if rec["bit_identical"] else "**NO**") if rec.get("changed", True) else "(nothing written)")
    return "| " + " | ".join(cells) + " |"


HEADER = ("| model | variant | predicted activation peak, MiB | arena peak, patterns off | RSS, arena+patterns off | "
          "arena peak, defaults (1st run) | RSS, defaults (5 runs) | arena held, defaults | ORT-optimized file alone: "
          "arena / RSS defaults | bit-identical |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="?", type=Path, help="folder written by models.py")
    ap.add_argument("out", nargs="?", type=Path, help="JSONL of results (appended)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--variant", action="append", default=[], choices=["recompute", "order"])
    ap.add_argument("--table", type=Path, help="print the markdown table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(HEADER)
        for line in args.table.read_text().splitlines():
            if line.strip():
                print(_row(json.loads(line)))
        return 0
    manifest = json.loads((args.models / "manifest.json").read_text())
    out_dir = args.models / "rewritten"
    out_dir.mkdir(exist_ok=True)
    print(HEADER)
    for name, spec in manifest.items():
        if args.only and name not in args.only:
            continue
        for rec in measure_model(name, spec, out_dir, variants=args.variant or ["recompute", "order"], runs=args.runs,
                                 repeat=args.repeat):
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
