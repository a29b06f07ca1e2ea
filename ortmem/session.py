"""``ortmem.InferenceSession``: a drop-in for ``onnxruntime.InferenceSession`` that never lets ORT copy weights.

It *is* an ``onnxruntime.InferenceSession`` (a subclass), so every method, property and isinstance
check of ORT's class works unchanged; only the way the model reaches ORT differs (see
:mod:`ortmem.handoff`). The session keeps the handoff object alive for as long as it lives, since
whatever ORT borrows must outlive it.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import onnxruntime as ort

from . import handoff as _handoff
from .options import scoped_config

log = logging.getLogger(__name__)


class InferenceSession(ort.InferenceSession):
    """Create an ORT session from a path, bytes, ``onnx.ModelProto`` or :class:`ortmem.Model`.

    ``sess_options``, ``providers`` and ``provider_options`` mean what they mean to ORT and are
    never mutated; the remaining keyword arguments go to ORT as well.
    """

    def __init__(
        self,
        model: _handoff.ModelInput,
        sess_options: Optional[ort.SessionOptions] = None,
        providers: Optional[Sequence[Any]] = None,
        provider_options: Optional[Sequence[dict[Any, Any]]] = None,
        **kwargs: Any,
    ) -> None:
        self._ortmem_handoff = _handoff.prepare(model)
        try:
            super().__init__(self._ortmem_handoff.model, sess_options, providers, provider_options, **kwargs)
        finally:
            self._ortmem_handoff.after_create()

    def _create_inference_session(self, providers, provider_options, disabled_optimizers=None):
        # Called by ORT's __init__ and again by its EP fallback (_reset_session): both need the
        # handoff's config entries, and neither may leave them in the user's options.
        user_options = self._sess_options_initial
        with scoped_config(user_options, self._ortmem_handoff.config) as options:
            self._sess_options = options
            try:
                super()._create_inference_session(providers, provider_options, disabled_optimizers)
            finally:
                if self._sess_options is options and options is user_options:
                    self._sess_options = user_options
