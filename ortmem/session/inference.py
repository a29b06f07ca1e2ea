"""``ortmem.InferenceSession``: a drop-in for ``onnxruntime.InferenceSession`` that never lets ORT copy weights.

It *is* an ``onnxruntime.InferenceSession`` (a subclass), so every method, property and isinstance
check of ORT's class works unchanged; only the way the model reaches ORT differs (see
:mod:`ortmem.session`). The session keeps the handoff object alive for as long as it lives, since
whatever ORT borrows must outlive it.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import onnxruntime as ort

from ortmem.errors import resource_failure
from ortmem.session.decide import BytesHandoff, ModelInput, bytes_start, prepare
from ortmem.base.hygiene import allocator_hygiene
from ortmem.base.hygiene import trim as release_free_heap
from ortmem.base.logs import warning
from ortmem.base.options import at_defaults
from ortmem.base.ort_class import ORT_SESSION

if TYPE_CHECKING:  # imported by a start whose model needs them (not one decided from the file's bytes)
    from ortmem.session.handoff import Handoff


class InferenceSession(ORT_SESSION):
    """Create an ORT session from a path, bytes, ``onnx.ModelProto`` or :class:`ortmem.Model`.

    ``sess_options``, ``providers`` and ``provider_options`` mean what they mean to ORT and are
    never mutated; the remaining keyword arguments go to ORT as well, except ortmem's own:

    - ``convert``: rewrite DequantizeLinear+MatMul into MatMulNBits ahead of time (default True),
      exactly where ORT's own rule would for these options, so outputs equal ORT's on the QDQ model;
    - ``cache``: True (default) keeps the converted model in the cache (``$ORTMEM_CACHE_DIR``) so the
      next start converts nothing; a path picks the cache folder; False converts into a private
      temporary folder removed once the session exists (ORT maps it as it would an entry, so the peak
      is the cold start's), or, where no temporary folder can be written, into memory that ORT borrows
      (a higher peak, see ``ortmem.session.inmemory``; never with ``sess_options``: ORT borrows memory only
      through buffers registered on the options object, which ortmem never changes);
    - ``trim``: keep glibc from hoarding what a conversion in this process frees
      (:func:`ortmem.base.hygiene.allocator_hygiene` around it), and give back what ORT freed during
      creation afterwards (default True; a no-op off glibc; docs/hygiene.md);
    - ``prepacked``: on a cache hit with the CPU EP, load ORT's finished model of the entry (saved in
      the background after a first run), so packed and optimizer-made weights are mapped from the page
      cache instead of copied to the heap (default True; :mod:`ortmem.store.finished`);
    - ``progress``: ``callable(done_bytes, total_bytes, name)`` called while converting;
    - ``verify``: how a cache entry is checked on every warm start: ``"full"`` (default: every byte
      digested, about 0.05 s/GB, once per boot and again whenever a file changes: a file already found
      whole this boot with the same identity is not read again, :mod:`ortmem.files.stamps`; see
      docs/cache-security.md), ``"always"`` (every byte on every start), ``"sampled"`` (a few pages per
      tensor) or ``"off"`` (sizes only). Anything derived from an entry (pre-packing) is checked in full first.
      A cache folder that cannot be used (read-only, someone else's) gives one warning and a
      conversion without it (as ``cache=False``).

    A model written by ``ortmem recompute`` runs with the execution order and optimizer settings it
    records (for the creation call only; ``self.ortmem_recompute`` names them).

    ``self.ortmem_handoff`` is what ORT was given and what ortmem decided (read-only,
    :class:`ortmem.session.handoff.Handoff`); from it, ``self.ortmem_report`` tells what was converted
    (None when nothing was, or on a cache hit), ``self.ortmem_cache_hit`` whether the conversion came
    from the cache, ``self.ortmem_action`` what ORT was given (``"converted"``: a cold start;
    ``"finished"``: a warm start mapping ORT's finished model and its packed weights; ``"cache-hit"``:
    one loading the entry itself; the values of :class:`ortmem.store.start.Decision`) and
    ``self.ortmem_reason`` why, where that needs saying (``"untouched"``).

    Starts: the first (cold) converts into the cache and, after its session's first ``run``, has ORT
    finish the entry in a background process (:mod:`ortmem.store.finisher`); from the second start on,
    sessions load ORT's finished model with graph optimizations off (``ortmem_action == "finished"``).
    A model ortmem does not convert (a path, CPU EP, at least 16 MiB of initializers) gets a *finished*
    entry the same way: ORT's finished model of it, mapped from the second start on
    (``ortmem_action == "finished"``; :mod:`ortmem.store.finished_entries`, ``ortmem prepare`` builds it at
    deploy time, after which a read-only cache folder is enough).
    """

    def __init__(
        self,
        model: ModelInput,
        sess_options: Optional[ort.SessionOptions] = None,
        providers: Optional[Sequence[Any]] = None,
        provider_options: Optional[Sequence[dict[Any, Any]]] = None,
        *,
        convert: bool = True,
        cache: Union[bool, str, os.PathLike] = True,
        trim: bool = True,
        prepacked: bool = True,
        progress: Optional[Callable[[int, int, str], None]] = None,
        verify: str = "full",
        **kwargs: Any,
    ) -> None:
        # A model file below the finished-entry threshold with nothing to convert is decided from its
        # bytes first (ortmem.onnxfile.scan): the request, the store and the handoff are imported only
        # for a model that needs them (a program whose models ORT gets as they are pays none of it).
        defaults = at_defaults(sess_options, providers, provider_options, kwargs.get("disabled_optimizers"),
                               convert=convert, prepacked=prepacked)
        plain = bytes_start(model, sess_options, convert=convert, cache=cache, verify=verify, at_defaults=defaults)
        request = None
        if plain is None:
            from ortmem.session.request import Request

            request = Request.for_session(sess_options, providers, convert=convert, cache=cache, prepacked=prepacked,
                                          verify=verify, progress=progress,
                                          disabled_optimizers=kwargs.get("disabled_optimizers"), at_defaults=defaults)
        with contextlib.ExitStack() as pinned:
            if trim:  # glibc would keep what a conversion here frees: pin its thresholds (ortmem.base.hygiene)
                pinned.enter_context(allocator_hygiene())
            self._ortmem_handoff = plain if plain is not None else prepare(model, request)
            unpinned = plain is None and _maps_an_entry(self._ortmem_handoff)
            if unpinned:
                # ORT maps every weight of an entry-like folder: its creation runs under glibc's own
                # thresholds. Pinned, each buffer ORT allocates became a fresh mapping with fresh page
                # faults (0.7-0.9 s of a 1.8 s warm start of the 0.6 GB synthetic Llama on onnxruntime
                # 1.32, which packs every weight again to validate the mapped ones; 0.2-0.3 s of its
                # in-process cold start, at the same peak). What ORT frees is given back by the trim after
                # creation. A model ORT gets as given (or from memory it borrows) stays pinned: ORT copies
                # and frees its weights, and unpinned it kept 13.5 MiB more of a model with 16 MiB of
                # weights in If branches (tests/session/test_unconverted.py).
                pinned.close()
            try:
                self._ortmem_handoff = self._ortmem_handoff.with_recorded_settings()
                failure: Optional[str] = None
                short_of_resources = False
                try:
                    super().__init__(self._ortmem_handoff.model, sess_options, providers, provider_options, **kwargs)
                except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind types
                    if self._ortmem_handoff.fallback is None:
                        raise
                    failure, short_of_resources = str(exc), resource_failure(exc)
                # Retried outside the except block: the exception's traceback holds ORT's failed
                # session (its threads, its mappings of the files) until the block is left.
                if failure is not None:
                    self._retry_with_fallback(failure, short_of_resources,
                                              sess_options, providers, provider_options, **kwargs)
            finally:
                self._ortmem_handoff.after_create()
        if trim and unpinned:
            release_free_heap()
        #: What a cold start left for after its first run (started once, by the first run).
        self._ortmem_later = self._ortmem_handoff.later

    @property
    def ortmem_handoff(self) -> Handoff:
        """What ORT was given and what ortmem decided (read-only)."""
        if isinstance(self._ortmem_handoff, BytesHandoff):  # decided from the file's bytes: made on demand
            self._ortmem_handoff = self._ortmem_handoff.handoff()
        return self._ortmem_handoff

    @property
    def ortmem_action(self) -> str:
        """What ortmem gave ORT: the value of ``Handoff.action`` ("converted", "finished", "cache-hit", ...)."""
        action = self._ortmem_handoff.action
        return action if isinstance(action, str) else action.value

    @property
    def ortmem_reason(self) -> str:
        """Why ortmem decided :attr:`ortmem_action`, where that needs saying (``"untouched"``); else ""."""
        return self._ortmem_handoff.reason

    @property
    def ortmem_report(self):
        """What was converted (``ConversionReport``; None when nothing was, or on a cache hit)."""
        return self._ortmem_handoff.report

    @property
    def ortmem_cache_hit(self) -> bool:
        """Whether ORT loads a converted entry found in the cache."""
        return self._ortmem_handoff.cache_hit

    @property
    def ortmem_recompute(self) -> Any:
        """The session changes a model written by ``ortmem recompute`` records (``execution_order``,
        ``session_config``), replayed for this session's creation; empty for any other model."""
        return self.ortmem_handoff.recompute

    def run(self, output_names, input_feed, run_options=None):  # type: ignore[override]
        return self._ortmem_ran(super().run(output_names, input_feed, run_options))

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):  # type: ignore[override]
        return self._ortmem_ran(super().run_with_ort_values(output_names, input_dict_ort_values, run_options))

    def _ortmem_ran(self, result: Any) -> Any:
        """After a successful run: start what a cold start left for after its first run, once (one
        attribute test on every later run)."""
        if self._ortmem_later is not None:
            later, self._ortmem_later = self._ortmem_later, None
            try:
                later.start()
            except Exception as exc:  # noqa: BLE001 - no thread or process left: the run itself succeeded
                warning(__name__, "ortmem: could not start packing in the background (%s); a later start packs", exc)
        return result

    def _retry_with_fallback(self, failure: str, short_of_resources: bool, *args: Any, **kwargs: Any) -> None:
        """ORT failed on ORT's finished model (a converted entry's or a finished entry) or a mapped skeleton: load
        the handoff's fallback (the entry itself, or the model as given). Where ORT refused what it was
        given, the handoff's next step discards it (no later start tries it again); where the process
        ran short of memory, threads or descriptors (:func:`ortmem.errors.resource_failure`) the entry
        is kept, since it is as good as before. Either way what the failed attempt took is given back
        first (its session collected, the heap trimmed), so the fallback needs no more than plain ORT
        would; should it fail too, the caller gets ORT's own error on the fallback, nothing chained."""
        import gc

        from ortmem.store.start import Decision

        refused = self.ortmem_handoff
        what = {Decision.FINISHED: "finished model",
                Decision.MAPPED: "skeleton of the mapped model"}.get(refused.action, "model")
        gc.collect()  # ORT's half-made session, its thread pools and mappings, held by reference cycles
        release_free_heap()
        if short_of_resources:
            warning(__name__, "ortmem: onnxruntime ran short of resources loading the %s %s (%s); using %s "
                    "(the entry is kept)", what, refused.model, failure, refused.fallback)
        else:
            warning(__name__, "ortmem: onnxruntime could not load the %s %s (%s); using %s",
                    what, refused.model, failure, refused.fallback)
        self._ortmem_handoff = refused.refused(keep=short_of_resources)
        super().__init__(self._ortmem_handoff.model, *args, **kwargs)

    def _create_inference_session(self, providers, provider_options, disabled_optimizers=None):
        # Called by ORT's __init__ and again by its EP fallback (_reset_session): both need the
        # handoff's config entries, and neither may leave them in the user's options.
        user_options = self._sess_options_initial
        with self._ortmem_handoff.creation_options(user_options) as options:
            self._sess_options = options
            try:
                super()._create_inference_session(providers, provider_options, disabled_optimizers)
            finally:
                if self._sess_options is options and options is user_options:
                    self._sess_options = user_options


def _maps_an_entry(handoff: Handoff) -> bool:
    """Whether ORT maps every weight of ``handoff``'s model from a folder of ortmem's own (its creation
    runs unpinned, :data:`ortmem.session.handoff.ENTRY_ACTIONS`)."""
    from ortmem.session.handoff import ENTRY_ACTIONS

    return handoff.action in ENTRY_ACTIONS
