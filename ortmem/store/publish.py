"""A miss's converted entry: written, published atomically, and handed back as a verdict.

Why apart from the lookup (:mod:`ortmem.store.verdict`): only a start that converts publishes, and it
comes here with the model loaded and its conversion planned; a warm start never imports this. A
start whose conversion ran in a helper process (:mod:`ortmem.session.cold_start_child`) takes only
:func:`new_entry_start` from here: the writer, and with it the passes and onnx, is imported by
:func:`publish` alone. The folder is the writer's (:mod:`ortmem.store.writer`), keys and source records are
:mod:`ortmem.files.sources`', publishing and the creator lock the cache's (:mod:`ortmem.store.cache`).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ortmem.onnxfile.model import Model
from ortmem.ort.settings import OrtSettings, Packing
from ortmem.store.cache import Cache
from ortmem.store.hit import entry_start
from ortmem.store.finisher import FinishLater
from ortmem.files.layout import Entry
from ortmem.files.sources import converted_key
from ortmem.store.start import Decision, Start

if TYPE_CHECKING:
    from ortmem.passes.conversion_plan import ConversionPlan
    from ortmem.passes.conversion_report import ConversionReport
    from ortmem.passes.writers import Progress
    from ortmem.store.writer import Written

def publish(cache: Cache, model: Model, plan: "ConversionPlan", *, settings: OrtSettings,
            progress: Optional["Progress"] = None, fp16_in_fp32: Optional[bool] = None, prepacked: bool = False,
            packing: Packing = ({}, 0)) -> Start:
    """A miss's converted entry: the converted folder of ``model`` under ``plan``
    (:func:`ortmem.store.writer.entry_writer`) is written into a private folder that is published
    atomically as the entry of ``model.path``, recording the files it is made from. Under the entry's
    creator lock: concurrent creators meet there, one builds and the others wait at most
    :func:`ortmem.store.cache.lock_timeout` and take its entry (a hit, :func:`ortmem.store.hit.entry_start`).
    A holder that takes longer raises :class:`ortmem.store.cache.LockBusyError` (a ``CacheError``).

    A new entry answers ``"converted"`` (:func:`new_entry_start`)."""
    from ortmem.store.writer import entry_writer, source_paths  # the passes, and onnx: only a start that converts here

    key = converted_key(model.path, settings, {"fp16_in_fp32": fp16_in_fp32})
    # as many threads as ORT's own fusion would take for the caller's options (packing[1]: intra-op)
    write = entry_writer(model, plan, progress=progress, threads=packing[1])
    reports: list["ConversionReport"] = []

    def build(folder: Path) -> dict[str, Any]:
        written: Written = write(folder)
        reports.append(written.report)
        return {"spans": written.spans, "report": written.summary, "digests": written.digests}

    with cache.creating(key):
        entry = cache.lookup_sourced(key)  # built while we waited? (checked as the cache's verify asks)
        built = entry is None
        if built:
            entry = cache.build_sourced(key, model.path, source_paths(model), build)
    if built:
        return new_entry_start(cache, entry, reports[0] if reports else None, finishing=prepacked,
                               settings=settings, packing=packing)
    return entry_start(cache, entry, prepacked, settings, packing)


def new_entry_start(cache: Cache, entry: Entry, report: Optional["ConversionReport"], *, finishing: bool,
                    settings: OrtSettings, packing: Packing) -> Start:
    """The verdict on an entry just built (here or by a helper process): ``CONVERTED``, with the
    conversion's report and, when ``finishing``, ORT's finishing of the entry at the caller's
    ``settings`` and ``packing`` after the session's first run (:class:`ortmem.store.finisher.FinishLater`,
    which starts nothing for small weights or a read-only cache)."""
    later = None
    if finishing:  # the settings as ortmem.store.finished_entries.settings_record writes them
        record = {"level": settings.graph_optimization_level, "config": dict(settings.session_config),
                  "disabled": sorted(settings.disabled_optimizers), "converting": True}
        later = FinishLater(str(cache.root), entry.key, cache.verify_mode, dict(packing[0]), packing[1],
                            kind="converted", settings=record)
    return Start(Decision.CONVERTED, path=entry.model_path, entry=entry, later=later, cache=cache, report=report)
