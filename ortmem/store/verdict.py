"""The store's answer to a session start: one verdict, :class:`Start`.

Why one entry point: a start asks the store one question (is there something ORT can load instead of
converting this model?) and gets one answer: what ORT loads, what it loads instead if ORT refuses that,
and what is left for after the session's first run. Everything the answer depends on happens behind
:func:`start` and :func:`publish`: the key, the lookup with its trust and digest checks, the sources
check, the full check before anything is derived from an entry, discarding a damaged entry, the
creator lock, packing ORT's weights on the first hit, prepared entries for models ortmem does not
convert. The caller (:mod:`ortmem.handoff`) never verifies, discards or locks anything itself, and the
store never asks the release whether ORT saves pre-packed weights: ``prepacked`` says so, decided once
when the caller's request was built (:class:`ortmem.handoff.request.Request`). Keys, source records and
the creator lock are the cache's (:mod:`ortmem.store.cache`), the pre-packed files
:mod:`ortmem.store.prepacked`'s, the converted folder the writer's (:mod:`ortmem.store.writer`), the work
left for after the first run the packer's (:mod:`ortmem.store.packer`).

Kinds (:attr:`Start.kind`, also the session's ``ortmem_action`` for a hit):

- ``"pre-packed"``: a converted entry's pre-packed model (ORT maps its packed weights); ``fallback``
  is the entry's own model;
- ``"cache-hit"``: a converted entry's model itself (pre-packing off, not CPU-only, or another
  process is packing it right now);
- ``"prepared"``: a model ortmem does not convert, loaded from its prepared entry
  (:mod:`ortmem.store.prepared_entries`); ``fallback`` is the source itself;
- ``"converted"``: the entry :func:`publish` just built (a cold start);
- ``"miss"``: nothing to load: the caller converts (then :func:`publish`), or gives ORT the model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

import onnx
import onnxruntime as ort

from .. import __version__
from ..errors import CacheError
from ..model import Model
from ..model_facts import min_prepared_bytes
from ..ortmodel.settings import OrtSettings
from .cache import Cache, Entry, LockBusyError, entry_key
from .packer import PrepackLater, prepack_later_for, prepare_later_for
from .prepacked import discard_prepacked, packing_settings, prepacked_model, save_prepacked
from .prepared_entries import is_marker, lookup_prepared, prepared_key
from .writer import Written, entry_writer, source_paths

if TYPE_CHECKING:
    from ..passes.conversion_plan import ConversionPlan, ConversionReport
    from ..passes.writers import Progress

log = logging.getLogger(__name__)

#: Bumped whenever the converted graph for the same input changes (new rewrites, different layouts),
#: so entries written by an older conversion are never taken for hits.
CONVERSION_FORMAT = 3

MISS = "miss"
CONVERTED = "converted"
CACHE_HIT = "cache-hit"
PRE_PACKED = "pre-packed"
PREPARED = "prepared"


@dataclass(frozen=True)
class Start:
    """The store's verdict on one start (see the module docstring for the kinds)."""

    kind: str
    #: What ORT loads (None on a miss).
    path: Optional[Path] = None
    #: What ORT loads instead if it refuses ``path`` (:meth:`refused` removes ``path`` first).
    fallback: Optional[Path] = None
    #: The converted or prepared entry behind ``path``.
    entry: Optional[Entry] = None
    #: Work for after the session's first run (:mod:`ortmem.store.packer`): a new entry's packing,
    #: or, on a miss, building the model's prepared entry (see :meth:`later_for_unconverted`).
    later: Optional[PrepackLater] = None
    cache: Optional[Cache] = None
    #: What :func:`publish` converted (``"converted"`` only; None on a hit or a miss).
    report: Optional["ConversionReport"] = None

    @property
    def cache_hit(self) -> bool:
        """Whether ORT loads a converted entry found in the cache (pre-packed or not)."""
        return self.kind in (CACHE_HIT, PRE_PACKED)

    def refused(self) -> None:
        """ORT refused ``path``: remove what it refused (the entry's pre-packed files, or the prepared
        entry), so no later start tries it again."""
        if self.entry is None:
            return
        if self.kind == PRE_PACKED:
            discard_prepacked(self.entry.path)
        elif self.kind == PREPARED and self.cache is not None:
            self.cache.discard(self.entry)

    def later_for_unconverted(self, weight_bytes: int) -> Optional[PrepackLater]:
        """On a miss that ORT gets unconverted: the building of its prepared entry after the first run,
        for models with at least :func:`ortmem.model_facts.min_prepared_bytes` of initializers (small
        ones stay at zero cost); else None."""
        if self.kind != MISS or weight_bytes < min_prepared_bytes():
            return None
        return self.later


def start(cache: Optional[Cache], path: Path, *, settings: OrtSettings, fp16_in_fp32: Optional[bool] = None,
          converting: bool = True, prepacked: bool = False, sess_options: Optional[object] = None) -> Start:
    """The verdict for the model file ``path`` before it is parsed: its converted entry (``converting``),
    pre-packed when ``prepacked`` (CPU EP with pre-packing on, and an ORT that saves pre-packed weights;
    saved now on the first hit), else its prepared entry (``prepacked``), else a miss. An entry found
    damaged by the full check before packing is discarded and answers a miss."""
    if cache is None or not path.is_file():
        return Start(MISS)
    if converting:
        entry = cache.lookup_sourced(converted_key(path, settings, {"fp16_in_fp32": fp16_in_fp32}))
        if entry is not None:
            hit = _hit(cache, entry, prepacked, sess_options)
            if hit is not None:
                return hit
    if not prepacked:
        return Start(MISS)
    packing = packing_settings(sess_options)
    key = prepared_key(path, settings, packing[0], converting)
    entry = lookup_prepared(cache, key)
    if entry is None:  # built after the first run, if ORT gets the model unconverted and the cache can be written
        later = prepare_later_for(path, key, cache, packing, settings, converting) if cache.writable else None
        return Start(MISS, later=later)
    if is_marker(entry):  # ORT packs nothing in this model: the start is ORT's
        return Start(MISS)
    return Start(PREPARED, path=entry.model_path, fallback=path, entry=entry, cache=cache)


def publish(cache: Cache, model: Model, plan: "ConversionPlan", *, settings: OrtSettings,
            progress: Optional["Progress"] = None, fp16_in_fp32: Optional[bool] = None, prepacked: bool = False,
            sess_options: Optional[object] = None) -> Start:
    """A miss's converted entry: the converted folder of ``model`` under ``plan``
    (:func:`ortmem.store.writer.entry_writer`) is written into a private folder that is published
    atomically as the entry of ``model.path``, recording the files it is made from. Under the entry's
    creator lock: concurrent creators meet there, one builds and the others wait at most
    :func:`ortmem.store.cache.lock_timeout` and take its entry (a hit, answered as :func:`start` would).
    A holder that takes longer raises :class:`LockBusyError` (a ``CacheError``).

    A new entry answers ``"converted"`` with the conversion's report, and with the packing of ORT's
    weights after the first run when ``prepacked`` (:func:`ortmem.store.packer.prepack_later_for`). A
    hit found damaged is discarded and built again, once; a second damaged one answers a miss."""
    key = converted_key(model.path, settings, {"fp16_in_fp32": fp16_in_fp32})
    write = entry_writer(model, plan, progress=progress)
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
            later = prepack_later_for(entry, cache, packing_settings(sess_options)) if prepacked else None
            return Start(CONVERTED, path=entry.model_path, entry=entry, later=later, cache=cache,
                         report=reports[0] if reports else None)
        hit = _hit(cache, entry, prepacked, sess_options)
        if hit is not None:
            return hit
    return Start(MISS)


def converted_key(model_path: Path, settings: OrtSettings, extra: Optional[Mapping[str, Any]] = None) -> str:
    """The key of a model's conversion: the .onnx file's identity, the options the result depends
    on, and the versions that shape it. External data files are checked at lookup (their identities
    are in the manifest), so a warm start finds its entry without parsing the model at all."""
    return entry_key(Path(model_path), {
        "what": "dq-matmulnbits",
        "format": CONVERSION_FORMAT,
        "settings": {"level": settings.graph_optimization_level, "config": dict(settings.session_config),
                     "disabled": sorted(settings.disabled_optimizers)},
        "ortmem": __version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        **(extra or {}),
    })


def _hit(cache: Cache, entry: Entry, prepacked: bool, sess_options: Optional[object]) -> Optional[Start]:
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
    if mode == "full":
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
