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
                   help="also save ORT's pre-packed weights (model.prepacked.onnx + prepacked.bin): sessions "
                        "on this CPU and onnxruntime version then map them instead of packing onto the heap")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..convert import convert_to
    from ..ortmodel.settings import session_settings
    from ..loader import load
    from ..progress import progress_bar

    with load(args.input) as model, progress_bar("converting") as bar:
        report = convert_to(model, Path(args.output), session_settings(accuracy_level=args.accuracy_level), progress=bar)
    print(report.summary())
    print(f"wrote {Path(args.output) / 'model.onnx'}")
    if args.prepack:
        from ..store.prepacked import save_prepacked

        packed = save_prepacked(Path(args.output))
        print(f"wrote {packed} (pre-packed for this CPU and onnxruntime; load it with plain ORT)"
              if packed else "nothing for ORT to pre-pack")
    return 0
