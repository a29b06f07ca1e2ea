"""Partition a synthetic Llama model for budgets "as if separate devices", check the pipeline's outputs
against the unpartitioned model, and measure each stage's session in a fresh process.

    python -m bench.partition.measure $WORK --config p100 --dims batch=1,seq=64 \\
        --device dev0=52MiB --device dev1=48MiB --device cpu=400MiB --json bench/partition/results.json

For every stage, one probe (``ortmem.measure.probe``) creates that stage's ``ortmem.InferenceSession``
(cache hit: the cache is filled by the unmeasured prepare step) and runs it once on generated inputs;
the peak is the child's ``VmHWM`` over creation and the run, above the RSS it had after its imports
(``peak_above_baseline_bytes``), which is what the stage's budget is compared with. The whole model
through ``ortmem.InferenceSession`` and the whole pipeline in one process are measured the same way,
and their output hashes compared. One probe at a time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
STRATS = str(HERE / "strategies.py")
MiB = 2**20

CONFIGS = {
    "tiny": dict(hidden=128, intermediate=352, layers=2, vocab=1000, heads=4),
    "p100": dict(hidden=1024, intermediate=2816, layers=8, vocab=8000, heads=16),  # 0.10 GB of weights
    "demo": dict(hidden=2048, intermediate=5632, layers=8, vocab=32000, heads=16),  # 0.56 GB
}


def parse_bytes(text: str) -> int:
    from ortmem.base.units import parse_bytes as pb

    return pb(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="p100")
    ap.add_argument("--form", choices=("qdq", "native"), default="qdq")
    ap.add_argument("--device", action="append", default=[], metavar="NAME=BYTES")
    ap.add_argument("--dims", default="batch=1,seq=64")
    ap.add_argument("--by", default="scope")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--three-runs", action="store_true", help="also measure each stage over creation + 3 runs")
    args = ap.parse_args(argv)

    from ortmem.measure.probe import probe
    from ortmem.measure.strategies import Strategy
    from ortmem.plan.partition import partition
    from ortmem.plan.partition.run.pipeline_session import PipelineSession
    from ortmem.measure.synth import SynthConfig, cached_model

    dims = {k: int(v) for k, v in (kv.split("=") for kv in args.dims.split(","))}
    devices = {}
    for spec in args.device or ["dev0=52MiB", "dev1=48MiB", "cpu=400MiB"]:
        name, _, b = spec.rpartition("=")
        devices[name] = parse_bytes(b)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = SynthConfig(**CONFIGS[args.config], form=args.form, storage="external", name=f"{args.config}_{args.form}")
    t = time.time()
    model = cached_model(cfg, work / "models")
    print(f"model {model} ({time.time() - t:.1f} s)", flush=True)
    out = work / f"plan-{args.config}-{args.form}"
    providers = {d: "CPUExecutionProvider" for d in devices}  # "as if" separate devices, all on this CPU
    t = time.time()
    plan = partition(model, devices, dims=dims, by=args.by, out_dir=out, providers_per_device=providers)
    plan_s = time.time() - t
    print(plan.report(), flush=True)
    print(f"planned in {plan_s:.2f} s", flush=True)

    # bit-identity in this process (the fresh-process hashes below check it again)
    import onnxruntime as ort

    ids = np.random.default_rng(0).integers(0, cfg.vocab, size=(dims.get("batch", 1), dims.get("seq", 8)), dtype=np.int64)
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    got = PipelineSession(out).run(None, {"input_ids": ids})[0]
    identical = bool(np.array_equal(ref, got))
    print(f"pipeline outputs bit-identical to plain ORT on the whole model: {identical}", flush=True)

    rows = []
    if not args.no_probe:
        opts = {"dims": dims, "int_high": cfg.vocab}

        def measure(label, create, prepare, path, budget=None, estimated=None):
            strat = Strategy(name=label, create=f"{STRATS}:{create}", prepare=f"{STRATS}:{prepare}")
            r = probe(strat, path, options=opts, timeout=1800)
            row = {"what": label, "budget_bytes": budget, "estimated_bytes": estimated,
                   "peak_above_baseline_bytes": r.peak_above_baseline_bytes,
                   "peak_create_above_baseline_bytes": r.peak_create_bytes - r.baseline_rss_bytes,
                   "peak_run_above_baseline_bytes": (r.peak_run_bytes or 0) - r.baseline_rss_bytes,
                   "steady_above_baseline_bytes": r.steady_bytes - r.baseline_rss_bytes,
                   "baseline_rss_bytes": r.baseline_rss_bytes, "create_wall_s": r.create_wall_s,
                   "output_hash": r.output_hash}
            rows.append(row)
            ok = "" if budget is None else ("  under budget" if row["peak_above_baseline_bytes"] <= budget else "  OVER")
            print(f"{label:28} peak {row['peak_above_baseline_bytes'] / MiB:8.2f} MiB"
                  f"{'' if budget is None else f'  budget {budget / MiB:8.2f}'}"
                  f"{'' if estimated is None else f'  estimated {estimated / MiB:8.2f}'}{ok}", flush=True)

        budgets = {d.name: d.budget_bytes for d in plan.devices}
        for st in plan.stages:
            measure(f"stage {st.index} ({st.device})", "stage_session", "prepare_stage", out / st.file,
                    budgets[st.device], st.estimated_bytes)
            if args.three_runs:
                measure(f"stage {st.index} ({st.device}), 3 runs", "stage_session_warmed", "prepare_stage",
                        out / st.file, budgets[st.device], st.estimated_bytes)
        measure("whole model (ortmem)", "whole", "prepare_whole", model)
        measure("pipeline, all stages", "pipeline", "prepare_pipeline", out / "plan.json")
        h = {r["what"]: r["output_hash"] for r in rows}
        print(f"fresh-process output hashes equal (whole vs pipeline): "
              f"{h['whole model (ortmem)'] == h['pipeline, all stages']}", flush=True)

    result = {"config": CONFIGS[args.config], "form": args.form, "dims": dims, "devices": devices, "plan_s": plan_s,
              "bit_identical": identical, "plan": plan.report_dict(), "probes": rows,
              "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])])}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
