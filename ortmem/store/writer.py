"""The store's writer: a loaded model and its conversion plan in, a converted model folder out.

The folder holds ``model.onnx`` (the rewritten skeleton) and ``weights.bin`` (every weight,
page-aligned; the names are the store's folder format, :mod:`ortmem.files.layout`). It is what a cache
entry holds (:func:`ortmem.store.publish.publish` writes it through :func:`entry_writer`), what
``ortmem convert`` writes into a folder of the user's (:func:`ortmem.session.convert.convert_to`) and what a
converting start writes into a private temporary folder; ORT loads it by path and memory-maps each
tensor, so nothing is copied again. Keys, lookups, source records and publishing are the rest of the
store's: this module only writes the folder it is given.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ortmem.files import digest
from ortmem.files.layout import MODEL_FILE, SOURCE_LINK_PREFIX, WEIGHTS_FILE
from ortmem.files.trust import PRIVATE_FILE_MODE, reserve, write_new
from ortmem.onnxfile.model import Model
from ortmem.passes.engine import rewrite_skeleton, write_weights
from ortmem.passes.conversion_plan import ConversionPlan, out_tensors, relocate_carried
from ortmem.passes.conversion_report import ConversionReport
from ortmem.passes.writers import Progress


@dataclass(frozen=True)
class Written:
    """What a conversion wrote into a new entry's folder, for its manifest: the spans of the converted
    tensors in ``weights.bin``, the full digests taken while writing, and the report (its summary goes
    into the manifest, the report itself to the start that converted)."""

    spans: list[tuple[int, int]]
    digests: dict[str, str]
    summary: dict[str, Any]
    report: ConversionReport


def write_converted(model: Model, plan: ConversionPlan, out_dir: Path, *, progress: Optional[Progress] = None,
                    link: bool = False, mode: int = PRIVATE_FILE_MODE, digests: bool = False,
                    threads: int = 0) -> ConversionReport:
    """Write ``model.onnx`` + ``weights.bin`` for ``plan`` into the existing folder ``out_dir``.

    ``link``: hard-link source files instead of copying unchanged tensors (cache entries: free and
    instant; not for ``ortmem convert``, whose output must not change if the source is edited in place).
    Files are created new (never through a planted file or symlink) with ``mode``.
    ``digests``: put the full digests of both files in ``report.file_digests``, computed from the
    bytes as they are written (a cache entry's manifest records them; nothing is read back).
    ``threads``: how many convert, counted as ORT's ``intra_op_num_threads`` (0: one per physical core;
    :func:`ortmem.passes.writers.conversion_threads`), so a cold start takes what ORT's fusion would.
    """
    start = time.perf_counter()
    if link:
        relocate_carried(plan, link_sources(plan, out_dir))
    weights = out_dir / WEIGHTS_FILE
    fd = reserve(weights, plan.size, mode)  # a full disk fails here, before anything is mapped
    os.close(fd)
    weights_digest = write_weights(model, plan, weights, progress=progress, digest=digests, threads=threads)
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
                 threads: int = 0) -> Callable[[Path], Written]:
    """What fills a new cache entry's folder: the converted model with hard-linked sources, and the
    digests taken while writing (on ``threads`` threads; default as in :func:`write_converted`)."""

    def write(folder: Path) -> Written:
        report = write_converted(model, plan, folder, progress=progress, link=True, digests=True, threads=threads)
        spans = [(t.offset, t.nbytes) for t in out_tensors(plan) if t.nbytes and t.location is None]
        return Written(spans, dict(report.file_digests), report.summary(), report)

    return write
