"""``ortmem partition``: a model split over devices with memory budgets, one sub-model per stage.

``driver`` runs the rounds (plan, build, verify) and writes the output folder; the steps are
``graph`` (the graph as the partitioner sees it: node costs, constant chains, modules),
``graph_modules`` (nodes grouped into modules), ``device_map`` (modules placed on devices; the
search behind it, exact and heuristic, in ``placement/``), ``stages`` (stage costs, candidate plans, cuts at module boundaries), ``submodels`` (a
sub-model per stage, the tensors crossing cuts), ``weights`` (the one shared weights.bin),
``ort_session`` (ORT's one-session settings and annotated model), ``verify`` (what a stage's session
holds, by the estimator), ``devices`` (device names to providers, per-session overhead) and
``result`` (``PartitionPlan``: plan.json and the report); ``cli`` is the command.
"""
from __future__ import annotations

from ...lazy import lazy_attributes

_OWNERS = {
    "partition": ".driver",
    "PartitionPlan": ".result",
    "StageInfo": ".result",
    "default_provider": ".devices",
    "is_cpu": ".devices",
    "split_node": ".devices",
    "stage_providers": ".devices",
    "infer_device_map": ".device_map",
    "plan_placement": ".device_map",
    "NodeCost": ".graph_modules",
    "group_modules": ".graph_modules",
    "add_partition_arguments": ".cli",
    "main_partition": ".cli",
}
__all__ = list(_OWNERS)
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
