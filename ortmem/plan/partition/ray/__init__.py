"""Partition stages on a Ray cluster (optional extra: ``pip install ortmem[ray]``).

Nothing in the rest of ortmem imports this package; importing it imports Ray.

- :class:`RayPipeline`: a partition plan's stages as Ray actors pinned to their nodes, the same
  ``run`` as :class:`ortmem.PipelineSession`, plus ``submit`` / ``run_many`` (pipelined requests);
- :func:`cluster_nodes`, :func:`cluster_devices`: the cluster's nodes as partition devices
  (``ortmem partition --ray auto``); :func:`check_plan`: does a plan still match the cluster;
- :func:`local_cluster`: a multi-node cluster on 127.0.0.1 for tests and trying it out.

docs/distributed.md has the commands and measurements.
"""
from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("ortmem.plan.partition.ray needs Ray: pip install 'ortmem[ray]'") from e

from ortmem.plan.partition.ray.cluster import (NODE_LABEL, ClusterNode, check_plan, cluster_devices, cluster_nodes, connect, local_cluster)
from ortmem.plan.partition.ray.pipeline import IOArg, RayPipeline, RayRequest

__all__ = ["NODE_LABEL", "ClusterNode", "IOArg", "RayPipeline", "RayRequest", "check_plan", "cluster_devices",
           "cluster_nodes", "connect", "local_cluster"]
