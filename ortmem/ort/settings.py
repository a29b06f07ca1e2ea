"""The session settings ORT's behaviour depends on, read once from the user's ``SessionOptions``.

Fusion (``session.qdq_*`` entries, optimization level, disabled optimizers), execution order and
pre-packing decide what ORT does with each initializer; the converter, the cache key, the session
and the estimator all take them from :func:`session_settings`, so they can never disagree about what
the user asked for.
"""
from __future__ import annotations

from typing import Any, Iterable, Literal, Mapping, Optional

from ortmem.base.records import record
from ortmem.base.options import get_config

#: ORT's two node orders (``SessionOptions.execution_order``), simulated by :mod:`.graph_index`.
ExecutionOrder = Literal["DEFAULT", "PRIORITY_BASED"]

#: Session config entries the fusion decision reads (ORT's parse of each is in :class:`OrtSettings`).
FUSION_CONFIG_KEYS = ("session.qdq_matmulnbits_accuracy_level", "session.qdq_matmulnbits_block_size",
                      "session.disable_quant_qdq")

#: Config entries ortmem sets itself on the session that saves a finished model (what it writes and where):
#: a caller's value of any of them is overridden there.
SAVE_CONFIG_KEYS = ("session.optimized_model_external_initializers_file_name",
                    "session.optimized_model_external_initializers_min_size_in_bytes",
                    "session.save_external_prepacked_constant_initializers")


@record
class OrtSettings:
    """The session settings ORT's decision depends on, parsed like ORT parses them (a named tuple, as
    every record a warm start imports: :class:`ortmem.session.handoff.Handoff` says why).

    ``graph_optimization_level`` uses ORT's numbers (``onnxruntime.GraphOptimizationLevel`` values work).
    ``session_config`` holds ``SessionOptions.add_session_config_entry`` pairs; the keys read are
    ``session.qdq_matmulnbits_accuracy_level`` (default "4"), ``session.qdq_matmulnbits_block_size``
    (default "0" = 32; "-1" = least padding) and ``session.disable_quant_qdq``.
    ``disabled_optimizers`` mirrors ``InferenceSession(disabled_optimizers=...)``: note that the rule name
    ``DQMatMulToMatMulNBits`` does *not* disable the fusion in 1.31.1 (measured); the transformer name
    ``QDQSelectorActionTransformer`` does.
    """

    graph_optimization_level: int = 99
    session_config: Mapping[str, str] = {}  # read-only by contract, as every field here
    disabled_optimizers: frozenset[str] = frozenset()
    #: ``SessionOptions.execution_order``: the order ORT runs nodes in (activation lifetimes).
    execution_order: ExecutionOrder = "DEFAULT"
    #: ``session.disable_prepacking`` is not "1": kernels copy their weights into packed heap buffers.
    prepacking: bool = True

    @property
    def accuracy_level(self) -> int:
        raw = self.session_config.get("session.qdq_matmulnbits_accuracy_level", "4")
        try:
            level = int(raw)
        except ValueError:
            raise ValueError(f"session.qdq_matmulnbits_accuracy_level={raw!r} is not an integer") from None
        # qdq_actions.cc DQMatMulToMatMulNBitsAction ctor: ORT_ENFORCE(accuracy_level_ >= 0 && <= 4)
        if not 0 <= level <= 4:
            raise ValueError(f"session.qdq_matmulnbits_accuracy_level={level}: ORT fails session creation "
                             "(MatMulNBits accuracy level must be between 0 and 4)")
        return level

    @property
    def block_size_option(self) -> int:
        raw = self.session_config.get("session.qdq_matmulnbits_block_size", "0")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"session.qdq_matmulnbits_block_size={raw!r} is not an integer") from None

    @property
    def qdq_enabled(self) -> bool:
        return (self.session_config.get("session.disable_quant_qdq", "0") != "1"
                and "QDQSelectorActionTransformer" not in self.disabled_optimizers)

    def enabled(self, transformer: str) -> bool:
        return transformer not in self.disabled_optimizers


def session_settings(sess_options: Optional[Any] = None, *, accuracy_level: Optional[int] = None,
                     disabled_optimizers: Optional[Iterable[str]] = None) -> OrtSettings:
    """What ``sess_options`` (an ``onnxruntime.SessionOptions`` or None: ORT's defaults) asks of ORT.

    ``accuracy_level`` overrides the session's ``session.qdq_matmulnbits_accuracy_level`` (``ortmem
    convert --accuracy-level``); ``disabled_optimizers`` is ``InferenceSession``'s keyword.
    """
    config: dict[str, str] = {}
    level = 99
    order: ExecutionOrder = "DEFAULT"
    prepacking = True
    if sess_options is not None:
        level = int(sess_options.graph_optimization_level)
        for key in FUSION_CONFIG_KEYS:
            value = get_config(sess_options, key)
            if value is not None and value != "":
                config[key] = value
        if int(getattr(sess_options, "execution_order", 0)) == 1:
            order = "PRIORITY_BASED"
        prepacking = (get_config(sess_options, "session.disable_prepacking") or "0") != "1"
    if accuracy_level is not None:
        config["session.qdq_matmulnbits_accuracy_level"] = str(accuracy_level)
    return OrtSettings(level, config, frozenset(disabled_optimizers or ()), order, prepacking)


#: What the finishing sessions take of the caller's options: (config entries, intra-op threads).
Packing = tuple[Mapping[str, str], int]


def caller_config(user: Optional[Any]) -> Optional[dict[str, str]]:
    """Every session config entry the caller set (not empty) among the keys the installed ORT build
    defines (:func:`ortmem.ort.release.config_keys`, read from the library itself): what may change
    the model ORT finishes, its kernels or their packing, so what a finished model is keyed by and made
    with. None when this build's keys cannot be read: no finished model may then be used or made. A
    caller without options set nothing: ``{}``, without reading the keys (the first start in a cache
    would otherwise scan ORT's library for them, a quarter of a second here)."""
    if user is None:
        return {}
    from ortmem.ort.release import config_keys

    keys = config_keys()
    if keys is None:
        return None
    return {k: v for k in keys if (v := get_config(user, k))}


def packing_settings(user: Optional[Any]) -> Packing:
    """What of the caller's options the finishing sessions take: every config entry it set that this
    ORT defines (:func:`caller_config`; none where the keys cannot be read) and the intra-op thread
    count (0: ORT's default; it changes no saved byte). Read once, with the rest of the caller's
    settings, by whoever builds a start's request (:class:`ortmem.session.request.Request`)."""
    if user is None:
        return {}, 0
    return caller_config(user) or {}, int(user.intra_op_num_threads or 0)
