"""Group the nodes of an ONNX graph into a module tree and size each module, for the planner.

Exporters name nodes by the module that emitted them: ``/model/layers.3/self_attn/q_proj/MatMul``
was emitted inside ``model.layers.3.self_attn.q_proj``. :func:`group_modules` turns those scopes into
the dotted names :func:`ortmem.plan.partition.device_map.infer_device_map` takes (``by="scope"``), or makes
every node its own module (``by="node"``), and computes each module's bytes from per-node costs
(:class:`NodeCost`, which ortmem's estimator produces). Pure: no file, no ORT.

The tree (``by="scope"``)
    A node belongs to its scope. A scope with no sub-scopes is one module (its nodes stay together).
    In a scope that also has sub-scopes (``/model/layers.3/Add`` beside ``/model/layers.3/mlp/...``)
    each of its own nodes becomes a module of its own, ``model.layers.3.Add``, so that a module's
    children always account for all its nodes and the planner can split it. Dots inside an op's
    name become ``_``; a name that collides with a scope gets ``_1``, ``_2``...

Execution order
    ORT's default order is a topological order; the graph's node order is used when it is already
    topologically sorted (exporters write it so), otherwise the topological order that prefers the
    lowest node index. Module names appear in ``sizes`` by first appearance in that order (every
    prefix, ``""`` first), as accelerate's ``compute_module_sizes`` does.

A module's bytes: what the module needs to run alone on a device
    weights
        The union of its nodes' initializers, each charged **once** even when several of its nodes
        use it. A weight used by two modules is charged to **each** of them (each needs it on the
        device it runs on: "once per device"), so a parent can be smaller than the sum of its children
        and splitting two modules that share a weight costs the weight twice. The planner sees that
        cost; where both land on one device its sum over-counts the weight (never under-counts, so a
        budget is never exceeded). :attr:`ModuleTree.shared_weights` lists those weights so that a
        later stage can credit the duplicate back. Charging a shared weight to only its first user
        would instead under-count every other device that also needs it.
    activations
        The peak of a liveness walk over the module's nodes in execution order: a node's outputs
        (``activation_bytes``) live from the node until their last consumer inside the module, or
        to the end of the module when something outside it (or the graph's output) still needs them;
        tensors the module reads from other modules' nodes live from its start to their last use in
        it; a node's ``workspace_bytes`` count only while it runs. Summing over modules on one device
        therefore bounds that device's peak from above (a tensor passing over a module is counted at
        the end of the module that made it). Graph inputs carry no cost here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from onnx import GraphProto, ModelProto

from ortmem.onnxfile.walk import node_label
from ortmem.ort.graph_index import index_graph
from ortmem.errors import PlanError

__all__ = ["ModuleTree", "NodeCost", "activation_peak", "group_modules", "leaf_modules", "scope_of"]


@dataclass(frozen=True)
class NodeCost:
    """What one node costs on the device that runs it.

    ``weight_bytes``: initializer name -> bytes (a weight shared between nodes is named by each);
    ``activation_bytes``: bytes of the tensors the node produces; ``workspace_bytes``: scratch memory
    that lives only while the node runs. ``name`` is the node's name (``op_type#index`` when the
    node has none, as :func:`ortmem.onnxfile.walk.node_label` writes it).
    """

    name: str
    weight_bytes: Mapping[str, int] = field(default_factory=dict)
    activation_bytes: int = 0
    workspace_bytes: int = 0


@dataclass(frozen=True)
class ModuleTree:
    """The planner's input and what it was computed from.

    ``sizes``: module -> bytes, every prefix, ``""`` the whole graph, in execution order (feed it to
    ``infer_device_map``). ``weight_bytes`` / ``activation_bytes``: the two parts of each size.
    ``nodes``: leaf module -> its node names in execution order; ``module_of``: node -> leaf module.
    ``shared_weights``: initializer -> leaf modules that use it, for those used by more than one.
    ``order``: node names in execution order.
    """

    sizes: dict[str, int]
    weight_bytes: dict[str, int]
    activation_bytes: dict[str, int]
    nodes: dict[str, tuple[str, ...]]
    module_of: dict[str, str]
    shared_weights: dict[str, tuple[str, ...]]
    order: tuple[str, ...]


# --------------------------------------------------------------------------------------------------
# Names


def scope_of(node_name: str) -> tuple[tuple[str, ...], str]:
    """(scope components, op name) of an exporter-style name; unscoped names have no components.

    ``/model/layers.3/self_attn/q_proj/MatMul`` -> (("model", "layers", "3", "self_attn", "q_proj"),
    "MatMul"): the scope's dots are module boundaries, as in PyTorch's ``layers.3``.
    """
    parts = [p for p in node_name.split("/") if p]
    if len(parts) <= 1:
        return (), parts[0] if parts else node_name
    scope: list[str] = []
    for p in parts[:-1]:
        scope.extend(c for c in p.split(".") if c)
    return tuple(scope), parts[-1]


def _sanitize(name: str) -> str:
    out = name.replace(".", "_").replace("/", "_").strip("_")
    return out or "node"


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def leaf_modules(labels: Sequence[str], by: str | Mapping[str, str]) -> list[str]:
    """The leaf module of each node (same order as ``labels``).

    ``by`` may also map every label to a dotted module name of the caller's choosing (a partitioner
    that names scopes its own way, or glues nodes together); nodes given one name form one module.
    """
    if isinstance(by, Mapping):
        missing = [label for label in labels if label not in by]
        if missing:
            raise PlanError(f"group_modules: no module given for node {missing[0]!r}")
        return [by[label] for label in labels]
    if by == "node":
        taken: set[str] = {""}
        out = []
        for label in labels:
            name = _unique(_sanitize(label), taken)
            taken.add(name)
            out.append(name)
        return out
    if by != "scope":
        raise PlanError(f"group_modules: by must be 'scope', 'node' or a mapping, got {by!r}")
    scopes = [scope_of(label) for label in labels]
    prefixes: set[str] = {""}
    has_sub: set[str] = set()
    for comps, _ in scopes:
        for i in range(len(comps) + 1):
            prefixes.add(".".join(comps[:i]))
            if i < len(comps):
                has_sub.add(".".join(comps[:i]))
    has_sub.add("")  # unscoped nodes are always modules of their own
    taken = set(prefixes)
    out = []
    for comps, op in scopes:
        scope = ".".join(comps)
        if scope in has_sub:
            base = f"{scope}.{_sanitize(op)}" if scope else _sanitize(op)
            name = _unique(base, taken)
            taken.add(name)
        else:
            name = scope
        out.append(name)
    return out


# --------------------------------------------------------------------------------------------------
# Costs


def _match_costs(labels: Sequence[str], costs: Iterable[NodeCost]) -> list[NodeCost | None]:
    index: dict[str, int] = {}
    for i, label in enumerate(labels):
        if label in index:
            raise PlanError(f"two nodes are named {label!r}: costs cannot be matched to nodes by name")
        index[label] = i
    out: list[NodeCost | None] = [None] * len(labels)
    for c in costs:
        i = index.get(c.name)
        if i is None:
            raise PlanError(f"a cost names node {c.name!r}, which the graph does not have")
        if out[i] is not None:
            raise PlanError(f"node {c.name!r} has two costs")
        for k, v in (("activation_bytes", c.activation_bytes), ("workspace_bytes", c.workspace_bytes),
                     *((f"weight {w!r}", b) for w, b in c.weight_bytes.items())):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"node {c.name!r}: {k} must be a non-negative int, got {v!r}")
        out[i] = c
    return out


def _peak(members: Sequence[int], inputs: Sequence[Sequence[int]], consumers: Sequence[Sequence[int]],
          escapes_graph: Sequence[bool], act: Sequence[int], ws: Sequence[int]) -> int:
    """Peak bytes of activations while ``members`` (positions, ascending) run alone.

    ``inputs[k]``/``consumers[k]``: producer / consumer positions of node ``k``'s values.
    """
    local = {k: i for i, k in enumerate(members)}
    m = len(members)
    last_use: dict[int, int] = {}
    for i, k in enumerate(members):
        for p in inputs[k]:
            if last_use.get(p, -1) < i:
                last_use[p] = i
    diff = [0] * (m + 2)
    for p, stop in last_use.items():  # blocks read inside the module
        if p in local:
            continue
        diff[0] += act[p]  # produced outside: live from the start to the last use
        diff[stop + 1] -= act[p]
    for i, k in enumerate(members):
        if act[k] == 0:
            continue
        escapes = escapes_graph[k] or any(c not in local for c in consumers[k])
        if escapes:
            diff[i + 1] += act[k]  # kept to the end of the module
        elif k in last_use and last_use[k] > i:
            diff[i + 1] += act[k]
            diff[last_use[k] + 1] -= act[k]
    peak = 0
    live = 0
    for i, k in enumerate(members):
        live += diff[i]
        step = live + act[k] + ws[k]
        if step > peak:
            peak = step
    return peak


#: Public name of the liveness walk, for callers that size other node sets (a pipeline stage) the
#: same way the modules are sized here.
activation_peak = _peak


def position_links(order: Sequence[int], node_inputs: Sequence[Sequence[str]],
                   producer: Mapping[str, int]) -> tuple[list[list[int]], list[list[int]]]:
    """``(inputs, consumers)`` by position in ``order`` (node indices in execution order): ``inputs[p]``
    the ascending positions of the nodes producing what node ``order[p]`` reads, ``consumers[p]`` the
    positions of the nodes reading what it produces. ``node_inputs`` and ``producer`` (value -> node
    index) are indexed by node; a node outside ``order`` (a constant chain) and a node reading its own
    output link nothing. The liveness walk (:func:`activation_peak`) reads both lists."""
    pos = {node_i: p for p, node_i in enumerate(order)}
    inputs: list[list[int]] = []
    consumers: list[list[int]] = [[] for _ in order]
    for p, node_i in enumerate(order):
        prods = sorted({pos[producer[x]] for x in node_inputs[node_i]
                        if x in producer and producer[x] in pos and pos[producer[x]] != p})
        inputs.append(prods)
        for q in prods:
            consumers[q].append(p)
    return inputs, consumers


def group_modules(graph: GraphProto | ModelProto, costs: Iterable[NodeCost], *,
                  by: str | Mapping[str, str] = "scope") -> ModuleTree:
    """Group ``graph``'s nodes into modules (``by="scope"``, ``"node"``, or a mapping from node label
    to dotted module name, see :func:`leaf_modules`) and size every module.

    ``costs``: one :class:`NodeCost` per node, matched by name; nodes without one cost nothing.
    See the module docstring for what a module's bytes mean.
    """
    idx = index_graph(graph)
    g = idx.proto
    order = idx.topological_order()
    labels_all = [node_label(node, i) for i, node in enumerate(g.node)]
    labels = [labels_all[i] for i in order]
    matched = _match_costs(labels_all, costs)
    cost = [matched[i] for i in order]
    leaf = leaf_modules(labels, by)

    n = len(order)
    inputs, consumers = position_links(order, [idx.node_inputs(i) for i in range(len(g.node))], idx.producer)
    graph_outputs = {o.name for o in g.output}
    escapes_graph = [any(o in graph_outputs for o in g.node[order[pos]].output) for pos in range(n)]
    act = [c.activation_bytes if c else 0 for c in cost]
    ws = [c.workspace_bytes if c else 0 for c in cost]

    # modules, in first-appearance order, with their member positions
    members: dict[str, list[int]] = {}
    for pos, name in enumerate(leaf):
        parts = name.split(".") if name else []
        for i in range(len(parts) + 1):
            members.setdefault(".".join(parts[:i]), []).append(pos)
    if not members:
        members[""] = []

    weight_bytes: dict[str, int] = {}
    activation_bytes: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for name, mem in members.items():
        seen: dict[str, int] = {}
        for pos in mem:
            if cost[pos] is not None:
                for w, b in cost[pos].weight_bytes.items():
                    if b > seen.get(w, -1):
                        seen[w] = b
        weight_bytes[name] = sum(seen.values())
        activation_bytes[name] = _peak(mem, inputs, consumers, escapes_graph, act, ws)
        sizes[name] = weight_bytes[name] + activation_bytes[name]

    nodes: dict[str, list[str]] = {}
    users: dict[str, list[str]] = {}
    for pos, name in enumerate(leaf):
        nodes.setdefault(name, []).append(labels[pos])
        if cost[pos] is not None:
            for w in cost[pos].weight_bytes:
                lst = users.setdefault(w, [])
                if name not in lst:
                    lst.append(name)
    shared = {w: tuple(mods) for w, mods in users.items() if len(mods) > 1}
    return ModuleTree(
        sizes=sizes,
        weight_bytes=weight_bytes,
        activation_bytes=activation_bytes,
        nodes={k: tuple(v) for k, v in nodes.items()},
        module_of=dict(zip(labels, leaf)),
        shared_weights=shared,
        order=tuple(labels),
    )
