"""Planning: memory estimates, per-node stats, device maps and partitioning, recompute."""
from .device_map import PlanError, infer_device_map
from .graph_modules import NodeCost, group_modules

__all__ = ["NodeCost", "PlanError", "group_modules", "infer_device_map"]
