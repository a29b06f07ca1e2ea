"""A converted entry found in the cache: what a start loads from it.

Why apart from the lookup (:mod:`ortmem.store.verdict`): a hit is also what a creator finds after
waiting at the entry's creator lock (:mod:`ortmem.store.publish`), and both answer it the same way.
This is the one place that packs ORT's weights on a first hit, and the one that decides a start
never waits for another packer.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..errors import CacheError
from .cache import Cache, LockBusyError
from .digest import FULL_MODES
from .layout import Entry
from .prepacked import prepacked_model, save_prepacked
from .start import CACHE_HIT, PRE_PACKED, Start

log = logging.getLogger(__name__)


def entry_start(cache: Cache, entry: Entry, prepacked: bool, sess_options: Optional[object]) -> Optional[Start]:
    """A converted entry's verdict: its pre-packed model when ``prepacked`` (saved now if this is the
    first hit, or if the saved one is for another CPU or ORT), else the entry. None when the entry
    turned out damaged (it is discarded; the caller converts again).

    Nothing is derived from an entry that was not checked in full: before packing, an entry looked
    up with ``verify="sampled"``/``"off"`` is digested whole (a byte flipped in weights.bin would
    otherwise be baked into every later session's pre-packed weights).

    The packing is normally done by then: the cold start left it to a background process after its
    session's first run (:mod:`ortmem.store.packer`). Otherwise (small weights, no run yet, a packer
    that failed) this start packs, once, under the entry's creator lock, before ORT's session exists,
    in groups of a few tensors, peaking well under the session itself. It never waits for that lock:
    whoever holds it (the packer, another worker packing, a process stopped or starved while it
    packs) may take longer than ORT takes to load the entry itself, so a start that finds the lock
    taken loads the entry at once ("cache-hit"; a later start maps the pre-packed weights).
    """
    if prepacked:
        mode = cache.verify_mode
        path = prepacked_model(entry.path, mode)
        if path is None:
            try:
                with cache.creating(entry.key, timeout=0):  # N workers, or the background packer: one packs
                    if _damaged_for_packing(cache, entry, mode):
                        return None
                    path = prepacked_model(entry.path, mode) or _save_prepacked(cache, entry, sess_options)
            except LockBusyError as exc:
                log.info("ortmem: another process is packing %s (%s); loading the entry itself", entry.path, exc)
        if path is not None:
            return Start(PRE_PACKED, path=path, fallback=entry.model_path, entry=entry, cache=cache)
    return Start(CACHE_HIT, path=entry.model_path, entry=entry, cache=cache)


def _damaged_for_packing(cache: Cache, entry: Entry, mode: str) -> bool:
    """Check an entry looked up with ``verify="sampled"``/``"off"`` in full before packing from it;
    a damaged one is discarded (True: the caller converts again)."""
    if mode in FULL_MODES:
        return False
    problem = cache.verify(entry, mode="full")
    if problem is None:
        return False
    log.warning("ortmem: cache entry %s is damaged (%s); rebuilding", entry.path, problem)
    cache.discard(entry)
    return True


def _save_prepacked(cache: Cache, entry: Entry, sess_options: Optional[object]) -> Optional[Path]:
    """Pack and save the entry's pre-packed weights; None (logged) when ORT packs none or it fails."""
    path = None
    try:
        path = save_prepacked(entry.path, sess_options=sess_options)
        if path is not None:
            cache.enforce_limit(keep=entry.key)  # the entry just grew
    except CacheError as exc:
        log.warning("ortmem: could not save pre-packed weights for %s (%s); loading %s",
                    entry.path, exc, entry.model_path.name)
    return path
