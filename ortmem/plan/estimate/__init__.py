"""Memory from metadata: what a session holds after creation and what its activations peak at.

``estimate`` predicts session-creation memory for ORT and ortmem (``estimator``: the method and the
entry point; ``recipe``: what ORT does with each initializer; ``creation``: creation replayed through
``memsim``, glibc's heap; ``calibration``: the fitted constants; ``result``: ``Estimate`` and its
rendering; ``shapes``: shape inference; ``activations``: lifetimes; ``fusions``: what ORT fuses that changes them; ``graph_context``: the ``Context`` estimate and
liveness share); ``liveness`` replays live bytes over ORT's execution order;
``stats`` measures per-node memory with ORT itself (``node_stats``); ``cli`` is ``ortmem estimate`` and
``ortmem stats``. The graph index under all of them is :mod:`ortmem.ortmodel.graph_index`.
"""
from __future__ import annotations

from ...lazy import lazy_attributes

_OWNERS = {
    "Calibration": ".calibration",
    "Estimate": ".result",
    "estimate": ".estimator",
    "render": ".result",
    "tensor_bytes": ".recipe",
    "Context": ".graph_context",
    "ModelLike": ".graph_context",
    "load_proto": ".graph_context",
    "Liveness": ".liveness",
    "analyze": ".liveness",
    "by_order": ".liveness",
    "context": ".liveness",
    "ort_optimized": ".liveness",
    "NodeStats": ".node_stats",
    "read_csv": ".node_stats",
    "stats": ".node_stats",
    "write_csv": ".node_stats",
    "add_estimate_arguments": ".cli",
    "add_stats_arguments": ".cli",
    "main_estimate": ".cli",
    "main_stats": ".cli",
}
__all__ = list(_OWNERS)
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
