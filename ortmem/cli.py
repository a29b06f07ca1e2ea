"""The ``ortmem`` command: one subcommand per stage, each implemented by the module that owns it."""
from __future__ import annotations

import argparse
import importlib
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
        ins = inspect_model(model, dims=dict(args.dim))
    print(ins.to_json() if args.json else render(ins))
    return 0


def _demo_model_path() -> str:
    from .measure.bench import demo_model

    return demo_model()


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="what a model holds and what loading it will cost (reads no weights)")
    p.add_argument("model", nargs="?", help="path to an .onnx file")
    p.add_argument("--demo", action="store_true", help="inspect the built-in synthetic int4 QDQ model (generated once)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--dim", action="append", default=[], type=parse_dim, metavar="NAME=VALUE",
                   help="size of a symbolic input dimension for the estimate")
    p.set_defaults(func=_cmd_inspect)


def parse_dim(text: str) -> tuple[str, int]:
    from .plan.estimate_cli import parse_dim as parse

    return parse(text)


def _cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .convert import convert_to, settings_from
    from .loader import load
    from .progress import progress_bar

    with load(args.input) as model, progress_bar("converting") as bar:
        report = convert_to(model, Path(args.output), settings_from(accuracy_level=args.accuracy_level), progress=bar)
    print(report.summary())
    print(f"wrote {Path(args.output) / 'model.onnx'}")
    if args.prepack:
        from .prepacked import save_prepacked

        packed = save_prepacked(Path(args.output))
        print(f"wrote {packed} (pre-packed for this CPU and onnxruntime; load it with plain ORT)"
              if packed else "nothing for ORT to pre-pack")
    return 0


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="rewrite DQ+MatMul into MatMulNBits offline (model.onnx + weights.bin)")
    p.add_argument("input", help="QDQ .onnx model")
    p.add_argument("output", help="output folder (created; must not exist or be empty)")
    p.add_argument("--accuracy-level", type=int, default=None, choices=range(5), metavar="N",
                   help="MatMulNBits accuracy_level (default 4, as ORT's own fusion)")
    p.add_argument("--prepack", action="store_true",
                   help="also save ORT's pre-packed weights (model.prepacked.onnx + prepacked.bin): sessions "
                        "on this CPU and onnxruntime version then map them instead of packing onto the heap")
    p.set_defaults(func=_cmd_convert)


def _cmd_cache(args: argparse.Namespace) -> int:
    from .cache import Cache
    from .prepacked import PREPACKED_MANIFEST

    cache = Cache()
    if args.action == "clear":
        freed = cache.clear()
        print(f"cleared {cache.root} ({freed / 2**20:.1f} MiB)")
        return 0
    if args.action == "prune":
        if args.max_size is None:
            print("ortmem cache prune: give --max-size (e.g. 20GiB)", file=sys.stderr)
            return 2
        freed = cache.prune(args.max_size)
        print(f"pruned {cache.root} to {args.max_size / 2**20:.1f} MiB ({freed / 2**20:.1f} MiB freed)")
        return 0
    if args.action == "verify":
        return _verify_cache(cache)
    rows = list(cache.entries())
    print(f"{cache.root}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}")
    for e in rows:
        try:
            source = e.manifest().get("source", "?")
        except (OSError, ValueError):
            source = "(unreadable manifest)"
        packed = "  (+ pre-packed weights)" if (e.path / PREPACKED_MANIFEST).exists() else ""
        print(f"  {e.key}  {e.size_bytes() / 2**20:9.1f} MiB  {source}{packed}")
    return 0


def _verify_cache(cache) -> int:
    """``ortmem cache verify``: every entry (and its pre-packed weights) digested in full; damaged
    ones are removed so the next session rebuilds them. Exit status 1 when any was damaged."""
    from .prepacked import PREPACKED_MANIFEST, discard_prepacked, verify_prepacked

    rows = list(cache.entries())
    damaged = 0
    for e in rows:
        problem = cache.verify(e, mode="full")
        if problem is not None:
            cache.discard(e)
        elif (e.path / PREPACKED_MANIFEST).exists():
            packed = verify_prepacked(e.path, "full")
            if packed is not None:
                problem = f"pre-packed weights: {packed}"
                discard_prepacked(e.path)
        damaged += problem is not None
        print(f"  {e.key}  {'ok' if problem is None else 'DAMAGED, removed: ' + problem}")
    print(f"{cache.root}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}, {damaged} damaged")
    return 1 if damaged else 0


def _add_cache(sub) -> None:
    from .units import bytes_arg

    p = sub.add_parser("cache", help="list, prune, clear or verify (in full) converted models in the cache ($ORTMEM_CACHE_DIR)")
    p.add_argument("action", choices=["list", "prune", "clear", "verify"])
    p.add_argument("--max-size", type=bytes_arg, default=None, metavar="BYTES",
                   help="prune: remove least recently used entries until the rest fit (e.g. 20GiB); "
                        "$ORTMEM_CACHE_MAX_SIZE applies the same limit after every new entry")
    p.set_defaults(func=_cmd_cache)


#: Subcommands whose arguments and main live in the module that owns the stage:
#: (name, module, add-arguments function, main function, help).
DELEGATED = [
    ("doctor", "ortmem.doctor", "add_arguments", "main",
     "installed onnxruntime, what ortmem may convert on it, cache health (paste into bug reports)"),
    ("bench", "ortmem.measure.bench", "add_arguments", "main",
     "measure session creation (memory, time) per strategy, each in fresh processes"),
    ("estimate", "ortmem.plan.estimate_cli", "add_estimate_arguments", "main_estimate",
     "predict session-creation and activation memory from metadata alone"),
    ("stats", "ortmem.plan.estimate_cli", "add_stats_arguments", "main_stats",
     "run the model and record per-node memory (ORT's CSV format)"),
    ("partition", "ortmem.plan.partition_cli", "add_partition_arguments", "main_partition",
     "split a model over devices with memory budgets (stages + plan.json)"),
    ("recompute", "ortmem.plan.recompute_cli", "add_recompute_arguments", "main_recompute",
     "lower the activation peak: recompute cheap tensors, reorder nodes"),
    ("run", "ortmem.launcher", "add_arguments", "main",
     "run an unmodified Python program with every ORT session it creates going through ortmem"),
]


def _delegate(name: str, module: str, add: str, run: str, help: str) -> Callable:
    def add_parser(sub) -> None:
        owner = importlib.import_module(module)
        p = sub.add_parser(name, help=help)
        getattr(owner, add)(p)
        p.set_defaults(func=getattr(owner, run))

    return add_parser


SUBCOMMANDS: list[Callable] = [_add_inspect, _add_convert, _add_cache] + [_delegate(*d) for d in DELEGATED]


def _version_line() -> str:
    import onnxruntime as ort

    from . import __version__
    from .ortmodel.release import SUPPORTED, TESTED_RELEASES, installed

    lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
    state = "in range" if installed().supported else "OUT OF RANGE: zero-copy loading only"
    return (f"ortmem {__version__}; onnxruntime {ort.__version__} ({state}; supported {lo}-{hi}.x, "
            f"tested {', '.join(TESTED_RELEASES)})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ortmem",
        description="Own the memory of ONNX model weights around ONNX Runtime: load without copies, "
        "fuse QDQ models into MatMulNBits, measure and plan memory.",
    )
    parser.add_argument("--version", action="version", version=_version_line())
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
