"""``ortmem prepare``: build ahead of time (a container image build) everything a warm start maps.

A QDQ model ortmem converts gets its converted cache entry and that entry's pre-packed weights
(:mod:`ortmem.convert`, :mod:`ortmem.store.prepacked`); any other model its prepared entry
(:mod:`ortmem.store.prepared_entries`); an onnxruntime-genai folder (``genai_config.json``) is handed to
``ortmem.reach.genai.prepare_genai_folder``, which writes the prepared files inside the folder. The entries are
those a default ``ortmem.InferenceSession(path, providers=["CPUExecutionProvider"])`` looks up, so
serving processes only map, and may do so from a cache folder they cannot write.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

NAME = "prepare"
HELP = "build the cache entries warm starts map (converted + pre-packed, or prepared), for a model or a folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx model, or a folder: every .onnx in it (genai folders through ortmem.reach.genai)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="the cache folder the serving processes use (default: $ORTMEM_CACHE_DIR's, as a session's)")


def run(args: argparse.Namespace) -> int:
    from ..store.cache import Cache

    target = Path(args.model)
    cache = Cache(Path(args.cache)) if args.cache else Cache()
    say = _stage_printer()
    if target.is_dir():
        return _prepare_folder(target, cache, say)
    if not target.is_file():
        print(f"ortmem prepare: {target} is neither a model file nor a folder", file=sys.stderr)
        return 2
    return 0 if _prepare_file(target, cache, say) else 1


def _stage_printer() -> Callable[[str], None]:
    """One line per stage on stderr (a terminal gets the conversion's live bar as well)."""
    def say(line: str) -> None:
        print(f"ortmem prepare: {line}", file=sys.stderr, flush=True)
    return say


def _prepare_folder(folder: Path, cache, say: Callable[[str], None]) -> int:
    """Every .onnx under ``folder`` (hidden folders skipped); a genai folder as a whole."""
    from ..reach.genai import GENAI_CONFIG

    genai = sorted({p.parent for p in folder.rglob(GENAI_CONFIG) if not _hidden(p, folder)})
    failed = 0
    for g in genai:
        failed += not _prepare_genai(g, say)
    models = [p for p in sorted(folder.rglob("*.onnx"))
              if p.is_file() and not _hidden(p, folder) and not any(g == p.parent or g in p.parents for g in genai)]
    if not models and not genai:
        say(f"no .onnx model in {folder}")
    for model in models:
        failed += not _prepare_file(model, cache, say)
    return 1 if failed else 0


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _prepare_genai(folder: Path, say: Callable[[str], None]) -> bool:
    """An onnxruntime-genai folder: its prepared files written inside it (``ortmem.reach.genai``). False: failed."""
    from ..errors import OrtmemError
    from ..reach.genai import prepare_genai_folder

    say(f"{folder}: onnxruntime-genai folder")
    try:
        result = prepare_genai_folder(folder)
    except OrtmemError as exc:
        say(f"{folder}: not prepared: {exc}")
        return False
    say(f"{folder}: done{f' ({result})' if result is not None else ''}")
    return True


def _prepare_file(path: Path, cache, say: Callable[[str], None]) -> bool:
    """One model: its converted entry and pre-packed weights, else its prepared entry. False: failed."""
    from ..convert import convert_cached
    from ..errors import OrtmemError
    from ..handoff.conversion import conversion_check
    from ..loader import load
    from ..ortmodel.release import capabilities
    from ..ortmodel.settings import session_settings
    from ..model_facts import min_prepared_bytes
    from ..store.prepared_entries import describe, ensure_prepared, prepared_key
    from ..progress import progress_bar

    settings = session_settings(None)
    try:
        say(f"{path}: loading")
        with load(path) as model:
            converts, fault = conversion_check(model)
            if fault is not None:
                say(f"{path}: {fault}: nothing prepared (sessions hand it to onnxruntime as given)")
                return True
            if converts:
                with progress_bar(f"ortmem prepare: {path}: converting") as bar:
                    entry, hit, _ = convert_cached(model, settings, cache, progress=bar)
                if entry is not None:
                    say(f"{path}: converted entry {entry.key} ({'already there' if hit else 'built'})")
                    return _prepack(entry, cache, say)
            weights = model.weight_bytes
        if not capabilities().prepacked_save:
            say(f"{path}: this onnxruntime saves no pre-packed weights: nothing to prepare")
            return True
        if weights < min_prepared_bytes():
            say(f"{path}: {weights / 2**20:.1f} MiB of initializers, below {min_prepared_bytes() / 2**20:.0f} MiB: "
                "nothing to prepare (plain onnxruntime costs as little; $ORTMEM_PREPARE_MIN_BYTES)")
            return True
        say(f"{path}: preparing (onnxruntime saves its pre-packed weights)")
        entry, built = ensure_prepared(cache, path, prepared_key(path, settings, {}, True))
        say(f"{path}: prepared entry {entry.key} ({'built' if built else 'already there'}): {describe(entry)}")
        return True
    except OrtmemError as exc:
        say(f"{path}: failed: {exc}")
        return False


def _prepack(entry, cache, say: Callable[[str], None]) -> bool:
    """The converted entry's pre-packed weights, saved under its creator lock unless already there."""
    from ..ortmodel.release import capabilities
    from ..store.prepacked import prepacked_model, save_prepacked

    if not capabilities().prepacked_save:
        say(f"{entry.path}: this onnxruntime saves no pre-packed weights")
        return True
    with cache.creating(entry.key):
        path = prepacked_model(entry.path, "full")
        if path is None:
            say(f"{entry.path}: saving onnxruntime's pre-packed weights")
            path = save_prepacked(entry.path)
    say(f"{entry.path}: {'pre-packed weights ready' if path is not None else 'nothing for onnxruntime to pre-pack'}")
    return True
