"""The store's answer to a session start: one verdict, :class:`~ortmem.store.start.Start`.

Why one entry point: a start asks the store one question (is there something ORT can load instead of
converting this model?) and gets one answer: what ORT loads, what it loads instead if ORT refuses that,
and what is left for after the session's first run. Everything the answer depends on happens behind
:func:`start`: the keys (:mod:`ortmem.files.sources`), every lookup with its trust, digest and sources
checks (:mod:`ortmem.store.cache`), a converted entry's hit with the full check before anything is
derived from it and ORT's finished model of it (:mod:`ortmem.store.hit`), a finished
entry's own check (:mod:`ortmem.store.finished_entries`), and the work left for the background finisher
(:mod:`ortmem.store.finisher`). A miss that converts then publishes its entry through
:func:`ortmem.store.publish.publish`. The caller (:mod:`ortmem.session`) never verifies, discards or
locks anything itself, and the store never asks the release whether ORT saves pre-packed weights:
``prepacked`` says so, decided once when the caller's request was built
(:class:`ortmem.session.request.Request`), as are the settings packing depends on (``packing``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ortmem.base import logs
from ortmem.base.child_env import STORE_FOLDER, cache_folder
from ortmem.ort.settings import OrtSettings, Packing
from ortmem.store.cache import Cache
from ortmem.store.hit import entry_start
from ortmem.store.finished_entries import is_marker, finished_key, settings_record, usable_finished
from ortmem.files.sources import converted_key
from ortmem.store.start import Decision, Start



def start(cache: Optional[Cache], path: Path, *, settings: OrtSettings, fp16_in_fp32: Optional[bool] = None,
          converting: bool = True, prepacked: bool = False, packing: Packing = ({}, 0)) -> Start:
    """:func:`lookup`'s verdict; a miss in a cache that cannot be written, of a model whose entry an
    onnxruntime upgrade made stale, says so once per process (:func:`say_stale`)."""
    verdict = lookup(cache, path, settings=settings, fp16_in_fp32=fp16_in_fp32, converting=converting,
                     prepacked=prepacked, packing=packing)
    if verdict.kind is Decision.MISS and cache is not None and (converting or prepacked) and not cache.writable:
        say_stale(cache, path)
    return verdict


#: Whether this process has said that an entry was made stale by an onnxruntime upgrade, and the
#: models whose entries it has looked through (once each: the look reads every entry's manifest).
_said_stale = False
_looked: set[tuple[str, str]] = set()


def say_stale(cache: Cache, path: Path) -> None:
    """Once per process, when the cache, which cannot be written, holds an entry of ``path`` made with
    another onnxruntime (an upgrade since ``ortmem prepare``), which no lookup finds any more: a warning
    naming the command that rebuilds it (every start converts the model, or loads it as given, until
    then). Only a read-only cache is looked through (reading every entry's manifest): a cache that can
    be written builds the new entry anyway, and the old one ages out. Nothing is said of a model the
    cache never held."""
    global _said_stale
    if _said_stale or cache.writable or (str(cache.root), str(path)) in _looked:
        return
    _looked.add((str(cache.root), str(path)))
    recorded = cache.made_for_other_release(path)
    if recorded is None:
        return
    import onnxruntime as ort

    _said_stale = True
    model = os.path.abspath(path)
    default = cache.root == cache_folder() / STORE_FOLDER
    command = f"ortmem prepare {model}" + ("" if default else f" --cache {cache.root}")
    logs.warning(__name__, "ortmem: the cache entry of %s was made with onnxruntime %s, not %s, and is not used: the cache "
                "cannot be written, so every start converts the model (or loads it as given) until `%s` rebuilds "
                "the entry with this onnxruntime", model, recorded, ort.__version__, command)


def lookup(cache: Optional[Cache], path: Path, *, settings: OrtSettings, fp16_in_fp32: Optional[bool] = None,
           converting: bool = True, prepacked: bool = False, packing: Packing = ({}, 0)) -> Start:
    """The verdict for the model file ``path`` before it is parsed: its converted entry (``converting``),
    as ORT finished it when ``prepacked`` (CPU EP with pre-packing on, and an ORT that saves finished
    models; finished in the background after a first run, :func:`ortmem.store.hit.entry_start`), else its
    finished entry (``prepacked``), else a miss.

    A miss of a model ORT may get unconverted carries, in ``later``, the building of its finished
    entry after the first run (only for a cache that can be written: a read-only deployment leaves
    nothing to do); the handoff starts it only if ORT does get the model unconverted and it is large
    enough (:func:`ortmem.onnxfile.scan.min_finished_bytes`)."""
    if cache is None or not path.is_file():
        return Start(Decision.MISS)
    if converting:
        entry = cache.lookup_sourced(converted_key(path, settings, {"fp16_in_fp32": fp16_in_fp32}))
        if entry is not None:
            return entry_start(cache, entry, prepacked, settings, packing)
    if not prepacked:
        return Start(Decision.MISS)
    config, threads = packing
    key = finished_key(path, settings, config, converting)
    entry = cache.lookup_sourced(key)
    if entry is not None:
        entry = usable_finished(cache, entry)
    if entry is None:  # built after the first run, if ORT gets the model unconverted and the cache can be written
        if not cache.writable:
            return Start(Decision.MISS)
        from ortmem.store.finisher import FinishLater  # only a miss leaves work for later: a warm start never imports it

        return Start(Decision.MISS, later=FinishLater(str(cache.root), key, cache.verify_mode, dict(config), threads,
                                                       kind="finished", source=str(path),
                                                       settings=settings_record(settings, converting)))
    if is_marker(entry):  # ORT packs nothing in this model, and nothing of it was converted: the start is ORT's
        return Start(Decision.UNCONVERTED)
    return Start(Decision.FINISHED, path=entry.model_path, fallback=path, entry=entry, cache=cache)
