"""``ortmem convert``: rewrite DQ+MatMul into MatMulNBits offline (model.onnx + weights.bin)."""
from __future__ import annotations

import argparse

NAME = "convert"
HELP = "rewrite DQ+MatMul into MatMulNBits offline (model.onnx + weights.bin)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="QDQ .onnx model")
    p.add_argument("output", help="output folder (created; must not exist or be empty)")
    p.add_argument("--accuracy-level", type=int, default=None, choices=range(5), metavar="N",
                   help="MatMulNBits accuracy_level (default 4, as ORT's own fusion)")
    p.add_argument("--prepack", action="store_true",
                   help="also save onnxruntime's finished model (finished.onnx + finished.data, its pre-packed "
                        "weights included): sessions on this CPU and onnxruntime version created with "
                        "graph_optimization_level ORT_DISABLE_ALL map them instead of packing onto the heap")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ortmem.session.convert import convert_to
    from ortmem.ort.settings import session_settings
    from ortmem.onnxfile.loader import load
    from ortmem.base.progress import progress_bar

    with load(args.input) as model, progress_bar("converting") as bar:
        report = convert_to(model, Path(args.output), session_settings(accuracy_level=args.accuracy_level), progress=bar)
    print(report.summary())
    print(f"wrote {Path(args.output) / 'model.onnx'}")
    if args.prepack:
        from ortmem.files.layout import FINISHED_STEM, MODEL_FILE
        from ortmem.store.finished import keep_decision_only, finish_model

        out = Path(args.output)
        finished = finish_model(out / MODEL_FILE, out, FINISHED_STEM)
        if finished.useful:
            print(f"wrote {out / (FINISHED_STEM + '.onnx')} (finished for this CPU and onnxruntime; load it with "
                  "plain ORT at graph_optimization_level ORT_DISABLE_ALL)")
        else:
            keep_decision_only(out, FINISHED_STEM)
            print(f"nothing onnxruntime finishes is worth mapping ({finished.refusal or 'nothing packed'})")
    return 0
