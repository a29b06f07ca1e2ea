"""Memory from metadata: what a session holds after creation and what its activations peak at.

``estimate`` predicts session-creation memory for ORT and ortmem (``estimator``: the method and the
entry point; ``recipe``: what ORT does with each initializer; ``creation``: creation replayed through
``memsim``, glibc's heap; ``calibration``: the fitted constants; ``result``: ``Estimate`` and its
rendering; ``shapes``: shape inference; ``activations``: lifetimes; ``fusions``: what ORT fuses that changes them; ``graph_context``: the ``Context`` estimate and
liveness share); ``liveness`` replays live bytes over ORT's execution order;
``stats`` measures per-node memory with ORT itself (``node_stats``); ``estimate_command`` is ``ortmem estimate``
and ``ortmem stats``. The graph index under all of them is :mod:`ortmem.ort.graph_index`.
"""
from __future__ import annotations

from ortmem.base.lazy import lazy_attributes

_OWNERS = {
    "Calibration": "ortmem.plan.estimate.calibration",
    "Estimate": "ortmem.plan.estimate.result",
    "estimate": "ortmem.plan.estimate.estimator",
    "render": "ortmem.plan.estimate.result",
    "tensor_bytes": "ortmem.plan.estimate.recipe",
    "Context": "ortmem.plan.estimate.graph_context",
    "ModelLike": "ortmem.plan.estimate.graph_context",
    "load_proto": "ortmem.plan.estimate.graph_context",
    "Liveness": "ortmem.plan.estimate.liveness",
    "analyze": "ortmem.plan.estimate.liveness",
    "by_order": "ortmem.plan.estimate.liveness",
    "context": "ortmem.plan.estimate.liveness",
    "ort_optimized": "ortmem.plan.estimate.liveness",
    "NodeStats": "ortmem.plan.estimate.node_stats",
    "read_csv": "ortmem.plan.estimate.node_stats",
    "stats": "ortmem.plan.estimate.node_stats",
    "write_csv": "ortmem.plan.estimate.node_stats",
    "add_estimate_arguments": "ortmem.plan.estimate.estimate_command",
    "add_stats_arguments": "ortmem.plan.estimate.estimate_command",
    "main_estimate": "ortmem.plan.estimate.estimate_command",
    "main_stats": "ortmem.plan.estimate.estimate_command",
}
__all__ = list(_OWNERS)
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
