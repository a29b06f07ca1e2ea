"""Planning from metadata: three packages, each with a small public surface.

- :mod:`ortmem.plan.estimate`: memory predicted from the graph (session creation, activations,
  live bytes over ORT's execution order) and measured per node (``stats``);
- :mod:`ortmem.plan.partition`: modules placed on devices with budgets, one sub-model per stage;
- :mod:`ortmem.plan.recompute`: a lower activation peak by recomputing cheap tensors and reordering.

Names are imported on first use (:mod:`ortmem.lazy`), so importing one planner never loads the others.
"""
from __future__ import annotations

from ..errors import PlanError
from ..lazy import lazy_attributes

_OWNERS = {
    "NodeCost": ".partition",
    "PartitionPlan": ".partition",
    "group_modules": ".partition",
    "infer_device_map": ".partition",
}
__all__ = ["PlanError", *_OWNERS]
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
