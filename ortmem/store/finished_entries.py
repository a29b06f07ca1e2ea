"""Finished cache entries: warm starts for every model ortmem does not convert.

A finished entry (``"kind": "prepared"`` in its manifest, the entries' name on disk) holds what
:func:`ortmem.store.finished.finish_model` writes with the stem ``model`` (``model.onnx``, ``model.data`` with ORT's pre-packed blobs, ``model.json``) under the
cache's ``manifest.json``, so the cache's own checks apply to every byte (:meth:`ortmem.store.cache.Cache.verify`:
trust check and digest of every file, per ``verify=``) and the manifest records the source files
(:func:`ortmem.files.sources.source_record`), so a changed source is never served stale
(:meth:`ortmem.store.cache.Cache.lookup_sourced`). Where ORT packs nothing (``useful`` False: a Conv net, a model
of element-wise ops), where the saved model is not worth mapping (``refusal``) or ORT cannot save the
model, the entry is a *marker*: a manifest with no files and ``"marker": true``, so later starts decide
at once and ortmem costs nothing there. A check that could not run
(:class:`ortmem.store.finished.FinishCheckError`) decided nothing: no entry is published and the error
reaches the caller, so the next start may try again.

Key (:func:`finished_key`): ``what="prepared"`` (the entries' name on disk, kept so keys never move), the
source .onnx identity, the settings the session is created with (level, the config entries ortmem reads, disabled optimizers, the packing entries),
whether conversion was enabled (a QDQ model ortmem converts never gets a finished entry, so a
conversion turned back on is not answered by one), the ortmem/onnxruntime/onnx versions and what
a finished model depends on (:func:`ortmem.store.finished.finished_key_parts`: ORT build, CPU), so machines
sharing one cache folder each keep their own.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import onnxruntime as ort

from ortmem import __version__
from ortmem.base import logs
from ortmem.errors import resource_failure
from ortmem.store.cache import Cache
from ortmem.files.layout import Entry
from ortmem.files.layout import FINISHED_STEM as CONVERTED_STEM, MODEL_FILE
from ortmem.files.sources import entry_key, onnx_version, private_mode, source_record
from ortmem.ort.settings import OrtSettings
from ortmem.base.hashing import short_hash
from ortmem.store.finished import (FINISHED_FORMAT, NoSpaceError, FinishCheckError, FinishError, FinishedReport, finish_model, finished_problem, discard_finished, finished_key_parts, finished_settled, free_bytes, keep_decision_only, finished_path, read_manifest, settings_parts, source_files)


#: The stem :func:`ortmem.store.finished.finish_model` writes an entry's files under: ``model.onnx`` is the
#: cache's ``MODEL_FILE``.
STEM = Path(MODEL_FILE).stem


def finished_key(model_path: Path, settings: OrtSettings, packing: dict[str, str], converting: bool) -> str:
    """The key of a model's finished entry (see the module docstring)."""
    return entry_key(Path(model_path), {
        "what": "prepared",
        "format": FINISHED_FORMAT,
        "settings": {"level": settings.graph_optimization_level, "config": dict(settings.session_config),
                     "disabled": sorted(settings.disabled_optimizers), "packing": dict(packing)},
        "converting": bool(converting),
        "ortmem": __version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx_version(),
        "blobs": finished_key_parts(),
    })


def finishing_settings(settings: OrtSettings, packing: Optional[dict[str, str]]) -> OrtSettings:
    """What a model is finished at: the caller's optimization level and disabled optimizers, and every
    config entry it set that this ORT defines (``packing``, :func:`ortmem.ort.settings.caller_config`)."""
    return OrtSettings(settings.graph_optimization_level, dict(packing or {}), settings.disabled_optimizers)


def settings_record(settings: OrtSettings, converting: bool) -> dict[str, Any]:
    """The key parts of :func:`finished_key` a starter hands the background finisher (as JSON), so the
    finisher can compute the key again from the source as it is then (:func:`settings_of_record`)."""
    return {"level": settings.graph_optimization_level, "config": dict(settings.session_config),
            "disabled": sorted(settings.disabled_optimizers), "converting": converting}


def settings_of_record(record: dict[str, Any]) -> tuple[OrtSettings, bool]:
    """(settings, converting) back from :func:`settings_record`."""
    return (OrtSettings(int(record.get("level", 99)), dict(record.get("config", {})),
                        frozenset(record.get("disabled", ()))), bool(record.get("converting", True)))


def is_marker(entry: Entry) -> bool:
    """Whether ``entry`` records only that nothing is worth finishing (no model to load)."""
    try:
        return entry.manifest().get("marker") is True
    except (OSError, ValueError, AttributeError):
        return False


def lookup_finished(cache: Cache, key: str) -> Optional[Entry]:
    """The verified finished entry (or marker) under ``key`` whose sources are unchanged, or None
    (:func:`usable_finished` of what the cache's lookup found)."""
    entry = cache.lookup_sourced(key)
    return usable_finished(cache, entry) if entry is not None else None


def usable_finished(cache: Cache, entry: Entry) -> Optional[Entry]:
    """``entry`` (found by :meth:`ortmem.store.cache.Cache.lookup_sourced`: every file passed the cache's
    check) if it is a marker or its finished model's own manifest is for this ORT and CPU; else it is
    discarded and None."""
    if is_marker(entry):
        return entry
    # The lookup just checked every file's bytes as ``verify`` asks, except that the cache knows no spans
    # in a finished model's data file: "sampled" reads their first and last pages here.
    problem = finished_problem(entry.path, STEM, mode="sampled" if cache.verify_mode == "sampled" else "off")
    if problem is None:
        return entry
    logs.warning(__name__, "ortmem: cache entry %s is unusable (%s); rebuilding", entry.path, problem)
    cache.discard(entry)
    return None


def build_finished(cache: Cache, source: Path, key: str, *, packing: Optional[dict[str, str]] = None,
                   threads: int = 0, settings: Optional[OrtSettings] = None) -> tuple[Entry, Optional[FinishedReport]]:
    """Build and publish the finished entry ``key`` of ``source`` (the caller holds its creator lock);
    (entry, report), the report None when ORT could not save the model (a marker then says so). The
    model is finished at ``settings``' level and disabled optimizers with ``packing``'s config entries
    (:func:`finishing_settings`; ORT's defaults when None).
    Raises :class:`ortmem.store.finished.FinishCheckError`, publishing nothing, when the check of the
    saved model could not run: a marker records only a decision. A failure of resources
    (:func:`ortmem.errors.resource_failure`: ORT's ``bad_alloc``, no thread, no descriptor) is no
    decision either: :class:`ortmem.store.finished.FinishError` is raised and nothing published."""
    reports: list[FinishedReport] = []

    def build(tmp: Path) -> dict[str, Any]:
        try:
            report = finish_model(source, tmp, STEM, settings=finishing_settings(settings or OrtSettings(), packing),
                                   threads=threads)
        except (FinishCheckError, NoSpaceError):
            raise  # no decision was made (a full disk says nothing of the model): nothing to record
        except FinishError as exc:
            if resource_failure(exc):  # says nothing about the model: no marker, a later start tries again
                raise
            logs.info(__name__, "ortmem: %s; later starts load %s as given", exc, source)
            return {"kind": "prepared", "marker": True, "source": str(source), "why": str(exc),
                    **source_record(source_files(source))}
        if not report.useful and resource_failure(report.refusal):
            # the comparison ran short of memory, threads or descriptors: no verdict on the model either
            raise FinishError(f"the finished model could not be judged: {report.refusal}", file=str(source))
        reports.append(report)
        manifest, problem = read_manifest(tmp, STEM)
        if manifest is None:
            raise FinishError(f"the finished model's manifest cannot be read back ({problem})", file=str(tmp))
        record = {k: manifest[k] for k in ("sources", "source_content", "source_digests") if k in manifest}
        if not report.useful:  # nothing ORT packs: keep the decision, not a copy of the weights
            for f in list(tmp.iterdir()):
                f.unlink()
            return {"kind": "prepared", "marker": True, "source": str(source),
                    "why": report.refusal or "onnxruntime packs nothing", "report": manifest.get("report"), **record}
        return {"kind": "prepared", "source": str(source), "report": manifest.get("report"),
                "digests": manifest.get("digests", {}), **record}

    entry = cache.build(key, build, file_mode=private_mode(source))
    return entry, (reports[0] if reports else None)


def ensure_finished(cache: Cache, source: Path, key: str, *, packing: Optional[dict[str, str]] = None,
                    threads: int = 0, timeout: Optional[float] = None,
                    settings: Optional[OrtSettings] = None) -> tuple[Entry, bool]:
    """(entry, built): the finished entry ``key``, looked up or built under its creator lock
    (``timeout`` as :meth:`ortmem.store.cache.Cache.creating`; raises ``LockBusyError`` past it)."""
    entry = lookup_finished(cache, key)
    if entry is not None:
        return entry, False
    with cache.creating(key, timeout=timeout):
        entry = lookup_finished(cache, key)  # built while we waited?
        if entry is not None:
            return entry, False
        entry, _ = build_finished(cache, source, key, packing=packing, threads=threads, settings=settings)
    return entry, True


def describe(entry: Entry) -> str:
    """One line on what a finished entry holds (``ortmem prepare``, ``ortmem cache list``)."""
    try:
        m = entry.manifest()
    except (OSError, ValueError):
        return "(unreadable manifest)"
    if m.get("marker"):
        return f"nothing to map ({m.get('why', 'onnxruntime packs nothing')})"
    report = m.get("report") or {}
    return (f"onnxruntime's finished model: {report.get('prepacked', '?')} pre-packed initializers, "
            f"{(report.get('data_bytes') or 0) / 2**20:.1f} MiB mapped from {STEM}.data")


# ------------------------------------------------------------------ converted entries, finished by ORT
def finished_stem(settings: OrtSettings) -> str:
    """The stem of the converted entry's finished model at ``settings``: ``finished-<hash>``, the hash of
    the settings part of :func:`ortmem.store.finished.finished_key_parts`, so callers with different
    settings sharing one entry each keep their own finished model."""
    blob = json.dumps(settings_parts(settings), sort_keys=True).encode()
    return f"{CONVERTED_STEM}-{short_hash(blob, 12)}"


def finished_stems(folder: Path) -> list[str]:
    """The stems of every finished model (or decision) kept in the entry ``folder``, sorted."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted({n.rsplit(".", 1)[0] for n in names
                   if n.startswith(f"{CONVERTED_STEM}-") and n.endswith((".json", ".onnx", ".data"))})


def discard_every_finished(folder: Path) -> None:
    """Remove every finished model kept in the entry ``folder`` (the entry itself stays)."""
    for stem in finished_stems(folder):
        discard_finished(Path(folder), stem)


#: Key of the converted entry's manifest record of a finishing that found the disk full.
NO_SPACE_RECORD = "finished_no_space"
#: More free bytes than the failed attempt had before finishing is tried again.
NO_SPACE_RETRY_MARGIN = 1 << 20
#: Entries whose full disk this process has warned of (once each: every start would say it again).
_said_full: set[str] = set()


def no_space_refusal(entry: Entry, free: Optional[int]) -> Optional[str]:
    """Why the converted ``entry`` is not finished now: an earlier attempt found its filesystem full with
    at least ``free`` bytes free (None: try). Only a record for this ORT, build and CPU counts."""
    try:
        record = entry.manifest().get(NO_SPACE_RECORD)
    except (OSError, ValueError, AttributeError):
        return None
    if free is None or not isinstance(record, dict) or record.get("key_parts") != finished_key_parts():
        return None
    had = record.get("free_bytes")
    if not isinstance(had, int) or free > had + NO_SPACE_RETRY_MARGIN:
        return None
    return (f"no space left on device in {entry.path} for onnxruntime's finished model: finishing found it "
            f"full with {had / 2**20:.1f} MiB free and is not tried again until more than "
            f"{(had + NO_SPACE_RETRY_MARGIN) / 2**20:.1f} MiB is ({free / 2**20:.1f} MiB now)")


def record_no_space(entry: Entry, free: Optional[int]) -> None:
    """Record in the entry's manifest that finishing found the disk full with ``free`` bytes free (None:
    forget an earlier record). Best effort: without the record the next start only tries again."""
    try:
        m = entry.manifest()
    except (OSError, ValueError):
        return
    if not isinstance(m, dict) or (free is None and NO_SPACE_RECORD not in m):
        return
    if free is None:
        m.pop(NO_SPACE_RECORD)
    else:
        m[NO_SPACE_RECORD] = {"free_bytes": free, "key_parts": finished_key_parts(), "at": time.time()}
    try:
        entry.rewrite_manifest(m)
    except OSError as exc:
        logs.debug(__name__, "ortmem: could not record the full disk in %s (%s)", entry.path, exc)


def converted_finished(cache: Cache, entry: Entry, settings: OrtSettings) -> tuple[Optional[Path], bool]:
    """(the converted ``entry``'s finished model for ``settings``, checked as the cache's ``verify`` asks,
    or None; whether nothing is left to finish: that model, a decision recorded for this ORT, CPU and
    ``settings`` that ORT's finished model is not worth mapping, or a full disk recorded with no more
    free now (:func:`no_space_refusal`, said once per process)). Damaged or stale files are removed
    (where the cache can be written) and answer (None, False): the background job finishes the entry
    again. ``settings``: what the model is finished at (:func:`finishing_settings`); its files are
    :func:`finished_stem`'s, so finished models for other settings in the entry are left alone."""
    stem = finished_stem(settings)
    if not os.path.lexists(entry.path / f"{stem}.json"):
        refusal = no_space_refusal(entry, free_bytes(entry.path))
        if refusal is None:
            return None, False
        if str(entry.path) not in _said_full:
            _said_full.add(str(entry.path))
            logs.warning(__name__, "ortmem: %s; sessions load the converted entry", refusal)
        return None, True
    path = finished_path(entry.path, stem, mode=cache.verify_mode, settings=settings)
    if path is not None:
        return path, True
    if finished_settled(entry.path, stem, settings):
        return None, True
    if cache.writable:  # damaged, or for another ORT: removed, so the job finishes it again
        discard_finished(entry.path, stem)
    return None, False


def finish_converted(cache: Cache, entry: Entry, settings: OrtSettings, *, threads: int = 0) -> Optional[Path]:
    """Finish the converted ``entry``'s model at ``settings`` (:func:`ortmem.store.finished.finish_model`
    under :func:`finished_stem`, into the entry's folder) and return the finished model, or None when
    nothing is worth mapping (the decision is kept: :func:`converted_finished`) or the entry fails its
    full check (it is discarded: the next start converts again). The caller holds the entry's creator
    lock. The check that publishes it compares ORT's outputs on the finished model with ORT's on the
    entry's ``model.onnx`` at ``settings``.

    Raises :class:`ortmem.store.finished.FinishError` (nothing kept) when ORT cannot save it or runs
    out of resources, :class:`ortmem.store.finished.FinishCheckError` when the check could not run,
    :class:`ortmem.store.finished.NoSpaceError` when the entry's filesystem is full: that is recorded
    in the entry's manifest with the space it had (:func:`record_no_space`), and until more than that
    is free no start leaves the job again and this raises at once."""
    stem = finished_stem(settings)
    refusal = no_space_refusal(entry, free_bytes(entry.path))
    if refusal is not None and not os.path.lexists(entry.path / f"{stem}.json"):
        raise NoSpaceError(refusal, file=str(entry.path))
    path, settled = converted_finished(cache, entry, settings)
    if settled:
        return path
    problem = cache.verify(entry, mode="full")  # nothing is derived from an entry not checked in full
    if problem is not None:  # damaged where verify="sampled"/"off" did not look: the next start converts again
        logs.warning(__name__, "ortmem: cache entry %s is damaged (%s); not finishing it, rebuilding", entry.path, problem)
        cache.discard(entry)
        return None
    free = free_bytes(entry.path)
    try:
        report = finish_model(entry.model_path, entry.path, stem, settings=settings, threads=threads)
    except NoSpaceError:
        record_no_space(entry, free)  # after the attempt's files are gone: there is room for it
        raise
    record_no_space(entry, None)
    if report.useful:
        return entry.path / f"{stem}.onnx"
    if resource_failure(report.refusal):  # no verdict on the model: nothing recorded, a later start tries again
        discard_finished(entry.path, stem)
        raise FinishError(f"the finished model could not be judged: {report.refusal}", file=str(entry.path))
    keep_decision_only(entry.path, stem)
    return None


