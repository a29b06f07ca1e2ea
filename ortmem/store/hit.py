"""A converted entry found in the cache: what a start loads from it.

Why apart from the lookup (:mod:`ortmem.store.verdict`): a hit is also what a creator finds after
waiting at the entry's creator lock (:mod:`ortmem.store.publish`), and both answer it the same way.
A hit never packs or finishes anything and never waits for another process: ORT's finished model is
made in the background after a session's first run (:mod:`ortmem.store.finisher`).
"""
from __future__ import annotations


from ortmem.ort.settings import OrtSettings, Packing
from ortmem.store.cache import Cache
from ortmem.files.layout import Entry
from ortmem.store.finished_entries import converted_finished, finishing_settings, settings_record
from ortmem.store.start import Decision, Start



def entry_start(cache: Cache, entry: Entry, finishing: bool, settings: OrtSettings, packing: Packing) -> Start:
    """A converted entry's verdict: when ``finishing`` (CPU EP with pre-packing on, an ORT that saves
    finished models, every config entry of the caller readable), ORT's finished model of the entry at
    the caller's settings (``FINISHED``, checked as the cache's ``verify`` asks), else the entry itself
    (``CACHE_HIT``). An entry not finished yet for these settings carries, in ``later``, the background
    job that finishes it after this session's first run (:class:`ortmem.store.finisher.FinishLater`: only
    in a cache that can be written, and for weights of at least
    :func:`ortmem.onnxfile.scan.min_finished_bytes`)."""
    if not finishing:
        return Start(Decision.CACHE_HIT, path=entry.model_path, entry=entry, cache=cache, hit=True)
    path, settled = converted_finished(cache, entry, finishing_settings(settings, packing[0]))
    if path is not None:
        return Start(Decision.FINISHED, path=path, fallback=entry.model_path, entry=entry, cache=cache, hit=True)
    if settled:
        return Start(Decision.CACHE_HIT, path=entry.model_path, entry=entry, cache=cache, hit=True)
    from ortmem.store.finisher import FinishLater  # only a start that leaves work for later imports the finisher

    later = FinishLater(str(cache.root), entry.key, cache.verify_mode, dict(packing[0]), packing[1],
                        kind="converted", settings=settings_record(settings, True))
    return Start(Decision.CACHE_HIT, path=entry.model_path, entry=entry, cache=cache, later=later, hit=True)
