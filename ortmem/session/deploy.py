"""What ``ortmem prepare`` does at deploy time (a container image build): everything a warm start maps, built ahead.

A QDQ model ortmem converts gets its converted cache entry (:mod:`ortmem.session.convert`) and ORT's finished
model of it (:func:`ortmem.store.finished_entries.finish_converted`); any other model its finished entry
(:mod:`ortmem.store.finished_entries`); an onnxruntime-genai folder (``genai_config.json``) is handed to
:func:`ortmem.session.genai.prepare_genai_folder`, which writes the finished files inside the folder. The
entries are those a default ``ortmem.InferenceSession(path, providers=["CPUExecutionProvider"])`` looks
up, so serving processes only map, and may do so from a cache folder they cannot write.

:func:`prepare_path` returns the command's exit status, and its last line says what happened: 0 when
everything is prepared or has nothing to prepare (ORT keeps nothing of it: a plain statement, and an
entry records it), 1 when anything could not be prepared, the reason said once (a check that could not
run records nothing: the next start or ``ortmem prepare`` tries again), 2 for a path that is neither a
model nor a folder.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

from ortmem.store.cache import Cache

#: What one model's preparation came to: entries a warm start maps, nothing to prepare, or a failure.
PREPARED, NOTHING, FAILED = "prepared", "nothing to prepare", "failed"


def prepare_path(target: Path, cache: Optional[Cache] = None, say: Optional[Callable[[str], None]] = None) -> int:
    """Prepare a model file or every model of a folder into ``cache`` (default: a session's); the exit status."""
    from ortmem.ort.release import config_keys

    target = Path(target)
    cache = cache if cache is not None else Cache()
    say = say or _stage_printer()
    # Read here, at deploy time, and kept with the probe's answers: the first serving process that
    # passes SessionOptions would otherwise scan ORT's library for them (a quarter of a second here).
    config_keys()
    if target.is_dir():
        return _prepare_folder(target, cache, say)
    if not target.is_file():
        say(f"{target} is neither a model file nor a folder")
        return 2
    return 1 if _prepare_file(target, cache, say) == FAILED else 0


def _stage_printer() -> Callable[[str], None]:
    """One line per stage on stderr (a terminal gets the conversion's live bar as well)."""
    def say(line: str) -> None:
        print(f"ortmem prepare: {line}", file=sys.stderr, flush=True)
    return say


def _prepare_folder(folder: Path, cache, say: Callable[[str], None]) -> int:
    """Every .onnx under ``folder`` (hidden folders skipped); a genai folder as a whole."""
    from ortmem.session.genai import GENAI_CONFIG

    genai = sorted({p.parent for p in folder.rglob(GENAI_CONFIG) if not _hidden(p, folder)})
    outcomes = [_prepare_genai(g, say) for g in genai]
    models = [p for p in sorted(folder.rglob("*.onnx"))
              if p.is_file() and not _hidden(p, folder) and not any(g == p.parent or g in p.parents for g in genai)]
    if not models and not genai:
        say(f"no .onnx model in {folder}")
        return 0
    outcomes += [_prepare_file(model, cache, say) for model in models]
    if len(outcomes) > 1:  # one model's own last line already said it
        say(f"{folder}: " + ", ".join(f"{outcomes.count(o)} {o}" for o in (PREPARED, NOTHING, FAILED) if o in outcomes))
    return 1 if FAILED in outcomes else 0


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _prepare_genai(folder: Path, say: Callable[[str], None]) -> str:
    """An onnxruntime-genai folder: its prepared files written inside it (``ortmem.session.genai``); one
    line per file, then what the folder came to (:data:`PREPARED`, :data:`NOTHING`, :data:`FAILED`)."""
    from ortmem.errors import OrtmemError
    from ortmem.session.genai import GENAI_CONFIG, prepare_genai_folder

    say(f"{folder}: onnxruntime-genai folder")
    try:
        result = prepare_genai_folder(folder)
    except OrtmemError as exc:
        say(f"{folder}: not prepared: {exc}")
        return FAILED
    for line in result.lines():
        say(f"{folder}: {line}")
    if result.failed:
        say(f"{folder}: {len(result.failed)} file(s) not prepared (see above; nothing was recorded for them)")
        return FAILED
    if any(r.useful for r in result.prepared.values()):
        say(f"{folder}: prepared ({result.seconds:.1f} s)")
        return PREPARED
    why = ("onnxruntime keeps no pre-packed weights of its files" if result.prepared
           else "no file of it runs on the CPU execution provider with pre-packing" if result.skipped
           else f"its {GENAI_CONFIG} names no ONNX file")
    say(f"{folder}: nothing to prepare: {why} (genai loads them as given)")
    return NOTHING


def _prepare_file(path: Path, cache, say: Callable[[str], None]) -> str:
    """One model: its converted entry and pre-packed weights, else its finished entry; what it came to
    (:data:`PREPARED`, :data:`NOTHING`, :data:`FAILED`), said in its last line."""
    from ortmem.session.convert import convert_cached
    from ortmem.errors import OrtmemError
    from ortmem.session.cold_start import conversion_check
    from ortmem.onnxfile.loader import load
    from ortmem.ort.release import capabilities
    from ortmem.ort.settings import session_settings
    from ortmem.onnxfile.scan import min_finished_bytes
    from ortmem.store.finished_entries import describe, ensure_finished, is_marker, finished_key
    from ortmem.store.handoff_records import mark_as_given, mark_prepared, records_folder
    from ortmem.base.progress import progress_bar

    settings = session_settings(None)
    try:
        say(f"{path}: loading")
        with load(path) as model:
            converts, fault = conversion_check(model)
            if fault is not None:
                say(f"{path}: {fault}: nothing prepared (sessions hand it to onnxruntime as given)")
                return NOTHING
            if converts:
                with progress_bar(f"ortmem prepare: {path}: converting") as bar:
                    entry, hit, _ = convert_cached(model, settings, cache, progress=bar)
                if entry is not None:
                    say(f"{path}: converted entry {entry.key} ({'already there' if hit else 'built'})")
                    return _finish(entry, cache, settings, say)
            weights = model.weight_bytes
        if not capabilities().prepacked_save:
            say(f"{path}: this onnxruntime saves no pre-packed weights: nothing to prepare")
            return NOTHING
        say(f"{path}: finishing (onnxruntime saves the model it finishes, with its pre-packed weights)")
        entry, built = ensure_finished(cache, path, finished_key(path, settings, {}, True))
    except OrtmemError as exc:
        say(f"{path}: not prepared: {exc}")
        return FAILED
    state = "built" if built else "already there"
    if is_marker(entry):
        # prepared at ORT's defaults: starts at those defaults then hand the file over without asking the store
        mark_as_given(records_folder(cache.root), path)
        say(f"{path}: nothing to prepare ({entry.manifest().get('why', 'onnxruntime packs nothing')}): sessions load "
            f"it as given (entry {entry.key}, {state}, records this)")
        return NOTHING
    say(f"{path}: finished entry {entry.key} ({state}): {describe(entry)}")
    if weights < min_finished_bytes() and not mark_prepared(records_folder(cache.root), path):
        say(f"{path}: sessions hand it to onnxruntime as given: no handoff record could send them to the entry "
            "(a file written in the last seconds, or a cache folder that cannot be written)")
        return NOTHING
    return PREPARED


def _finish(entry, cache, settings, say: Callable[[str], None]) -> str:
    """ORT's finished model of the converted entry, made under its creator lock unless already there (the
    converted entry alone is what a warm start maps where ORT saves none: :data:`PREPARED` either way)."""
    from ortmem.errors import OrtmemError
    from ortmem.ort.release import capabilities
    from ortmem.store.finished_entries import finish_converted, finishing_settings

    if not capabilities().prepacked_save:
        say(f"{entry.path}: this onnxruntime saves no finished model")
        return PREPARED
    say(f"{entry.path}: finishing (onnxruntime saves the model it finishes, with its pre-packed weights)")
    try:
        with cache.creating(entry.key):
            path = finish_converted(cache, entry, finishing_settings(settings, {}))
    except OrtmemError as exc:
        say(f"{entry.path}: not finished: {exc} (sessions load the converted entry)")
        return FAILED
    say(f"{entry.path}: " + (f"finished model {path.name} ready" if path is not None
                              else "nothing onnxruntime finishes is worth mapping: sessions load the converted entry"))
    return PREPARED
