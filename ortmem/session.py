"""``ortmem.InferenceSession``: a drop-in for ``onnxruntime.InferenceSession`` that never lets ORT copy weights.

It *is* an ``onnxruntime.InferenceSession`` (a subclass), so every method, property and isinstance
check of ORT's class works unchanged; only the way the model reaches ORT differs (see
:mod:`ortmem.handoff`). The session keeps the handoff object alive for as long as it lives, since
whatever ORT borrows must outlive it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import onnxruntime as ort

from . import handoff as _handoff
from .store.cache import open_cache
from .ortmodel.settings import session_settings
from .hygiene import allocator_hygiene
from .reach.model_facts import RECOMPUTE_METADATA
from .options import get_config, scoped_config
from .ort_original import ORT_SESSION

log = logging.getLogger(__name__)


class InferenceSession(ORT_SESSION):
    """Create an ORT session from a path, bytes, ``onnx.ModelProto`` or :class:`ortmem.Model`.

    ``sess_options``, ``providers`` and ``provider_options`` mean what they mean to ORT and are
    never mutated; the remaining keyword arguments go to ORT as well, except ortmem's own:

    - ``convert``: rewrite DequantizeLinear+MatMul into MatMulNBits ahead of time (default True),
      exactly where ORT's own rule would for these options, so outputs equal ORT's on the QDQ model;
    - ``cache``: True (default) keeps the converted model in the cache (``$ORTMEM_CACHE_DIR``) so the
      next start converts nothing; a path picks the cache folder; False converts into memory that
      ORT borrows (no file written; a higher peak, see ``ortmem.inmemory``), or, when
      ``sess_options`` are given, into a private temporary folder removed after creation (ORT borrows
      memory only through buffers registered on the options object, which ortmem never changes);
    - ``trim``: keep glibc from hoarding what conversion and ORT free during creation, and give it
      back afterwards (:func:`ortmem.hygiene.allocator_hygiene`; default True; a no-op off glibc);
    - ``prepacked``: on a cache hit with the CPU EP, load ORT's pre-packed weights saved beside the
      entry (the first hit saves them), so packed weights are mapped from the page cache instead of
      copied to the heap (default True; :mod:`ortmem.store.prepacked`);
    - ``recompute``: lower the activation peak by recomputing cheap tensors and reordering nodes
      (``True``/``"auto"``, a budget in bytes, a plan string from ``ortmem recompute``, ``"order"``, or a
      dict; see :func:`ortmem.plan.recompute.apply_for_session`), planned for ``dims`` (symbolic
      dimension sizes). A model written by ``ortmem recompute`` always runs with the execution order
      and optimizer settings it records;
    - ``progress``: ``callable(done_bytes, total_bytes, name)`` called while converting;
    - ``verify``: how a cache entry is checked on every warm start: ``"full"`` (default: every byte
      digested, about 0.05 s/GB, see docs/cache-security.md), ``"sampled"`` (a few pages per tensor)
      or ``"off"`` (sizes only). Anything derived from an entry (pre-packing) is checked in full first.
      A cache folder that cannot be used (read-only, someone else's) gives one warning and an
      in-memory conversion.

    ``self.ortmem_report`` tells what was converted (None when nothing was, or on a cache hit),
    ``self.ortmem_cache_hit`` whether the conversion came from the cache, and ``self.ortmem_action``
    what ORT was given (``"converted"``: a cold start; ``"pre-packed"``: a warm start mapping ORT's
    packed weights; ``"cache-hit"``: one loading the entry itself; see ``ortmem.handoff.Handoff.action``).

    Starts: the first (cold) converts into the cache and, after its session's first ``run``, packs
    ORT's weights into the entry in a background process (:mod:`ortmem.store.packer`); from the
    second start on, sessions map them (``ortmem_action == "pre-packed"``). A model ortmem does not
    convert (a path, CPU EP, at least 16 MiB of initializers) gets a *prepared* entry the same way:
    ORT's own save of it with every kernel's pre-packed weights, mapped from the second start on
    (``ortmem_action == "prepared"``; :mod:`ortmem.store.prepared_entries`, ``ortmem prepare`` builds it at
    deploy time, after which a read-only cache folder is enough).
    """

    def __init__(
        self,
        model: _handoff.ModelInput,
        sess_options: Optional[ort.SessionOptions] = None,
        providers: Optional[Sequence[Any]] = None,
        provider_options: Optional[Sequence[dict[Any, Any]]] = None,
        *,
        convert: bool = True,
        cache: Union[bool, str, os.PathLike] = True,
        trim: bool = True,
        prepacked: bool = True,
        recompute: Any = None,
        dims: Optional[dict[str, int]] = None,
        progress: Optional[Callable[[int, int, str], None]] = None,
        verify: str = "full",
        **kwargs: Any,
    ) -> None:
        settings = session_settings(sess_options, disabled_optimizers=kwargs.get("disabled_optimizers"))
        options = _handoff.ConvertOptions(
            enabled=convert and _fusing_providers_only(providers),
            settings=settings,
            cache=None if cache is False else open_cache(None if cache is True else Path(cache), verify=verify),
            progress=progress,
            fp16_in_fp32=False if _gpu_providers(providers) else None,
            sess_options=sess_options,
        )
        options.prepacked = prepacked and settings.prepacking and _cpu_only(providers)
        with allocator_hygiene() if trim else contextlib.nullcontext():
            self._ortmem_handoff = _handoff.prepare(model, options)
            self.ortmem_report = options.report
            self.ortmem_cache_hit = options.cache_hit
            try:
                self.ortmem_recompute = _recompute_changes(self._ortmem_handoff, recompute, dims)
                try:
                    super().__init__(self._ortmem_handoff.model, sess_options, providers, provider_options, **kwargs)
                except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind types
                    if self._ortmem_handoff.fallback is None:
                        raise
                    self._retry_without_prepacked(exc, sess_options, providers, provider_options, **kwargs)
            finally:
                self._ortmem_handoff.after_create()

    @property
    def ortmem_action(self) -> str:
        """What ortmem gave ORT: ``Handoff.action`` ("converted", "pre-packed", "cache-hit", ...)."""
        return self._ortmem_handoff.action

    def run(self, output_names, input_feed, run_options=None):  # type: ignore[override]
        return self._ortmem_ran(super().run(output_names, input_feed, run_options))

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):  # type: ignore[override]
        return self._ortmem_ran(super().run_with_ort_values(output_names, input_dict_ort_values, run_options))

    def _ortmem_ran(self, result: Any) -> Any:
        """After a successful run: what a cold start left for after its first run (one attribute
        test on every later run)."""
        if self._ortmem_handoff.prepack_later is not None:
            self._ortmem_handoff.session_ran()
        return result

    def _retry_without_prepacked(self, exc: Exception, *args: Any, **kwargs: Any) -> None:
        """ORT refused a cache entry's pre-packed model or a prepared entry: discard what it refused
        (no later start tries it again) and load the entry itself, or the model as given."""
        handoff = self._ortmem_handoff
        what = "prepared" if handoff.action == "prepared" else "pre-packed"
        log.warning("ortmem: onnxruntime could not load the %s model %s (%s); using %s",
                    what, handoff.model, exc, handoff.fallback)
        super().__init__(handoff.use_fallback(), *args, **kwargs)

    def _create_inference_session(self, providers, provider_options, disabled_optimizers=None):
        # Called by ORT's __init__ and again by its EP fallback (_reset_session): both need the
        # handoff's config entries, and neither may leave them in the user's options.
        user_options = self._sess_options_initial
        changes = getattr(self, "ortmem_recompute", None) or {}
        config = dict(self._ortmem_handoff.config)
        for key, value in (changes.get("session_config") or {}).items():
            from .plan.recompute import merge_config_value

            config[key] = merge_config_value(key, str(value), get_config(user_options, key) if user_options else None)
        with scoped_config(user_options, config) as options:
            if options is not user_options:  # in-memory files go only on options ortmem made itself
                self._ortmem_handoff.register(options)
            self._sess_options = options
            previous_order = options.execution_order
            if "execution_order" in changes:
                options.execution_order = getattr(ort.ExecutionOrder, str(changes["execution_order"]))
            try:
                super()._create_inference_session(providers, provider_options, disabled_optimizers)
            finally:
                options.execution_order = previous_order
                if self._sess_options is options and options is user_options:
                    self._sess_options = user_options


def _provider_names(providers: Optional[Sequence[Any]]) -> list[str]:
    """The EP names ORT will be given (entries may be ``(name, options)``); ORT's default when None."""
    return [p if isinstance(p, str) else p[0] for p in (providers or ort.get_available_providers())]


def _cpu_only(providers: Optional[Sequence[Any]]) -> bool:
    """True when ORT will run everything on its CPU EP (pre-packed weights are CPU kernel layouts).
    The Azure EP, listed by every default build, only serves remote endpoints and runs no local node."""
    return set(_provider_names(providers)) <= {"CPUExecutionProvider", "AzureExecutionProvider"}


def _fusing_providers_only(providers: Optional[Sequence[Any]]) -> bool:
    """True when every requested provider is one for which ORT fuses DQ+MatMul itself."""
    return all(n in _handoff.FUSING_PROVIDERS for n in _provider_names(providers))


def _gpu_providers(providers: Optional[Sequence[Any]]) -> bool:
    """CUDA and DML run a fused fp16 MatMulNBits in fp16; the CPU EP runs it in fp32."""
    return bool(providers) and any(n in ("CUDAExecutionProvider", "DmlExecutionProvider") for n in _provider_names(providers))




def _recompute_changes(handoff: "_handoff.Handoff", recompute: Any, dims: Optional[dict[str, int]]) -> dict[str, Any]:
    """Plan or replay a recompute rewrite on what ORT is about to get; returns the session changes.

    A model rewritten by ``ortmem recompute`` records its execution order and optimizer settings in
    its metadata: those apply whether or not ``recompute`` is given. A new plan is made on ORT's
    optimized graph, written into a temporary folder that goes once the session exists.
    """
    from .errors import OrtmemError

    if handoff.memory is not None:
        if recompute not in (None, False):
            raise OrtmemError("recompute= needs the converted model on disk: use cache=True (the default)")
        return {}
    skeleton = handoff.skeleton()
    if recompute in (None, False) and not any(p.key.startswith(RECOMPUTE_METADATA) for p in skeleton.metadata_props):
        return {}  # the common case: nothing to plan, nothing recorded (and no planner imported)
    from .plan import recompute as rc

    recorded = rc.recorded_settings(skeleton)
    if recorded or recompute in (None, False):
        return recorded
    workdir = Path(tempfile.mkdtemp(prefix="ortmem-recompute-"))
    handoff.extra_tempdirs.append(workdir)
    new_model, changes = rc.apply_for_session(skeleton, recompute, dims, folder=handoff.folder, workdir=workdir)
    if changes:
        handoff.model = new_model.SerializeToString()
        handoff.config[_handoff.FOLDER_KEY] = str(changes.get("model_folder") or handoff.folder)
    return changes
