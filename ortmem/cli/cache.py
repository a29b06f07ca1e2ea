"""``ortmem cache``: list, prune, clear or verify (in full) the entries in the cache (converted and prepared)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ortmem.base.units import bytes_arg

NAME = "cache"
HELP = "list, prune, clear or verify (in full) the cache's entries, converted and prepared ($ORTMEM_CACHE_DIR)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "prune", "clear", "verify"])
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="the cache folder (default: $ORTMEM_CACHE_DIR, else the user cache folder)")
    p.add_argument("--max-size", type=bytes_arg, default=None, metavar="BYTES",
                   help="prune: remove least recently used entries until the rest fit (e.g. 20GiB); "
                        "$ORTMEM_CACHE_MAX_SIZE applies the same limit after every new entry")


def run(args: argparse.Namespace) -> int:
    from ortmem.store.cache import Cache
    from ortmem.files.layout import disk_use

    cache = Cache(Path(args.cache) if args.cache else None)
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
    total, sizes = disk_use([e.path for e in rows])
    print(f"{cache.root}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}, {total.text()}")
    for e in rows:
        try:
            manifest = e.manifest()
        except (OSError, ValueError):
            manifest = {"source": "(unreadable manifest)"}
        size = sizes[e.path]
        print(f"  {e.key}  {size.bytes / 2**20:9.1f} MiB  {_kind(manifest)}  {manifest.get('source', '?')}"
              + _finished_note(e.path)
              + (f"  ({size.shared / 2**20:.1f} MiB of it shared with your model files)" if size.shared else ""))
    return 0


def _finished_note(folder: Path) -> str:
    """What a converted entry holds of ORT's finished models: one per settings it was finished at."""
    from ortmem.store.finished_entries import finished_stems

    count = sum((folder / f"{stem}.onnx").exists() for stem in finished_stems(folder))
    if count == 0:
        return ""
    return "  (+ onnxruntime's finished model)" if count == 1 else f"  (+ onnxruntime's finished models for {count} settings)"


def _kind(manifest: dict) -> str:
    """What an entry is, for a reader: a conversion of the model, ORT's pre-packed weights of a model
    ortmem does not convert, or the note that ORT packs nothing in it (so its starts stay ORT's)."""
    if manifest.get("kind") != "prepared":
        return "converted"
    return f"finished (nothing to map: {manifest.get('why', '?')})" if manifest.get("marker") else "finished"


def _verify_cache(cache) -> int:
    """``ortmem cache verify``: every entry (and each finished model a converted entry keeps, one per
    settings) digested in full; damaged ones are removed so the next session rebuilds them. Exit status 1
    when any was damaged."""
    from ortmem.store.finished import discard_finished, finished_problem
    from ortmem.store.finished_entries import finished_stems

    rows = list(cache.entries())
    damaged = 0
    for e in rows:
        problem = cache.verify(e, mode="always")
        if problem is not None:
            cache.discard(e)
        else:
            for stem in finished_stems(e.path):
                if not (e.path / f"{stem}.onnx").exists():  # a decision only: nothing to map, nothing to read
                    continue
                finished = finished_problem(e.path, stem, mode="always")
                if finished is not None:
                    problem = f"finished model {stem}: {finished}" if problem is None else f"{problem}; {stem}: {finished}"
                    discard_finished(e.path, stem)
        damaged += problem is not None
        print(f"  {e.key}  {'ok' if problem is None else 'DAMAGED, removed: ' + problem}")
    print(f"{cache.root}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}, {damaged} damaged")
    return 1 if damaged else 0
