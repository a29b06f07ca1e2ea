"""Conversion as a stage: a loaded model in, a self-contained MatMulNBits model folder out.

The output folder holds ``model.onnx`` (the rewritten skeleton) and ``weights.bin`` (every weight,
page-aligned; the names are the store's folder format, :mod:`ortmem.store.layout`). It is what
``ortmem convert`` writes and what a cache entry holds; ORT loads it by path and memory-maps each
tensor, so nothing is copied again. Keys, lookups, source records and publishing are the store's
(:mod:`ortmem.store.verdict`): this module only writes the folder it is given.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

from .store import digest
from .store.cache import Cache, Entry, reserve
from .store.layout import MODEL_FILE, SOURCE_LINK_PREFIX, WEIGHTS_FILE
from .store.trust import PRIVATE_FILE_MODE, write_new
from .store.verdict import Written, publish, start
from .errors import ConversionError
from .model import Model
from .passes.conversion import plan_conversion, rewrite_skeleton, write_weights
from .passes.conversion_plan import ConversionPlan, ConversionReport, out_tensors, relocate_carried
from .passes.writers import Progress
from .ortmodel.settings import OrtSettings

log = logging.getLogger(__name__)


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


def source_paths(model: Model) -> list[Path]:
    """The files a conversion of ``model`` is made from: the .onnx file and every file its weights live in."""
    return [Path(f) for f in sorted({str(w.file) for w in model.weights} | {str(model.path.resolve())})]


def entry_writer(model: Model, plan: ConversionPlan, *, progress: Optional[Progress] = None,
                 reports: Optional[list[ConversionReport]] = None) -> Callable[[Path], Written]:
    """What :func:`ortmem.store.verdict.publish` calls to fill a new cache entry's folder: the converted
    model with hard-linked sources and the digests taken while writing. Its report is appended to
    ``reports`` (the entry is built at most once per call)."""

    def write(folder: Path) -> Written:
        report = write_converted(model, plan, folder, progress=progress, link=True, digests=True)
        if reports is not None:
            reports.append(report)
        spans = [(t.offset, t.nbytes) for t in out_tensors(plan) if t.nbytes and t.location is None]
        return Written(spans, dict(report.file_digests), report.summary())

    return write


def convert_cached(model: Model, settings: OrtSettings, cache: Cache, *, progress: Optional[Progress] = None,
                   fp16_in_fp32: Optional[bool] = None) -> tuple[Optional[Entry], bool, Optional[ConversionReport]]:
    """(entry, hit, report): the cached conversion of ``model``, built if missing (``ortmem prepare``).

    Returns ``(None, False, None)`` when nothing in the model is convertible. Concurrent creators of
    one entry meet at its creator lock (:func:`ortmem.store.verdict.publish`); a holder that takes
    longer than :func:`ortmem.store.cache.lock_timeout` raises :class:`ortmem.store.cache.LockBusyError`.
    """
    found = start(cache, model.path, settings=settings, fp16_in_fp32=fp16_in_fp32)
    if found.cache_hit:
        return found.entry, True, None
    plan = plan_conversion(model, settings, fp16_in_fp32=fp16_in_fp32)
    if not plan.has_work:
        return None, False, None
    reports: list[ConversionReport] = []
    published = publish(cache, model.path, source_paths(model), entry_writer(model, plan, progress=progress, reports=reports),
                        settings=settings, fp16_in_fp32=fp16_in_fp32)
    return published.entry, published.cache_hit, reports[0] if reports else None


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
