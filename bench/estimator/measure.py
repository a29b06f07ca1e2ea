"""Measure what the estimator predicts, with the harness (``ortmem.measure.probe``), one process at a time.

    python -m bench.estimator.measure MODELS_DIR OUT.jsonl [--repeat 3] [--only NAME ...]

For every ``MODELS_DIR/<name>/model.onnx`` and every strategy below, ``--repeat`` fresh-process probes
(heap jitter 0, 24 KiB, 48 KiB, ... as ``ortmem bench`` does, so glibc's layout-dependent modes show
up) append one JSON line each: baseline, session-creation peak (VmHWM), RSS after creation and after
the first run (the steady state), anon/file split. Strategies:

* ``ort``: ``onnxruntime.InferenceSession(path)``, the estimator's ``ort.*_without_hygiene``;
* ``ort-hygiene``: the same inside ``ortmem.base.hygiene.allocator_hygiene()``: ``ort.*_with_hygiene``;
* ``ortmem-warm``: ``ortmem.InferenceSession(..., prepacked=False)`` on a cache hit, i.e. ORT loading
  the entry's native twin (what a cold start hands ORT too): ``ortmem.*``. Rows taken before
  pre-packed warm starts existed measured this same path with default options;
* ``ortmem-cold``: ``ortmem.InferenceSession`` on an empty cache (the first start: digest, type
  resolution, conversion, then ORT on the fresh entry): ``ortmem_cold.*``;
* ``ortmem-prepacked``: ``ortmem.InferenceSession`` on a cache hit with the pre-packed weights saved
  by an earlier hit (the default warm start): ``ortmem_prepacked.*``. Its preparation runs two starts
  (cold, then the first hit, which saves ``prepacked.bin``), so every probe loads the saved blobs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STRATEGIES = {
    "ort": "ort",
    "ort-hygiene": f"{HERE / 'strategies.py'}:create_ort_hygiene",
    "ortmem-warm": "ortmem-warm",
    "ortmem-prepacked": "ortmem-warm",
    "ortmem-cold": "ortmem",
}
#: per-strategy options beside ``dims`` (``create_ortmem_warm`` reads ``prepacked``, default True)
OPTIONS = {"ortmem-warm": {"prepacked": False}}
#: strategies whose cache must be filled first (unmeasured, ``prepare("ortmem-warm")``: cold + first hit)
PREPARE = {"ortmem-warm", "ortmem-prepacked"}
DIMS = {"batch": 1, "seq": 8, "batch_size": 1, "sequence_length": 8, "sequence": 8}


def main(argv: list[str] | None = None) -> int:
    from ortmem.measure.probe import prepare, probe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models")
    p.add_argument("out")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", nargs="*")
    p.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    p.add_argument("--int-high", type=int, help="bound of generated integer inputs (2 for BERT's token_type_ids)")
    args = p.parse_args(argv)
    import onnxruntime

    ort_version = onnxruntime.__version__
    names = sorted(d.name for d in Path(args.models).iterdir() if (d / "model.onnx").exists())
    if args.only:
        names = [n for n in names if n in args.only]
    with open(args.out, "a") as out:
        for name in names:
            path = str(Path(args.models) / name / "model.onnx")
            for strat in args.strategies:
                prepared = None
                options = {"dims": DIMS, **({"int_high": args.int_high} if args.int_high else {}),
                           **OPTIONS.get(strat, {})}
                if strat in PREPARE:
                    import tempfile
                    prepared = prepare("ortmem-warm", path, options=options, workdir=tempfile.gettempdir())
                for rep in range(args.repeat):
                    r = probe(STRATEGIES[strat], path, options=options, heap_jitter=rep * 24 * 1024,
                              prepared=prepared)
                    row = {
                        "model": name, "strategy": strat, "rep": rep,
                        "baseline": r.baseline_rss_bytes, "peak_create": r.peak_create_bytes,
                        "after_create": r.rss_after_create_bytes, "steady": r.steady_bytes,
                        "peak_run": r.peak_run_bytes, "anon_after_create": r.anon_after_create_bytes,
                        "file_after_create": r.file_after_create_bytes, "create_s": r.create_wall_s,
                        "heap_jitter": r.heap_jitter_bytes, "anon_steady": r.anon_after_run_bytes,
                        "baseline_anon": r.baseline_anon_bytes, "baseline_file": r.baseline_file_bytes,
                        "options": {k: v for k, v in options.items() if k != "dims"},
                        "background_peak": r.background_peak_bytes, "onnxruntime": ort_version,
                    }
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    M = 1 << 20
                    print(f"{name:16s} {strat:12s} #{rep} peak {r.peak_create_bytes / M:8.1f} "
                          f"steady {r.steady_bytes / M:8.1f} base {r.baseline_rss_bytes / M:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
