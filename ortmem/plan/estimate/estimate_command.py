"""``ortmem estimate`` and ``ortmem stats``: argument parsing and output, for ``ortmem/cli/`` to wire in::

    p = sub.add_parser("estimate", help=...); add_estimate_arguments(p); p.set_defaults(func=main_estimate)
    p = sub.add_parser("stats", help=...);    add_stats_arguments(p);    p.set_defaults(func=main_stats)

Both functions take the parsed ``argparse.Namespace`` and return the process exit code.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ortmem.base.units import pair_arg, parse_dim


def _input(text: str) -> tuple[str, str]:
    return pair_arg(text, "NAME=FILE.npy", value_required=True)


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="path to an .onnx file (no weight byte is read)")
    parser.add_argument("--dim", type=parse_dim, action="append", default=[], metavar="NAME=VALUE",
                        help="value of a symbolic input dimension (repeatable), e.g. --dim batch=1 --dim seq=512")
    parser.add_argument("--accuracy-level", type=int, choices=range(5), default=None, metavar="N",
                        help="session.qdq_matmulnbits_accuracy_level ORT will use (0-4; ORT's default is 4)")
    parser.add_argument("--hygiene", action="store_true",
                        help="headline numbers assume allocator hygiene around session creation")
    parser.add_argument("--priority-order", action="store_true",
                        help="ExecutionOrder.PRIORITY_BASED instead of DEFAULT")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def main_estimate(args: argparse.Namespace) -> int:
    from ortmem.plan.estimate.estimator import estimate
    from ortmem.plan.estimate.result import render

    so = None
    if args.priority_order:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    est = estimate(args.model, dims=dict(args.dim), accuracy_level=args.accuracy_level,
                   session_options=so, hygiene=args.hygiene)
    print(est.to_json() if args.json else render(est))
    return 0


def add_stats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="path to an .onnx file")
    parser.add_argument("--input", type=_input, action="append", default=[], metavar="NAME=FILE.npy",
                        help="an input array (repeatable); inputs not given are generated")
    parser.add_argument("--dim", type=parse_dim, action="append", default=[], metavar="NAME=VALUE",
                        help="symbolic dimension for generated inputs")
    parser.add_argument("--runs", type=int, default=1, help="runs to take the maximum over (default 1)")
    parser.add_argument("--out", help="node memory statistics CSV (ORT's format, initializer column filled in)")
    parser.add_argument("--json", dest="out_json", metavar="FILE", help="also write the full record as JSON")


def main_stats(args: argparse.Namespace) -> int:
    from ortmem.plan.estimate.node_stats import stats

    feeds = {name: np.load(path, allow_pickle=False) for name, path in args.input} if args.input else None
    if feeds is not None and args.dim:
        print("ortmem stats: --dim applies only to inputs not given with --input", file=sys.stderr)
    res = stats(args.model, feeds, runs=args.runs, out_csv=args.out, out_json=args.out_json, dims=dict(args.dim))
    M = 1 << 20
    peak = "n/a" if res.activation_peak_bytes is None else f"{res.activation_peak_bytes / M:.2f} MiB"
    print(f"{len(res.rows)} nodes ({res.node_stats_source} node statistics), activation peak (arena) {peak}, "
          f"liveness peak {res.liveness_peak_bytes / M:.2f} MiB"
          + (f", written to {args.out}" if args.out else ""))
    if not args.out and not args.out_json:
        json.dump([r.__dict__ for r in res.rows], sys.stdout, indent=1)
        print()
    return 0
