"""Planning from metadata: three packages, each with a small public surface.

- :mod:`ortmem.plan.estimate`: memory predicted from the graph (session creation, activations,
  live bytes over ORT's execution order) and measured per node (``stats``);
- :mod:`ortmem.plan.partition`: modules placed on devices with budgets, one sub-model per stage;
- :mod:`ortmem.plan.recompute`: a lower activation peak by recomputing cheap tensors and reordering.

Names are imported on first use (:mod:`ortmem.base.lazy`), so importing one planner never loads the others.
"""
from __future__ import annotations

from ortmem.errors import PlanError
from ortmem.base.lazy import lazy_attributes

_OWNERS = {
    "NodeCost": "ortmem.plan.partition",
    "PartitionPlan": "ortmem.plan.partition",
    "group_modules": "ortmem.plan.partition",
    "infer_device_map": "ortmem.plan.partition",
}
__all__ = ["PlanError", *_OWNERS]
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
