"""``ortmem partition``: argument parsing and output, for ``ortmem/cli/`` to wire in::

    p = sub.add_parser("partition", help=...); add_partition_arguments(p); p.set_defaults(func=main_partition)

``ortmem partition MODEL --device NAME=BYTES ... [--stats stats.csv] [--dim NAME=VALUE]... [--by scope|node]
[--out DIR]``: devices in preference order (fastest first); BYTES is an integer with an optional unit
(``512MiB``, ``2GB``, ``1.5GiB``; ``KB/MB/GB/TB`` are powers of 1000, ``KiB/MiB/GiB/TiB`` and the bare
letters ``K/M/G/T`` powers of 1024). Exit codes: 0 planned, 1 nothing fits (the minimum each device
would need is printed), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import sys

from ortmem.base.units import bytes_arg, pair_arg


def _device(text: str) -> tuple[str, int]:
    name, value = pair_arg(text, "NAME=BYTES", at_last=True)  # a node:NAME/DEVICE name may hold "="
    return name, bytes_arg(value)


def _provider(text: str) -> tuple[str, str]:
    return pair_arg(text, "DEVICE=PROVIDER", value_required=True)


def add_partition_arguments(parser: argparse.ArgumentParser) -> None:
    from ortmem.base.units import parse_dim

    parser.add_argument("model", help="path to an .onnx file")
    parser.add_argument("--device", type=_device, action="append", default=[], metavar="NAME=BYTES",
                        help="a device and its memory budget, in preference order (repeatable), e.g. "
                             "--device cuda:0=6GiB --device cpu=32GiB; on a node of a Ray cluster "
                             "node:NODE/DEVICE=BYTES (NODE: the node's ortmem-node label or IP address)")
    parser.add_argument("--ray", metavar="ADDRESS|auto",
                        help="read the nodes of a running Ray cluster (needs ortmem[ray]): without --device every "
                             "alive node is a device node:NODE/cpu with its Ray memory as budget; with --device "
                             "the node names are checked against the cluster")
    parser.add_argument("--ray-fraction", type=float, default=1.0, metavar="F",
                        help="with --ray and no --device: plan for this share of each node's Ray memory (1.0)")
    parser.add_argument("--stats", metavar="CSV", help="measured per-node memory (ortmem stats / ORT's node stats CSV)")
    parser.add_argument("--dim", type=parse_dim, action="append", default=[], metavar="NAME=VALUE",
                        help="value of a symbolic input dimension (repeatable), e.g. --dim batch=1 --dim seq=512")
    parser.add_argument("--by", choices=("scope", "node"), default="scope",
                        help="modules from name scopes (default) or one node each")
    parser.add_argument("--out", metavar="DIR", help="write the stages, weights.bin, plan.json and the report here")
    parser.add_argument("--provider", type=_provider, action="append", default=[], metavar="DEVICE=PROVIDER",
                        help="execution provider for a device (default: from its name; unknown names run on the CPU)")
    parser.add_argument("--cut-slack", type=float, default=0.02, metavar="F",
                        help="share of a device's budget that fewer stages / fewer crossing tensors may cost (0.02)")
    parser.add_argument("--overhead", type=bytes_arg, default=None, metavar="BYTES",
                        help="fixed bytes per stage session (default: measured CPU session cost; 0 elsewhere)")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check CPU stages with the estimator (first-order costs only)")
    parser.add_argument("--weights", choices=("auto", "link", "copy"), default="auto",
                        help="hard-link the source's data file (auto where possible) or copy the weights once")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the report")


def main_partition(args: argparse.Namespace) -> int:
    from ortmem.errors import PlanError
    from ortmem.plan.partition.driver import partition

    devices: dict[str, int] = {}
    for name, b in args.device:
        if name in devices:
            print(f"ortmem partition: device {name!r} given twice", file=sys.stderr)
            return 2
        devices[name] = b
    if args.ray:
        devices, error = _ray_devices(args.ray, devices, args.ray_fraction)
        if error:
            print(f"ortmem partition: {error}", file=sys.stderr)
            return 2
    if not devices:
        print("ortmem partition: give at least one --device NAME=BYTES (or --ray auto)", file=sys.stderr)
        return 2
    try:
        plan = partition(args.model, devices, stats_csv=args.stats, dims=dict(args.dim), by=args.by, out_dir=args.out,
                         providers_per_device=dict(args.provider) or None, cut_slack=args.cut_slack,
                         stage_overhead=args.overhead, verify=not args.no_verify, weights=args.weights)
    except PlanError as e:
        print(f"ortmem partition: {e}", file=sys.stderr)
        if e.needed:
            print("minimum budget per device (the others unchanged):", file=sys.stderr)
            for d, v in e.needed.items():
                print(f"  {d}: {'no budget alone suffices' if v is None else f'{v:,} B'}", file=sys.stderr)
        return 1
    print(plan.to_json() if args.json else plan.report())
    if args.out and not args.json:
        print(f"\nwrote {args.out}: {len(plan.stages)} stage file(s), weights.bin ({plan.weights_mode}), plan.json, "
              "report.txt, report.json")
    return 0


def _ray_devices(address: str, given: dict[str, int], fraction: float) -> tuple[dict[str, int], str | None]:
    """Devices from a running Ray cluster (``--ray``); the optional package is imported only here."""
    from ortmem.plan.partition.devices import split_node

    try:
        from ortmem.plan.partition.ray import cluster_devices, cluster_nodes, connect
        from ortmem.plan.partition.ray.cluster import find_node
    except ImportError as e:
        return given, str(e)
    connect(None if address == "auto" else address)
    nodes = cluster_nodes()
    if not given:
        return cluster_devices(nodes, fraction), None
    unknown = [d for d in given if split_node(d)[0] is not None and find_node(nodes, split_node(d)[0]) is None]
    if unknown:
        return given, (f"no alive Ray node for {unknown}; the cluster's nodes: "
                       + ", ".join(f"{n.name} ({n.ip}, {n.memory_bytes:,} B memory)" for n in nodes))
    return given, None
