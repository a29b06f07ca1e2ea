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
from typing import Any, Optional


def report(*, refresh: bool = False) -> dict[str, Any]:
    """Everything ``ortmem doctor`` prints, as a dict (``--json``)."""
    import onnxruntime as ort

    from . import __version__
    from .hygiene import allocator
    from .ortmodel.release import capabilities, table_capabilities

    caps = capabilities(refresh=refresh)
    table = table_capabilities(caps.release) if caps.release.supported else None
    return {
        "ortmem": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "onnxruntime": {"version": ort.__version__, "device": ort.get_device(),
                        "providers": ort.get_available_providers()},
        "capabilities": caps.as_dict(),
        # the record of this release's tested behaviour, beside what its probe decided (None: untested)
        "table": table.as_dict() if table is not None else None,
        "cache": _cache_health(),
        "allocator_hygiene": allocator() or "inactive (not glibc)",
    }


def _cache_health() -> dict[str, Any]:
    from .store.cache import Cache, cache_root
    from .store.layout import disk_use
    from .errors import CacheError
    from .helper_env import CACHE_DIR_ENV

    try:
        root = cache_root()
    except OSError as exc:
        return {"path": os.environ.get(CACHE_DIR_ENV, "(user cache dir)"), "usable": False, "problem": str(exc)}
    problems = []  # whether the folder can be trusted is the cache's own judgement (Cache() below)
    if not os.access(root, os.W_OK):
        problems.append("not writable")
    try:
        entries = list(Cache().entries())  # the converted models, under <root>/converted
    except CacheError as exc:
        problems.append(str(exc))
        entries = []
    use, _ = disk_use([e.path for e in entries])  # a hard-linked source counted once, and said to be shared
    return {"path": str(root), "usable": not problems, "problem": "; ".join(problems) or None,
            "entries": len(entries), "bytes": use.bytes, "shared_bytes": use.shared}


def render(r: dict[str, Any]) -> str:
    from .store.layout import DiskUse

    caps = r["capabilities"]
    lo, _ = caps["supported_range"]
    lines = [
        f"ortmem {r['ortmem']}  (Python {r['python']}, {r['platform']})",
        f"onnxruntime {r['onnxruntime']['version']} ({r['onnxruntime']['device']}; build {caps['build']})",
        f"  providers: {', '.join(r['onnxruntime']['providers'])}",
        f"  supported {lo} on (decided by the probe), tested on {', '.join(caps['tested_releases'])}: "
        + ("in range" if caps["convert"] or caps["source"] == "probe" else "OUT OF RANGE or not probed"),
        f"capabilities ({caps['source']}): conversion {'on' if caps['convert'] else 'off'}; DQ block sizes fused up to "
        f"{caps['fusion_block_max'] if caps['fusion_block_max'] < 1 << 30 else 'any'}, converted up to "
        f"{caps['convert_block_max']}; pre-packed weights {'saved' if caps['prepacked_save'] else 'not used'}"
        + (" (ORT re-packs and compares them on reload)" if caps["prepacked_validated"] else ""),
    ]
    refused = [(k, v["why"]) for kind in ("matmul", "gather") for k, v in caps[kind].items() if not v["ok"]]
    lines.append(f"  variants left to ORT: {len(refused)}" + (":" if refused else ""))
    lines += [f"    {k}: {why}" for k, why in refused]
    lines += structure_lines(caps, r.get("table"))
    lines += variant_table(caps, r.get("table"))
    lines += [f"  note: {n}" for n in caps["notes"]]
    c = r["cache"]
    if c.get("usable"):
        lines.append(f"cache {c['path']}: {c['entries']} entries, {DiskUse(c['bytes'], c.get('shared_bytes', 0)).text()}")
    else:
        lines.append(f"cache {c['path']}: NOT USABLE ({c['problem']}); sessions convert in memory or fall back to ORT")
    lines.append(f"allocator hygiene: {r['allocator_hygiene']}")
    return "\n".join(lines)


#: The release-wide facts the probe measures besides the variants (``Capabilities`` fields).
STRUCTURE_FIELDS = ("fusion_block_max", "convert_block_max", "shared_initializer_guard", "prepacked_save",
                    "prepacked_validated", "borrows_memory_buffers")


def structure_lines(caps: dict[str, Any], table: Optional[dict[str, Any]]) -> list[str]:
    """The structural rules and release-wide facts: probe, then table ("-" for an untested release)."""
    def show(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        return "any" if isinstance(value, int) and value >= 1 << 30 else str(value)

    lines = ["  release facts (probe / table):"]
    for name in STRUCTURE_FIELDS:
        lines.append(f"    {name}: {show(caps[name])} / {show(table[name]) if table is not None else '-'}")
    return lines


def variant_table(caps: dict[str, Any], table: Optional[dict[str, Any]]) -> list[str]:
    """Per variant: what the probe decided (it is what ortmem does) and what the release table records
    for this release ("-" where the release has no row: untested)."""
    def word(ok: Optional[bool]) -> str:
        return "-" if ok is None else ("convert" if ok else "leave")

    keys = [k for kind in ("matmul", "gather") for k in sorted(caps[kind])]
    width = max((len(k) for k in keys), default=0)
    lines = [f"  {'variant'.ljust(width)}  probe    table"]
    for key in keys:
        kind = key.split(":", 1)[0]
        recorded = table[kind].get(key, {}).get("ok") if table is not None else None
        lines.append(f"  {key.ljust(width)}  {word(caps[kind][key]['ok']).ljust(7)}  {word(recorded)}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--probe", action="store_true", help="ask the installed onnxruntime again (ignore the cached answers)")


def main(args: argparse.Namespace) -> int:
    r = report(refresh=args.probe)
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0
