"""``ortmem inspect``: what a model holds and what loading it will cost (reads no weights)."""
from __future__ import annotations

import argparse
import sys

from ortmem.base.units import parse_dim

NAME = "inspect"
HELP = "what a model holds and what loading it will cost (reads no weights)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="path to an .onnx file")
    p.add_argument("--demo", action="store_true", help="inspect the built-in synthetic int4 QDQ model (generated once)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--dim", action="append", default=[], type=parse_dim, metavar="NAME=VALUE",
                   help="size of a symbolic input dimension for the estimate")


def run(args: argparse.Namespace) -> int:
    from ortmem.plan.inspection import inspect_model, render
    from ortmem.onnxfile.loader import load

    path = args.model
    if args.demo:
        from ortmem.measure.bench import demo_model

        path = demo_model()
    if path is None:
        print("ortmem inspect: give a MODEL path or --demo", file=sys.stderr)
        return 2
    with load(path) as model:
        ins = inspect_model(model, dims=dict(args.dim))
    print(ins.to_json() if args.json else render(ins))
    return 0
