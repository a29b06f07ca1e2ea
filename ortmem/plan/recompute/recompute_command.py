"""``ortmem recompute``: argument parsing and output, for ``ortmem/cli/`` to wire in::

    p = sub.add_parser("recompute", help=...); add_recompute_arguments(p); p.set_defaults(func=main_recompute)

``ortmem recompute MODEL [--dim NAME=VALUE]... [--budget BYTES | --plan PLAN] [--order] [--expensive]
[-o OUT] [--no-optimize] [--no-verify] [--force] [--json]``

Without ``-o`` it prints the summary (nothing is written). With ``-o`` it writes the rewritten model:

1. unless ``--no-optimize``, ONNX Runtime writes the graph it will execute (``ORT_ENABLE_EXTENDED``)
   to OUT, its initializers to ``OUT.data`` (:func:`ortmem.plan.estimate.liveness.ort_optimized`): node order
   and fusions are only predictable on that graph;
2. the plan is made on it and applied; OUT gets the new node list and, in ``metadata_props``, the
   settings ORT must use (``ortmem.recompute.execution_order``, ``.disabled_optimizers``);
3. unless ``--no-verify``, both models are measured under ORT's defaults in fresh processes
   (:func:`ortmem.plan.recompute.verify`); a rewrite whose default peak is higher than the model's
   is refused (OUT removed, exit code 3) unless ``--force``.

Exit codes: 0 written (or nothing worth writing: the summary says so and OUT is not created), 2 usage,
3 refused by the guard.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from ortmem.base.units import bytes_arg
from ortmem.base.units import parse_dim


def add_recompute_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="path to an .onnx file")
    parser.add_argument("--dim", type=parse_dim, action="append", default=[], metavar="NAME=VALUE",
                        help="value of a symbolic input dimension (repeatable): tensor sizes, hence the plan, depend on it")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--budget", type=bytes_arg, metavar="BYTES",
                      help="stop once the predicted activation peak is at most this (e.g. 64MiB); default: as low as it gets")
    what.add_argument("--plan", metavar="PLAN", help="apply exactly this plan (PATTERN+:1:COUNT,... from the summary)")
    parser.add_argument("--order", action="store_true",
                        help="also apply the peak-minimizing node order (the model then runs with PRIORITY_BASED)")
    parser.add_argument("--expensive", action="store_true",
                        help="allow recomputing MatMul, Softmax, LayerNorm, reductions, Conv")
    parser.add_argument("-o", "--output", metavar="OUT", help="write the rewritten model here (weights to OUT.data)")
    parser.add_argument("--no-optimize", dest="optimize", action="store_false",
                        help="plan on the graph as given instead of ORT's optimized graph (exact only at ORT_DISABLE_ALL)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip measuring both models under ORT's defaults before keeping OUT")
    parser.add_argument("--verify-runs", type=int, default=3, metavar="N", help="runs per measured process (default 3)")
    parser.add_argument("--force", action="store_true", help="keep OUT even when the guard measures a higher default peak")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the summary")


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _write_as_given(model_path: Path, out: Path, new_model) -> None:
    """Save ``new_model`` (the original with a new node list) at ``out``; external data files it refers
    to are hard-linked (or copied) next to it when ``out`` lives in another folder."""
    import onnx

    from ortmem.onnxfile.walk import external_data_dict, is_external, iter_tensor_sites

    out.parent.mkdir(parents=True, exist_ok=True)
    if out.parent.resolve() != model_path.parent.resolve():
        for site in iter_tensor_sites(new_model):
            t = site.tensor
            if is_external(t):
                loc = external_data_dict(t).get("location", "")
                if loc:
                    (out.parent / loc).parent.mkdir(parents=True, exist_ok=True)
                    _link_or_copy(model_path.parent / loc, out.parent / loc)
    onnx.save(new_model, out)


def main_recompute(args: argparse.Namespace) -> int:
    import onnx

    from ortmem.plan.estimate.liveness import ort_optimized
    from ortmem.plan.recompute.guard import verify
    from ortmem.plan.recompute.planner import materialize, plan, render

    model_path = Path(args.model)
    dims = dict(args.dim)
    out = Path(args.output) if args.output else None
    analysed = model_path
    if args.optimize:
        target = out if out is not None else None
        if target is None:
            import tempfile

            tmpdir = tempfile.mkdtemp(prefix="ortmem-recompute-")
            target = Path(tmpdir) / "model.onnx"
        target.parent.mkdir(parents=True, exist_ok=True)
        ort_optimized(model_path, target)
        analysed = target
    result = plan(str(analysed), dims, budget=args.budget, plan_text=args.plan, order=args.order,
                     expensive=args.expensive)
    verdict = None
    status = 0
    if out is not None:
        if not result.changed:
            result.notes.append(f"nothing worth applying: {out} not written")
            _remove(out, optimized=args.optimize)
        else:
            if args.optimize:
                full = onnx.load(analysed, load_external_data=False)
                onnx.save(materialize(result, full), out)
            else:
                _write_as_given(model_path, out, materialize(result, onnx.load(model_path, load_external_data=False)))
            if args.verify:
                verdict = verify(model_path, out, dims, runs=args.verify_runs)
                result.notes.append(
                    f"guard (ORT defaults, {args.verify_runs} runs, fresh processes): model "
                    f"{_mib(verdict.original_bytes)} MiB, rewritten {_mib(verdict.rewritten_bytes)} MiB -> "
                    + ("kept" if verdict.ok else ("KEPT ANYWAY (--force)" if args.force else "REFUSED, OUT removed")))
                if not verdict.ok and not args.force:
                    _remove(out, optimized=args.optimize)
                    status = 3
            if status == 0:
                result.notes.append(f"wrote {out}; run it with {result.session_changes()}")
    elif args.optimize:
        shutil.rmtree(Path(analysed).parent, ignore_errors=True)
    if args.json:
        d = result.to_dict()
        if verdict is not None:
            d["verify"] = {"original_bytes": verdict.original_bytes, "rewritten_bytes": verdict.rewritten_bytes,
                           "ok": verdict.ok}
        print(json.dumps(d, indent=2))
    else:
        print(render(result))
    return status


def _mib(vals: list[int]) -> str:
    import statistics

    return f"{statistics.median(vals) / 2**20:.1f}"


def _remove(out: Path, *, optimized: bool) -> None:
    for p in (out, Path(str(out) + ".data")) if optimized else (out,):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


if __name__ == "__main__":  # pragma: no cover - ortmem/cli/recompute.py wires this in
    ap = argparse.ArgumentParser(prog="ortmem recompute", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recompute_arguments(ap)
    sys.exit(main_recompute(ap.parse_args()))
