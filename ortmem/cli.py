"""The ``ortmem`` command: one subcommand per stage, each implemented by the module that owns it."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from .errors import OrtmemError


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspection import inspect_model, render
    from .loader import load

    path = args.model
    if args.demo:
        path = _demo_model_path()
    if path is None:
        print("ortmem inspect: give a MODEL path or --demo", file=sys.stderr)
        return 2
    with load(path) as model:
        ins = inspect_model(model)
    print(ins.to_json() if args.json else render(ins))
    return 0


def _demo_model_path() -> str:
    from .cache import cache_root
    from .synth import SynthConfig, cached_model

    return str(cached_model(SynthConfig.demo(), cache_root() / "synth"))


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="what a model holds and what loading it will cost (reads no weights)")
    p.add_argument("model", nargs="?", help="path to an .onnx file")
    p.add_argument("--demo", action="store_true", help="inspect the built-in synthetic int4 QDQ model (generated once)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)


SUBCOMMANDS: list[Callable] = [_add_inspect]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortmem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OrtmemError as e:
        print(f"ortmem: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
