"""Planning: memory estimates, per-node stats, device maps and partitioning, recompute."""
from ..errors import PlanError
from .device_map import infer_device_map
from .graph_modules import NodeCost, group_modules
from .partition import PartitionPlan

# ``partition`` (the function) is exported as ``ortmem.partition``: re-exporting it here would hide
# the module ``ortmem.plan.partition`` behind a function of the same name.
__all__ = ["NodeCost", "PartitionPlan", "PlanError", "group_modules", "infer_device_map"]
