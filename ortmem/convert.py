"""Conversion as a stage: a loaded model in, a self-contained MatMulNBits model folder out.

The output folder holds ``model.onnx`` (the rewritten skeleton) and ``weights.bin`` (every weight,
page-aligned). It is what ``ortmem convert`` writes and what a cache entry holds; ORT loads it by
path and memory-maps each tensor, so nothing is copied again.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import onnx
import onnxruntime as ort

from . import __version__
from .store import digest
from .store.cache import (
    MODEL_FILE,
    SOURCE_LINK_PREFIX,
    WEIGHTS_FILE,
    Cache,
    Entry,
    file_identity,
    key_identity,
    make_key,
    reserve,
    same_source,
)
from .store.trust import PRIVATE_FILE_MODE, write_new
from .errors import ConversionError
from .model import Model
from .passes.conversion import plan_conversion, rewrite_skeleton, write_weights
from .passes.conversion_plan import ConversionPlan, ConversionReport, out_tensors, relocate_carried
from .passes.writers import Progress
from .ortmodel.settings import OrtSettings

log = logging.getLogger(__name__)

#: Bumped whenever the converted graph for the same input changes (new rewrites, different layouts),
#: so entries written by an older conversion are never taken for hits.
CONVERSION_FORMAT = 3


def write_converted(model: Model, plan: ConversionPlan, out_dir: Path, *, progress: Optional[Progress] = None,
                    link: bool = False, mode: int = PRIVATE_FILE_MODE, digests: bool = False) -> ConversionReport:
    """Write ``model.onnx`` + ``weights.bin`` for ``plan`` into the existing folder ``out_dir``.

    ``link``: hard-link source files instead of copying unchanged tensors (cache entries: free and
    instant; not for ``ortmem convert``, whose output must not change if the source is edited in place).
    Files are created new (never through a planted file or symlink) with ``mode``.
    ``digests``: put the full digests of both files in ``report.file_digests``, computed from the
    bytes as they are written (a cache entry's manifest records them; nothing is read back).
    """
    start = time.perf_counter()
    if link:
        relocate_carried(plan, link_sources(plan, out_dir))
    weights = out_dir / WEIGHTS_FILE
    fd = reserve(weights, plan.size, mode)  # a full disk fails here, before anything is mapped
    os.close(fd)
    weights_digest = write_weights(model, plan, weights, progress=progress, digest=digests)
    skeleton = rewrite_skeleton(model, plan, WEIGHTS_FILE).SerializeToString()
    write_new(out_dir / MODEL_FILE, skeleton, mode)
    report = ConversionReport.from_plan(plan, time.perf_counter() - start)
    if digests:
        report.file_digests = {WEIGHTS_FILE: weights_digest, MODEL_FILE: digest.bytes_digest(skeleton)}
    return report


def link_sources(plan: ConversionPlan, out_dir: Path) -> dict[Path, str]:
    """Hard-link each source file whose tensors are carried unchanged into ``out_dir``.

    A link costs nothing and keeps the output self-contained (ORT only reads external data inside the
    model's folder); where linking is impossible (another filesystem, no permission) the tensors are
    copied into weights.bin instead.
    """
    links: dict[Path, str] = {}
    for ref, _ in plan.copied:
        if ref.file in links:
            continue
        name = f"{SOURCE_LINK_PREFIX}{len(links)}{ref.file.suffix or '.bin'}"
        try:
            os.link(ref.file, out_dir / name)
        except OSError:
            continue
        links[ref.file] = name
    return links


def cache_key(model_path: Path, settings: OrtSettings, extra: Optional[Mapping[str, Any]] = None) -> str:
    """The key of a model's conversion: the .onnx file's identity, the options the result depends
    on, and the versions that shape it. External data files are checked at lookup (their identities
    are in the manifest), so a warm start finds its entry without parsing the model at all."""
    return make_key({
        "what": "dq-matmulnbits",
        "format": CONVERSION_FORMAT,
        "model": key_identity(Path(model_path)),
        "settings": {"level": settings.graph_optimization_level, "config": dict(settings.session_config),
                     "disabled": sorted(settings.disabled_optimizers)},
        "ortmem": __version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        **(extra or {}),
    })


def private_mode(source: Path) -> int:
    """0600, or the source model's mode where that is stricter (a 0400 model gives 0400 files)."""
    try:
        return (PRIVATE_FILE_MODE & os.stat(source).st_mode) | 0o400
    except OSError:
        return PRIVATE_FILE_MODE


def _source_paths(model: Model) -> list[Path]:
    return [Path(f) for f in sorted({str(w.file) for w in model.weights} | {str(model.path.resolve())})]


def lookup_converted(cache: Cache, model_path: Path, settings: OrtSettings,
                     fp16_in_fp32: Optional[bool] = None) -> Optional[Entry]:
    """A verified entry for this model and these settings whose sources are unchanged, or None."""
    return lookup_sourced(cache, cache_key(model_path, settings, {"fp16_in_fp32": fp16_in_fp32}))


def lookup_sourced(cache: Cache, key: str) -> Optional[Entry]:
    """:meth:`Cache.lookup`, then the sources the entry's manifest records (:func:`source_record`):
    an entry whose source changed is discarded (None). The manifest update that follows a confirmed
    content (a source's new ctime) is best effort: a read-only cache only digests again next time."""
    entry = cache.lookup(key)
    if entry is None:
        return None
    try:
        manifest = entry.manifest()
    except (OSError, ValueError):
        manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    problem, update = sources_problem(manifest)
    if problem is not None:
        log.info("ortmem: %s of cache entry %s; rebuilding", problem, entry.path)
        cache.discard(entry)
        return None
    if update and cache.writable:
        try:
            entry.rewrite_manifest({k: v for k, v in {**manifest, **update}.items() if v is not None})
        except OSError:
            pass
    return entry


def sources_problem(manifest: dict[str, Any]) -> tuple[Optional[str], dict[str, Any]]:
    """(why the sources recorded by :func:`source_record` no longer hold, or None; the manifest fields
    to rewrite so the next check needs no digest, a value None meaning "drop the field")."""
    try:
        recorded = manifest.get("sources", [])
        current = [file_identity(Path(s["path"])) for s in recorded]
        verdicts = [same_source(r, c) for r, c in zip(recorded, current)]
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        verdicts = [False]
    if not recorded or False in verdicts:
        return "a source was edited (even with its mtime restored) or replaced", {}
    pinned = manifest.get("source_digests")
    if pinned is not None:
        if not isinstance(pinned, list) or len(pinned) != len(recorded) or not all(
                digest.matches(Path(s["path"]), d) for s, d in zip(recorded, pinned)):
            return "a source changed within its timestamp tick", {}
    update: dict[str, Any] = {}
    if None in verdicts:  # only ctime moved: another entry's link/unlink, or an in-place edit? Ask the content.
        content = manifest.get("source_content")
        if not (isinstance(content, list) and len(content) == len(recorded)
                and all(digest.matches(Path(s["path"]), d) for s, d, v in zip(recorded, content, verdicts) if v is None)):
            return "a source changed in place", {}
        update["sources"] = current  # same bytes: record the new identity so the next start needs no digest
    if pinned is not None and not racy(current):  # content confirmed and now stat can tell any later edit
        update["source_digests"] = None
    return None, update


def source_record(paths: list[Path]) -> dict[str, Any]:
    """What an entry records of the files it was made from, for :func:`sources_problem`: their
    identities; a content digest of each, kept for good and checked only when a source's ctime moved
    with everything else equal (another entry's hard link, or an edit with mtime set back; ~0.1 s/GB,
    read from the page cache the builder just filled); and for a source written just now the same
    digests as ``source_digests``, checked on every lookup until stat alone can vouch for it."""
    sources = [file_identity(Path(p)) for p in paths]
    record: dict[str, Any] = {"sources": sources,
                              "source_content": [digest.file_digest(Path(s["path"])) for s in sources]}
    if racy(sources):
        record["source_digests"] = record["source_content"]
    return record


#: A source modified this recently may be rewritten again within the same filesystem timestamp tick
#: with the same size, which ``stat`` cannot see (git's "racy" files). Such an entry records a full
#: digest of its sources, checked on lookups until the source is older than this.
RACY_SECONDS = 2.0


def racy(identities: list[dict[str, Any]]) -> bool:
    """Whether any of these source identities was modified within :data:`RACY_SECONDS`."""
    now = time.time_ns()
    return any(now - int(s["mtime_ns"]) < RACY_SECONDS * 1e9 for s in identities)


def convert_cached(model: Model, settings: OrtSettings, cache: Cache, *, progress: Optional[Progress] = None,
                   fp16_in_fp32: Optional[bool] = None) -> tuple[Optional[Entry], bool, Optional[ConversionReport]]:
    """(entry, hit, report): the cached conversion of ``model``, built if missing.

    Returns ``(None, False, None)`` when nothing in the model is convertible: the caller then hands
    the original model to ORT. Concurrent creators of one entry meet at its creator lock: one builds,
    the others wait at most :func:`ortmem.store.cache.lock_timeout` and read its entry. A builder that takes
    longer (stopped, starved, a slow disk) raises :class:`ortmem.store.cache.LockBusyError` here, a
    ``CacheError`` naming the lock and its holder's pid: the caller converts without the cache rather
    than wait on another process's progress.
    """
    hit = lookup_converted(cache, model.path, settings, fp16_in_fp32)
    if hit is not None:
        return hit, True, None
    plan = plan_conversion(model, settings, fp16_in_fp32=fp16_in_fp32)
    if not plan.has_work:
        return None, False, None
    reports: list[ConversionReport] = []

    def build(tmp: Path) -> dict[str, Any]:
        report = write_converted(model, plan, tmp, progress=progress, link=True, digests=True)
        reports.append(report)
        spans = [(t.offset, t.nbytes) for t in out_tensors(plan) if t.nbytes and t.location is None]
        extras = {"spans": spans, "source": str(model.path), "report": report.summary(),
                  **source_record(_source_paths(model))}
        extras["digests"] = {**report.file_digests,
                             **_linked_digests(tmp, extras["sources"], extras["source_content"])}
        return extras

    key = cache_key(model.path, settings, {"fp16_in_fp32": fp16_in_fp32})
    with cache.creating(key):
        hit = lookup_converted(cache, model.path, settings, fp16_in_fp32)  # built while we waited?
        if hit is not None:
            return hit, True, None
        entry = cache.build(key, build, file_mode=private_mode(model.path))
    return entry, False, reports[0] if reports else None


def _linked_digests(folder: Path, sources: list[dict[str, Any]], content: list[str]) -> dict[str, str]:
    """The digests of the entry's hard-linked sources: a link is its source's inode, whose digest was
    just taken (so each source is read once for both)."""
    by_inode = {(s["dev"], s["inode"]): d for s, d in zip(sources, content)}
    out: dict[str, str] = {}
    for f in folder.iterdir():
        if f.name.startswith(SOURCE_LINK_PREFIX):
            st = f.lstat()
            d = by_inode.get((st.st_dev, st.st_ino))
            if d is not None:
                out[f.name] = d
    return out


def convert_to(model: Model, out_dir: Path, settings: OrtSettings, *, progress: Optional[Progress] = None) -> ConversionReport:
    """``ortmem convert``: write the converted model into ``out_dir`` (created; must be empty or new).

    Written into a temporary sibling folder and renamed, so a failure leaves no half-written output.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConversionError("output folder is not empty", file=str(out_dir))
    plan = plan_conversion(model, settings)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        report = write_converted(model, plan, tmp, progress=progress, mode=0o666)
        (tmp / "conversion.json").write_text(json.dumps({"summary": report.summary()}, indent=1))
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
