"""A miss's converted entry: written, published atomically, and handed back as a verdict.

Why apart from the lookup (:mod:`ortmem.store.verdict`): only a start that converts publishes, and it
comes here with the model loaded and its conversion planned; a warm start never imports this. A
start whose conversion ran in a helper process (:mod:`ortmem.handoff.conversion_process`) takes only
:func:`new_entry_start` from here: the writer, and with it the passes and onnx, is imported by
:func:`publish` alone. The folder is the writer's (:mod:`ortmem.store.writer`), keys and source records are
:mod:`ortmem.store.sources`', publishing and the creator lock the cache's (:mod:`ortmem.store.cache`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..model import Model
from ..ortmodel.settings import OrtSettings, Packing
from .cache import Cache
from .hit import entry_start
from .layout import Entry
from .packer import MIN_WEIGHT_BYTES, PrepackLater
from .sources import converted_key
from .start import CONVERTED, MISS, Start

if TYPE_CHECKING:
    from ..passes.conversion_plan import ConversionPlan
    from ..passes.conversion_report import ConversionReport
    from ..passes.writers import Progress
    from .writer import Written

def publish(cache: Cache, model: Model, plan: "ConversionPlan", *, settings: OrtSettings,
            progress: Optional["Progress"] = None, fp16_in_fp32: Optional[bool] = None, prepacked: bool = False,
            packing: Packing = ({}, 0), sess_options: Optional[object] = None) -> Start:
    """A miss's converted entry: the converted folder of ``model`` under ``plan``
    (:func:`ortmem.store.writer.entry_writer`) is written into a private folder that is published
    atomically as the entry of ``model.path``, recording the files it is made from. Under the entry's
    creator lock: concurrent creators meet there, one builds and the others wait at most
    :func:`ortmem.store.cache.lock_timeout` and take its entry (a hit, :func:`ortmem.store.hit.entry_start`).
    A holder that takes longer raises :class:`ortmem.store.cache.LockBusyError` (a ``CacheError``).

    A new entry answers ``"converted"`` (:func:`new_entry_start`). A hit found damaged is discarded and built again, once; a second damaged one answers a miss."""
    from .writer import entry_writer, source_paths  # the passes, and onnx: only a start that converts here

    key = converted_key(model.path, settings, {"fp16_in_fp32": fp16_in_fp32})
    # as many threads as ORT's own fusion would take for the caller's options (packing[1]: intra-op)
    write = entry_writer(model, plan, progress=progress, threads=packing[1])
    reports: list["ConversionReport"] = []

    def build(folder: Path) -> dict[str, Any]:
        written: Written = write(folder)
        reports.append(written.report)
        return {"spans": written.spans, "report": written.summary, "digests": written.digests}

    for _ in range(2):
        with cache.creating(key):
            entry = cache.lookup_sourced(key)  # built while we waited?
            built = entry is None
            if built:
                entry = cache.build_sourced(key, model.path, source_paths(model), build)
        if built:
            return new_entry_start(cache, entry, reports[0] if reports else None, prepacked=prepacked, packing=packing)
        hit = entry_start(cache, entry, prepacked, sess_options)
        if hit is not None:
            return hit
    return Start(MISS)


def new_entry_start(cache: Cache, entry: Entry, report: Optional["ConversionReport"], *, prepacked: bool,
                    packing: Packing) -> Start:
    """The verdict on an entry just built (here or by a helper process): ``"converted"``, with the
    conversion's report and, when ``prepacked``, the packing of ORT's weights after the session's first
    run (with ``packing``, the caller's settings packing depends on); below
    :data:`ortmem.store.packer.MIN_WEIGHT_BYTES` of weights the first hit packs instead."""
    later = None
    if prepacked and _weight_bytes(entry.weights_path) >= MIN_WEIGHT_BYTES:
        config, threads = packing
        later = PrepackLater(str(cache.root), entry.key, cache.verify_mode, dict(config), threads)
    return Start(CONVERTED, path=entry.model_path, entry=entry, later=later, cache=cache, report=report)


def _weight_bytes(path: Path) -> int:
    """The size of a new entry's ``weights.bin`` (0 when it cannot be read: the first hit packs)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
