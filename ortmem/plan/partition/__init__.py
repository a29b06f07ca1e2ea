"""``ortmem partition``: a model split over devices with memory budgets, one sub-model per stage.

``driver`` runs the rounds (plan, build, verify) and writes the output folder; the steps are
``graph`` (the graph as the partitioner sees it: node costs, constant chains, modules),
``graph_modules`` (nodes grouped into modules), ``device_map`` (modules placed on devices; the
search behind it, exact and heuristic, in ``placement/``), ``stages`` (stage costs, candidate plans, cuts at module boundaries), ``submodels`` (a
sub-model per stage, the tensors crossing cuts), ``stage_weights`` (the one shared weights.bin),
``ort_session`` (ORT's one-session settings and annotated model), ``verify`` (what a stage's session
holds, by the estimator), ``devices`` (device names to providers, per-session overhead) and
``partition_plan`` (``PartitionPlan``: plan.json and the report); ``partition_command`` is the command;
``run/`` runs a plan in one process (``PipelineSession``), ``ray/`` over a Ray cluster (``RayPipeline``).
"""
from __future__ import annotations

from ortmem.base.lazy import lazy_attributes

_OWNERS = {
    "partition": "ortmem.plan.partition.driver",
    "PartitionPlan": "ortmem.plan.partition.partition_plan",
    "StageInfo": "ortmem.plan.partition.partition_plan",
    "default_provider": "ortmem.plan.partition.devices",
    "is_cpu": "ortmem.plan.partition.devices",
    "split_node": "ortmem.plan.partition.devices",
    "stage_providers": "ortmem.plan.partition.devices",
    "infer_device_map": "ortmem.plan.partition.device_map",
    "plan_placement": "ortmem.plan.partition.device_map",
    "NodeCost": "ortmem.plan.partition.graph_modules",
    "group_modules": "ortmem.plan.partition.graph_modules",
    "add_partition_arguments": "ortmem.plan.partition.partition_command",
    "main_partition": "ortmem.plan.partition.partition_command",
}
__all__ = list(_OWNERS)
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
