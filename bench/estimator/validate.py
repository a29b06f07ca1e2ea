"""Predicted vs measured for the validation models: the table in docs/estimator.md.

    python -m bench.estimator.validate MEASUREMENTS.jsonl MODELS_DIR [--json OUT.json] [--act-seq 64]

Memory: medians over the repeats in MEASUREMENTS (bench/estimator/measure.py), absolute RSS in MiB
(process baseline included), error = predicted / measured - 1. Strategies (measure.py): ``ort``,
``ort-hygiene``, ``ortmem-warm`` (the hook loading the twin: a warm start without pre-packed weights;
``ortmem.*``), ``ortmem-cold`` (the first start, empty cache; ``ortmem_cold.*``) and ``ortmem-prepacked`` (the default warm start, pre-packed
weights mapped from the entry; ``ortmem_prepacked.*``). Activations: the estimator's
``activation_peak_bytes`` vs ``ortmem.plan.estimate.node_stats`` (ORT's arena counters from its profiler) on the
same inputs (``batch`` ``--act-batch``, sequence ``--act-seq``, generated ids). Measured = tensor bytes
alive per ORT's profiled ``output_size`` (aliases shared); the arena's in-use peak is shown beside it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

CALIB = {"fp16cast_emb", "fp16cast_ext", "tiny_qdq_ext", "tiny_nat_ext", "cal_qdq_ext", "cal_qdq_emb"}
M = 1 << 20


def main(argv: list[str] | None = None) -> int:
    from ortmem.plan.estimate import estimate
    from ortmem.plan.estimate.node_stats import stats

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("measurements")
    p.add_argument("models")
    p.add_argument("--json")
    p.add_argument("--act-seq", type=int, default=64)
    p.add_argument("--act-batch", type=int, default=16, help="'batch' (conv, control flow, Llama) for activations")
    p.add_argument("--include-calibration", action="store_true")
    p.add_argument("--no-activations", action="store_true")
    p.add_argument("--only", nargs="*", help="re-validate these models; the other records of --json are kept")
    args = p.parse_args(argv)
    rows = [json.loads(x) for x in open(args.measurements) if x.strip()]
    names = sorted({r["model"] for r in rows if args.include_calibration or r["model"] not in CALIB})
    if args.only:
        names = [n for n in names if n in args.only]
    dims = {"batch": 1, "seq": 8, "batch_size": 1, "sequence_length": 8, "sequence": 8}
    act_dims = {"batch": args.act_batch, "seq": args.act_seq, "batch_size": 1, "sequence_length": args.act_seq,
                "sequence": args.act_seq}
    out = []
    print("| model | ORT peak meas / pred | err | ORT steady meas / pred | err | +hygiene peak | err | +hygiene steady | err "
          "| ortmem peak | err | ortmem steady | err | pre-packed peak | err | pre-packed steady | err "
          "| cold peak | err | cold steady | err | activations meas / pred | err |")
    print("|---" * 25 + "|")
    for name in names:
        path = Path(args.models) / name / "model.onnx"
        e = estimate(path, dims=dims)
        rec: dict = {"model": name}

        def med(strategy: str, key: str):
            v = [r[key] for r in rows if r["model"] == name and r["strategy"] == strategy]
            return (statistics.median(v), min(v), max(v)) if v else None

        cells = []
        for strategy, side_peak, side_steady in (
            ("ort", e.ort.session_peak_bytes_without_hygiene, e.ort.steady_bytes_without_hygiene),
            ("ort-hygiene", e.ort.session_peak_bytes_with_hygiene, e.ort.steady_bytes_with_hygiene),
            ("ortmem-warm", e.ortmem.session_peak_bytes_without_hygiene, e.ortmem.steady_bytes_without_hygiene),
            ("ortmem-prepacked", e.ortmem_prepacked.session_peak_bytes_without_hygiene,
             e.ortmem_prepacked.steady_bytes_without_hygiene),
            ("ortmem-cold", e.ortmem_cold.session_peak_bytes_without_hygiene, e.ortmem_cold.steady_bytes_without_hygiene),
        ):
            for key, pred in (("peak_create", side_peak), ("steady", side_steady)):
                m = med(strategy, key)
                if m is None:
                    cells += ["-", "-"]
                    continue
                err = pred / m[0] - 1
                spread = f" ({m[1] / M:.0f}-{m[2] / M:.0f})" if m[2] - m[1] > 0.03 * m[0] else ""
                cells += [f"{m[0] / M:.0f}{spread} / {pred / M:.0f}", f"{err:+.1%}"]
                rec[f"{strategy}.{key}"] = {"measured": m[0], "min": m[1], "max": m[2], "predicted": pred, "error": err}
        if args.no_activations:
            cells += ["-", "-"]
        else:
            ea = estimate(path, dims=act_dims)
            s = stats(path, dims=act_dims, runs=1)
            meas = s.liveness_peak_bytes
            arena = s.activation_peak_bytes
            err = ea.activation_peak_bytes / meas - 1 if meas else float("nan")
            arena_txt = f"{arena / M:.2f}" if arena is not None else "n/a"
            cells += [f"{meas / M:.2f} / {ea.activation_peak_bytes / M:.2f} (arena {arena_txt})", f"{err:+.1%}"]
            rec["activations"] = {"measured": meas, "arena": arena,
                                  "predicted": ea.activation_peak_bytes, "error": err,
                                  "unknown_shapes": len(ea.unknown_shapes)}
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        out.append(rec)
    if args.json:
        if args.only and Path(args.json).exists():
            redone = {r["model"] for r in out}
            out = sorted([r for r in json.loads(Path(args.json).read_text()) if r["model"] not in redone] + out,
                         key=lambda r: r["model"])
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
