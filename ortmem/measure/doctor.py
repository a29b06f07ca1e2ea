"""``ortmem doctor``: what ortmem sees on this machine — the first thing to paste into a bug report.

A summary first: the installed ONNX Runtime against the tested range, what the release probe allows
ortmem to convert on it, the cache folder (entries, size, shared bytes), health problems, then ortmem,
Python, providers and allocator hygiene in one line. ``--verbose`` adds the build, every variant (the
probe's answer beside the release table's) and the release facts; ``--json`` holds all of it.
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

    from ortmem import __version__
    from ortmem.base.hygiene import allocator
    from ortmem.ort.release import capabilities, table_capabilities

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
    from ortmem.store.cache import Cache, cache_root
    from ortmem.files.layout import disk_use
    from ortmem.errors import CacheError
    from ortmem.base.child_env import CACHE_DIR_ENV

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


def render(r: dict[str, Any], *, verbose: bool = False) -> str:
    """The text ``ortmem doctor`` prints: the summary a user reads first (release, what ortmem converts
    on it, cache, health); with ``verbose``, the build, every variant and release fact after it."""
    from ortmem.files.layout import DiskUse

    caps = r["capabilities"]
    c = r["cache"]
    ort = r["onnxruntime"]
    lines = [f"onnxruntime {ort['version']} ({ort['device']}): {release_status(caps, r.get('table'))}"]
    lines += conversion_lines(caps)
    if c.get("usable"):
        lines.append(f"cache {c['path']}: {c['entries']} entries, {DiskUse(c['bytes'], c.get('shared_bytes', 0)).text()}")
    else:
        lines.append(f"cache {c['path']}: NOT USABLE; sessions convert in memory or fall back to ORT")
    found = problems(r)
    lines.append("health: " + ("no problems found" if not found else f"{len(found)} problem(s)"))
    lines += [f"  - {p}" for p in found]
    lines.append(f"ortmem {r['ortmem']}, Python {r['python']}, {r['platform']}; providers "
                 f"{', '.join(ort['providers'])}; allocator hygiene: {r['allocator_hygiene']}")
    if not verbose:
        lines.append("(ortmem doctor --verbose: the build, every variant and release fact)")
        return "\n".join(lines)
    lines.append(f"build {caps['build']}")
    refused = [(k, v["why"]) for kind in ("matmul", "gather") for k, v in caps[kind].items() if not v["ok"]]
    lines.append(f"variants left to ORT: {len(refused)}" + (":" if refused else ""))
    lines += [f"  {k}: {why}" for k, why in refused]
    lines += structure_lines(caps, r.get("table"))
    lines += variant_table(caps, r.get("table"))
    return "\n".join(lines)


def release_status(caps: dict[str, Any], table: Optional[dict[str, Any]]) -> str:
    """Whether the installed release is one ortmem was tested with, supports untested, or not at all."""
    lo, _ = caps["supported_range"]
    tested = ", ".join(caps["tested_releases"])
    if table is not None:
        return f"in the tested range (ortmem supports {lo} on; tested {tested})"
    if caps["source"] == "probe":
        return f"supported but untested (ortmem supports {lo} on; tested {tested}); its probe decides what is converted"
    return f"OUT OF RANGE or not probed (ortmem supports {lo} on; tested {tested})"


#: What each kind of variant becomes when ortmem converts it.
REWRITES = {"matmul": "DQ+MatMul -> MatMulNBits", "gather": "DQ+Gather -> GatherBlockQuantized"}


def conversion_lines(caps: dict[str, Any]) -> list[str]:
    """What ortmem converts on this release, in two lines: the rewrites with how many of their variants,
    the block sizes, and whether ORT's pre-packed weights are saved for warm starts."""
    if not caps["convert"]:
        return ["converts: nothing (models are loaded without copies and handed to ORT as they are)"]
    kinds = []
    for kind, rewrite in REWRITES.items():
        ok = sum(v["ok"] for v in caps[kind].values())
        total = len(caps[kind])
        kinds.append(f"{rewrite} ({'all ' if ok == total else ''}{ok}{'' if ok == total else f' of {total}'} variants)")
    fused = caps["fusion_block_max"]
    blocks = min(caps["convert_block_max"], fused)
    packed = ("ORT's pre-packed weights saved for warm starts"
              + (", checked by ORT on reload" if caps["prepacked_validated"] else "")
              if caps["prepacked_save"] else "no pre-packed weights saved (ORT packs at every start)")
    return [f"converts: {', '.join(kinds)}; DQ block sizes up to {blocks}", f"  {packed}"]


def problems(r: dict[str, Any]) -> list[str]:
    """What a user may need to act on: an unusable cache, conversion off, the probe's notes (a stale
    release table, a release newer than every tested one), variants left to ORT."""
    caps = r["capabilities"]
    out = []
    if not r["cache"].get("usable"):
        out.append(f"cache: {r['cache']['problem']}")
    if not caps["convert"] and not caps["notes"]:
        out.append("conversion is off on this release")
    out += list(caps["notes"])
    refused = sum(not v["ok"] for kind in REWRITES for v in caps[kind].values())
    if caps["convert"] and refused:
        out.append(f"{refused} variant(s) left to ORT (ortmem doctor --verbose says which and why)")
    return out


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
    p.add_argument("--json", action="store_true", help="machine-readable output (everything, whatever --verbose)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also the build, every variant (probe and release table) and the release facts")
    p.add_argument("--probe", action="store_true", help="ask the installed onnxruntime again (ignore the cached answers)")


def main(args: argparse.Namespace) -> int:
    r = report(refresh=args.probe)
    print(json.dumps(r, indent=2) if args.json else render(r, verbose=args.verbose))
    return 0
