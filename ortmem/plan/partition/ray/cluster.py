"""Ray cluster nodes as partition devices, and whether a plan still matches the cluster.

A node's name is the value of its Ray label :data:`NODE_LABEL` (``ray start --labels
ortmem-node=n1``) or, without one, its IP address. Labels survive a node's restart (its
Ray node id does not) and tell apart several nodes on one host (test clusters). A device on a node is
``node:<name>/<device>`` (:func:`ortmem.plan.partition.split_node`); ``--ray auto`` gives
every alive node one CPU device whose budget is the node's Ray ``memory`` resource (what actors may
reserve there: ``ray start --memory``, by default the node's available memory).

Budgets here are what the plan charges (weights, activations, per-session overhead above a process
baseline); the actor's own Python and Ray worker (tens of MiB) come on top, as they do for
:class:`ortmem.plan.partition.run.pipeline_session.PipelineSession`'s process.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import ray

from ortmem.errors import PlanError
from ortmem.plan.partition import PartitionPlan

#: Ray node label that names a node for ortmem (else the node's IP address names it).
NODE_LABEL = "ortmem-node"


@dataclass(frozen=True)
class ClusterNode:
    """One alive Ray node as ortmem sees it."""

    name: str
    node_id: str
    ip: str
    memory_bytes: int  # Ray's logical "memory" resource: what actors may reserve here
    resources: dict[str, float] = field(default_factory=dict, compare=False)


def connect(address: str | None = None) -> None:
    """Connect this process to a running cluster (``address``, else ``RAY_ADDRESS`` / the local one)
    unless it already is."""
    if not ray.is_initialized():
        ray.init(address=address or "auto", log_to_driver=False)


def cluster_nodes() -> list[ClusterNode]:
    """The alive nodes, named by label or IP (an IP shared by unlabelled nodes gets ``#<node id>``)."""
    rows = [n for n in ray.nodes() if n.get("Alive")]
    ips: dict[str, int] = {}
    for n in rows:
        ips[n["NodeManagerAddress"]] = ips.get(n["NodeManagerAddress"], 0) + 1
    out = []
    for n in rows:
        ip = n["NodeManagerAddress"]
        name = (n.get("Labels") or {}).get(NODE_LABEL) or (ip if ips[ip] == 1 else f"{ip}#{n['NodeID'][:8]}")
        res = dict(n.get("Resources") or {})
        out.append(ClusterNode(name, n["NodeID"], ip, int(res.get("memory", 0)), res))
    return sorted(out, key=lambda c: c.name)


def cluster_devices(nodes: Sequence[ClusterNode] | None = None, fraction: float = 1.0) -> dict[str, int]:
    """``{"node:<name>/cpu": budget}`` for every alive node (``ortmem partition --ray auto``): the
    node's Ray ``memory`` times ``fraction`` (below 1 keeps room for what the estimator misses;
    docs/distributed.md)."""
    if not 0 < fraction <= 1:
        raise PlanError(f"fraction must be in (0, 1], got {fraction!r}")
    return {f"node:{n.name}/cpu": int(n.memory_bytes * fraction) for n in (cluster_nodes() if nodes is None else nodes)}


def find_node(nodes: Sequence[ClusterNode], name: str) -> ClusterNode | None:
    """The node a plan's node name means: its label, else its IP when one node has it."""
    exact = [n for n in nodes if n.name == name]
    if exact:
        return exact[0]
    by_ip = [n for n in nodes if n.ip == name]
    return by_ip[0] if len(by_ip) == 1 else None


def stage_reservations(plan: PartitionPlan) -> list[int]:
    """Bytes each stage's actor reserves (Ray ``memory``): its planned bytes, scaled so that a
    device's stages reserve its placed bytes together (weights shared by two stages counted once)."""
    out = []
    for st in plan.stages:
        dev = next((d for d in plan.devices if d.name == st.device), None)
        mine = [s.bytes for s in plan.stages if s.device == st.device]
        total = sum(mine)
        share = st.bytes if dev is None or total <= 0 else st.bytes * dev.placed_bytes // total
        out.append(max(1, int(share)))
    return out


def check_plan(plan: PartitionPlan, nodes: Sequence[ClusterNode], driver_node: ClusterNode | None = None
               ) -> list[ClusterNode]:
    """The node of every stage, or :class:`PlanError` (``needed``: bytes per node) when the plan does
    not match the cluster: a node is gone, or its ``memory`` is less than its stages reserve.
    Stages without a node run on ``driver_node``. Nothing is loaded: this runs before any actor."""
    reserve = stage_reservations(plan)
    placed: list[ClusterNode] = []
    missing: list[str] = []
    for st in plan.stages:
        node = driver_node if st.node is None else find_node(nodes, st.node)
        if node is None:
            missing.append(f"stage {st.index} ({st.device})")
            placed.append(ClusterNode(st.node or "?", "", "", 0))
        else:
            placed.append(node)
    needed: dict[str, int] = {}
    for node, r in zip(placed, reserve):
        needed[node.name] = needed.get(node.name, 0) + r
    short = [(n.name, needed[n.name], n.memory_bytes) for n in {p.name: p for p in placed if p.node_id}.values()
             if needed[n.name] > n.memory_bytes]
    if missing or short:
        parts = []
        if missing:
            parts.append("no alive node for " + ", ".join(missing) + " (alive: "
                         + ", ".join(f"{n.name} ({n.ip})" for n in nodes) + ")")
        if short:
            parts.append("; ".join(f"node {name} has {have:,} B of Ray memory, its stages need {need:,} B"
                                   for name, need, have in short))
        raise PlanError("the plan does not match the cluster: " + "; ".join(parts)
                        + "; per-node memory the plan needs: " + ", ".join(f"{k}: {v:,} B" for k, v in needed.items()),
                        needed=needed)
    return placed


@contextlib.contextmanager
def local_cluster(nodes: Mapping[str, int], *, object_store_bytes: int = 100 << 20, num_cpus: int = 1,
                  **head_args: Any) -> Iterator[Any]:
    """A Ray cluster of several nodes on this machine, all on 127.0.0.1 (tests, benchmarks, trying it
    out): ``nodes`` = ``{name: memory budget in bytes}``, the first is the head; each node gets the
    label ``ortmem-node=<name>``, ``memory`` = its budget, its own object store. Connects this process
    and yields ``ray.cluster_utils.Cluster``; everything stops on exit.

    Ray connects to a loopback head through the machine's own address unless told it is a one-host
    cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); set here, for this process and the nodes it
    starts, so no port is used on any other interface."""
    from ray.cluster_utils import Cluster
    from ray._private import ray_constants

    items = list(nodes.items())
    if not items:
        raise PlanError("local_cluster needs at least one node")
    environ = dict(os.environ)  # Ray's driver sets PYTHONBREAKPOINT and RAY_* variables: put back on exit
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import; this process may have imported ray already

    def args(name: str, mem: int) -> dict[str, Any]:
        return dict(num_cpus=num_cpus, memory=int(mem), object_store_memory=int(object_store_bytes),
                    labels={NODE_LABEL: name})

    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**args(*items[0]), "include_dashboard": False,
                                                                **head_args})
        for name, mem in items[1:]:
            cluster.add_node(**args(name, mem))
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        os.environ.clear()
        os.environ.update(environ)  # fresh processes started later must not inherit the driver's settings
