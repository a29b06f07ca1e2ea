"""``ortmem doctor``: what ortmem sees on this machine — the first thing to paste into a bug report.

One screen: ortmem and Python, the installed ONNX Runtime (release, build, providers) against the
tested range, what the release probe allows ortmem to convert (and every variant it leaves to ORT,
with the reason), the cache folder and its health, and whether allocator hygiene is active.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any


def report(*, refresh: bool = False) -> dict[str, Any]:
    """Everything ``ortmem doctor`` prints, as a dict (``--json``)."""
    import onnxruntime as ort

    from . import __version__
    from .hygiene import allocator
    from .ortmodel.release import capabilities

    caps = capabilities(refresh=refresh)
    return {
        "ortmem": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "onnxruntime": {"version": ort.__version__, "device": ort.get_device(),
                        "providers": ort.get_available_providers()},
        "capabilities": caps.as_dict(),
        "cache": _cache_health(),
        "allocator_hygiene": allocator() or "inactive (not glibc)",
    }


def _cache_health() -> dict[str, Any]:
    from .cache import Cache, cache_root
    from .errors import CacheError
    from .filetrust import untrusted_reason

    try:
        root = cache_root()
    except OSError as exc:
        return {"path": os.environ.get("ORTMEM_CACHE_DIR", "(user cache dir)"), "usable": False, "problem": str(exc)}
    problems = [p for p in (untrusted_reason(root),) if p]
    if not os.access(root, os.W_OK):
        problems.append("not writable")
    try:
        entries = list(Cache().entries())  # the converted models, under <root>/converted
    except CacheError as exc:
        problems.append(str(exc))
        entries = []
    return {"path": str(root), "usable": not problems, "problem": "; ".join(problems) or None,
            "entries": len(entries), "bytes": sum(e.size_bytes() for e in entries)}


def render(r: dict[str, Any]) -> str:
    caps = r["capabilities"]
    lo, hi = caps["supported_range"]
    lines = [
        f"ortmem {r['ortmem']}  (Python {r['python']}, {r['platform']})",
        f"onnxruntime {r['onnxruntime']['version']} ({r['onnxruntime']['device']}; build {caps['build']})",
        f"  providers: {', '.join(r['onnxruntime']['providers'])}",
        f"  supported range {lo}-{hi}.x, tested on {', '.join(caps['tested_releases'])}: "
        + ("in range" if caps["convert"] or caps["source"] == "probe" else "OUT OF RANGE or not probed"),
        f"capabilities ({caps['source']}): conversion {'on' if caps['convert'] else 'off'}; DQ block sizes fused up to "
        f"{caps['fusion_block_max'] if caps['fusion_block_max'] < 1 << 30 else 'any'}, converted up to "
        f"{caps['convert_block_max']}; pre-packed weights {'saved' if caps['prepacked_save'] else 'not used'}"
        + (" (ORT re-packs and compares them on reload)" if caps["prepacked_validated"] else ""),
    ]
    refused = [(k, v["why"]) for kind in ("matmul", "gather") for k, v in caps[kind].items() if not v["ok"]]
    lines.append(f"  variants left to ORT: {len(refused)}" + (":" if refused else ""))
    lines += [f"    {k}: {why}" for k, why in refused]
    lines += [f"  note: {n}" for n in caps["notes"]]
    c = r["cache"]
    if c.get("usable"):
        lines.append(f"cache {c['path']}: {c['entries']} entries, {c['bytes'] / 2**20:.1f} MiB")
    else:
        lines.append(f"cache {c['path']}: NOT USABLE ({c['problem']}); sessions convert in memory or fall back to ORT")
    lines.append(f"allocator hygiene: {r['allocator_hygiene']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--probe", action="store_true", help="ask the installed onnxruntime again (ignore the cached answers)")


def main(args: argparse.Namespace) -> int:
    r = report(refresh=args.probe)
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0
