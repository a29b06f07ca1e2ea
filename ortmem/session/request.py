"""What the caller of a start asked, decided once: a frozen :class:`Request`.

Why frozen: the handoff is built once from the request, and what was decided (a report, a cache hit,
an action) lives on the handoff, never written back into the request; a request can be shared and
reused. Why here, apart from :mod:`ortmem.session.decide`: everything a start depends on that is asked of ORT (its
settings for the caller's options, the providers, whether this release saves pre-packed weights) is
asked once, while the request is built, so neither the handoff nor the store asks again.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from ortmem.base.records import record
from ortmem.ort.providers import cpu_only, fusing_only, runs_fp16_on_gpu, session_provider_names
from ortmem.ort.release import capabilities
from ortmem.ort.settings import OrtSettings, Packing, caller_config, session_settings
from ortmem.store.cache import Cache, open_cache

if TYPE_CHECKING:  # the passes are imported only by a start that converts
    from ortmem.passes.writers import Progress


@record
class Request:
    """What the hook may do to the graph before ORT sees it, and with what (a named tuple, as every
    record a warm start imports: :class:`ortmem.session.handoff.Handoff` says why)."""

    #: Rewrite what ORT would fuse (DQ+MatMul into MatMulNBits...) ahead of time.
    converting: bool = True
    settings: OrtSettings = OrtSettings()
    #: None: converted in memory (or a private temporary folder), nothing kept.
    cache: Optional[Cache] = None
    progress: Optional[Progress] = None
    #: None: ask ORT's CPU EP; False when a GPU EP runs fp16 natively.
    fp16_in_fp32: Optional[bool] = None
    #: Load ORT's pre-packed weights from the cache (converted entries' pre-packed files, finished
    #: entries): CPU EP only, only when ORT pre-packs at all, only where this ORT saves pre-packed
    #: weights (``capabilities().prepacked_save``, asked by :meth:`for_session`; the store takes this
    #: answer and never asks the release), and only where every config entry the caller may have set
    #: can be read (:func:`ortmem.ort.settings.caller_config`).
    prepacked: bool = False
    #: What the finishing sessions take of the caller's options (every config entry it set that this
    #: ORT defines, intra-op threads; :func:`ortmem.ort.settings.packing_settings`): part of a
    #: finished entry's key, and what the background job after the first run makes it with.
    packing: Packing = (MappingProxyType({}), 0)
    #: The caller's ``SessionOptions`` (never changed; the packing sessions copy its MLAS settings).
    sess_options: Optional[Any] = None
    #: The call leaves ORT at its defaults in everything its finished model depends on
    #: (:func:`ortmem.base.options.at_defaults`): the store's verdict that the file is best given as it
    #: is then holds for every such start, and is kept with its handoff record.
    at_defaults: bool = False

    @classmethod
    def for_session(cls, sess_options: Optional[Any], providers: Optional[Sequence[Any]], *, convert: bool = True,
                    cache: Union[bool, str, os.PathLike] = True, prepacked: bool = True, verify: str = "full",
                    progress: Optional[Progress] = None, disabled_optimizers: Any = None,
                    at_defaults: bool = False) -> "Request":
        """The request of an ``ortmem.InferenceSession(...)`` call (its arguments mean what they mean there)."""
        settings = session_settings(sess_options, disabled_optimizers=disabled_optimizers)
        names = session_provider_names(providers)
        config = caller_config(sess_options)
        threads = int(sess_options.intra_op_num_threads or 0) if sess_options is not None else 0
        return cls(
            converting=convert and fusing_only(names),
            settings=settings,
            cache=None if cache is False else open_cache(None if cache is True else Path(cache), verify=verify),
            progress=progress,
            fp16_in_fp32=False if providers and runs_fp16_on_gpu(names) else None,
            prepacked=(prepacked and settings.prepacking and cpu_only(names) and config is not None
                       and capabilities().prepacked_save),
            packing=(MappingProxyType(config or {}), threads),
            sess_options=sess_options,
            at_defaults=at_defaults,
        )


#: The handoff of a model with nothing to convert (``prepare(model)`` without a request).
AS_GIVEN = Request(converting=False)
