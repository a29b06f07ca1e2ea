"""ONNX Runtime's view of a graph: node indices, edges, execution order and unique node names.

The estimator needs the order ORT *executes* nodes in (tensor lifetimes depend on it) and the names
ORT's node memory statistics are keyed by (so estimates and measurements line up). Both are replayed
here from the ONNX graph, without ORT, as ORT 1.31.1 computes them (paths relative to
github.com/microsoft/onnxruntime):

* Node indices: ``Graph::Graph`` (``onnxruntime/core/graph/graph.cc``) turns every ``Constant`` node
  into an initializer instead of a node, then adds the remaining nodes in file order, so a node's
  index is its position among the non-Constant nodes of its graph.
* Edges: one per (producer, consumer) pair where the consumer reads a producer's output explicitly or,
  for a node with subgraphs, implicitly (an outer-scope value read inside the subgraph). Graph inputs
  and initializers create no edge.
* ``ExecutionOrder::DEFAULT``: ``GraphViewer::GraphViewer`` (``onnxruntime/core/graph/graph_viewer.cc``)
  calls ``Graph::ReverseDFSFrom(leaf_nodes, nullptr, leave=push_back, NodeCompare)`` where leaves are
  the nodes without output edges, in index order, and ``NodeCompare`` orders by index. The walk is an
  explicit stack: the leaves are pushed in index order (so the *last* leaf is expanded first); on
  entering a node its "leave" marker is pushed, then its input nodes sorted by ascending index (so the
  highest-index input is expanded first); a node is emitted when its marker pops (post-order).
* ``ExecutionOrder::PRIORITY_BASED``: ``Graph::KahnsTopologicalSort`` with ``PriorityNodeCompare``
  (same file): a priority queue over ready nodes; ``Shape`` and ``Size`` first, then lower
  ``Node::Priority()`` (0 for every node of an inference model), then lower index.
* Unique names: ``IResourceAccountant::MakeUniqueNodeName`` (``onnxruntime/core/framework/
  resource_accountant.cc``): the node's name, or its op type when the name is empty, then ``_`` and
  the decimal value of ``hash[0] | hash[1] << 32``, where ``hash`` is MurmurHash3 x86_128 chained over
  the names of every input def, then every output def (absent optional inputs hash as ""), each call
  seeded with the running ``hash[0]`` (``onnxruntime/core/framework/murmurhash3.cc``). A subgraph node
  is named the same way (the name carries no graph path): two nodes collide only when name, op,
  inputs and outputs all match, which ORT's node-stats file then merges into one row.

These are facts about the graph ORT *receives*. ORT's optimizers (level >= 1) replace nodes and add new
ones at the end of the index space, so after fusions the executed order can differ; with
``GraphOptimizationLevel.ORT_DISABLE_ALL`` it is exact (``tests/test_estimate.py`` checks it against
ORT's own profile).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence

from onnx import AttributeProto, GraphProto, NodeProto, TensorProto

ExecutionOrder = Literal["DEFAULT", "PRIORITY_BASED"]

_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------------------------ MurmurHash3
def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return h


def murmurhash3_x86_128(data: bytes, seed: int) -> tuple[int, int, int, int]:
    """Austin Appleby's MurmurHash3_x86_128 (the SMHasher reference ORT vendors), as four uint32."""
    n = len(data)
    h1 = h2 = h3 = h4 = seed & _M32
    c1, c2, c3, c4 = 0x239B961B, 0xAB0E9789, 0x38B34AE5, 0xA1E38B93
    nblocks = n // 16
    for i in range(nblocks):
        b = i * 16
        k1, k2, k3, k4 = (int.from_bytes(data[b + 4 * j:b + 4 * j + 4], "little") for j in range(4))
        k1 = (_rotl((k1 * c1) & _M32, 15) * c2) & _M32
        h1 ^= k1
        h1 = (((_rotl(h1, 19) + h2) & _M32) * 5 + 0x561CCD1B) & _M32
        k2 = (_rotl((k2 * c2) & _M32, 16) * c3) & _M32
        h2 ^= k2
        h2 = (((_rotl(h2, 17) + h3) & _M32) * 5 + 0x0BCAA747) & _M32
        k3 = (_rotl((k3 * c3) & _M32, 17) * c4) & _M32
        h3 ^= k3
        h3 = (((_rotl(h3, 15) + h4) & _M32) * 5 + 0x96CD1C35) & _M32
        k4 = (_rotl((k4 * c4) & _M32, 18) * c1) & _M32
        h4 ^= k4
        h4 = (((_rotl(h4, 13) + h1) & _M32) * 5 + 0x32AC3B17) & _M32
    tail = data[nblocks * 16:]
    t = len(tail)

    def lane(lo: int, hi: int) -> int:
        k = 0
        for j in range(min(t, hi) - 1, lo - 1, -1):
            k ^= tail[j] << (8 * (j - lo))
        return k

    if t > 12:
        h4 ^= (_rotl((lane(12, 16) * c4) & _M32, 18) * c1) & _M32
    if t > 8:
        h3 ^= (_rotl((lane(8, 12) * c3) & _M32, 17) * c4) & _M32
    if t > 4:
        h2 ^= (_rotl((lane(4, 8) * c2) & _M32, 16) * c3) & _M32
    if t > 0:
        h1 ^= (_rotl((lane(0, 4) * c1) & _M32, 15) * c2) & _M32
    h1 ^= n
    h2 ^= n
    h3 ^= n
    h4 ^= n
    h1 = (h1 + h2 + h3 + h4) & _M32
    h2 = (h2 + h1) & _M32
    h3 = (h3 + h1) & _M32
    h4 = (h4 + h1) & _M32
    h1, h2, h3, h4 = _fmix(h1), _fmix(h2), _fmix(h3), _fmix(h4)
    h1 = (h1 + h2 + h3 + h4) & _M32
    h2 = (h2 + h1) & _M32
    h3 = (h3 + h1) & _M32
    h4 = (h4 + h1) & _M32
    return h1, h2, h3, h4


def unique_node_name(name: str, op_type: str, inputs: list[str], outputs: list[str]) -> str:
    """``IResourceAccountant::MakeUniqueNodeName`` (see module docstring): the row key of ORT's
    node memory statistics CSV and of ``session.resource_cuda_partitioning_settings``."""
    h = (0, 0, 0, 0)
    for def_name in [*inputs, *outputs]:
        h = murmurhash3_x86_128(def_name.encode("utf-8"), h[0])
    return f"{name or op_type}_{h[0] | (h[1] << 32)}"


# --------------------------------------------------------------------------------------- graph view
@dataclass
class OrtNode:
    """A node as ORT holds it: its index among the non-Constant nodes of its graph."""

    index: int
    proto: NodeProto
    graph: "OrtGraph"
    subgraphs: list[tuple[str, "OrtGraph"]] = field(default_factory=list)  # (attribute name, graph)
    implicit_inputs: list[str] = field(default_factory=list)  # outer-scope values its subgraphs read

    @property
    def op_type(self) -> str:
        return self.proto.op_type

    @property
    def domain(self) -> str:
        return self.proto.domain

    @property
    def name(self) -> str:
        return self.proto.name

    @property
    def label(self) -> str:
        """The name ORT's profiler prints: the node's name, or ``<op>_<index>`` when it has none."""
        return self.proto.name or f"{self.proto.op_type}_{self.index}"

    @property
    def inputs(self) -> list[str]:
        return list(self.proto.input)

    @property
    def outputs(self) -> list[str]:
        return list(self.proto.output)

    @property
    def unique_name(self) -> str:
        return unique_node_name(self.proto.name, self.proto.op_type, self.inputs, self.outputs)

    @property
    def path(self) -> str:
        """``graph path:label``, unique across the model (for people and for the per-node table)."""
        return f"{self.graph.path}:{self.label}" if self.graph.path else self.label


@dataclass
class OrtGraph:
    """One graph (main or subgraph) with ORT's node numbering and producer/consumer maps."""

    proto: GraphProto
    path: str
    parent: "OrtGraph | None"
    nodes: list[OrtNode] = field(default_factory=list)
    initializers: dict[str, TensorProto] = field(default_factory=dict)  # incl. Constant nodes' values
    constant_nodes: dict[str, NodeProto] = field(default_factory=dict)  # output name -> Constant node
    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # value -> [(node, slot)]
    implicit_users: dict[str, list[int]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------------------------- scoping
    def local_names(self) -> set[str]:
        return set(self.inputs) | set(self.initializers) | set(self.producer)

    def find_initializer(self, name: str) -> tuple["OrtGraph", TensorProto] | None:
        """The initializer ``name`` resolves to from this graph, looking outward like ORT's
        ``Graph::GetInitializer(name, check_outer_scope=true)``; a local input or node output
        of the same name shadows outer ones."""
        g: OrtGraph | None = self
        while g is not None:
            if name in g.initializers:
                return g, g.initializers[name]
            if name in g.producer or name in g.inputs:
                return None
            g = g.parent
        return None

    def input_nodes(self, i: int) -> set[int]:
        """Indices of nodes with an edge into node ``i`` (explicit and implicit inputs)."""
        node = self.nodes[i]
        srcs = set()
        for name in [*node.inputs, *node.implicit_inputs]:
            p = self.producer.get(name)
            if p is not None and p != i:
                srcs.add(p)
        return srcs

    def output_nodes(self, i: int) -> set[int]:
        outs: set[int] = set()
        for name in self.nodes[i].outputs:
            outs.update(j for j, _ in self.consumers.get(name, ()))
            outs.update(self.implicit_users.get(name, ()))
        outs.discard(i)
        return outs

    # ---------------------------------------------------------------------------------- ordering
    def execution_order(self, order: ExecutionOrder = "DEFAULT") -> list[int]:
        if order == "PRIORITY_BASED":
            return self._kahn_priority()
        return self._reverse_dfs()

    def _reverse_dfs(self) -> list[int]:
        n = len(self.nodes)
        outs = [self.output_nodes(i) for i in range(n)]
        leaves = [i for i in range(n) if not outs[i]]
        stack: list[tuple[int, bool]] = [(i, False) for i in leaves]
        visited = [False] * n
        order: list[int] = []
        while stack:
            i, leave = stack.pop()
            if leave:
                order.append(i)
                continue
            if visited[i]:
                continue
            visited[i] = True
            stack.append((i, True))
            for j in sorted(self.input_nodes(i)):
                if not visited[j]:
                    stack.append((j, False))
        return order

    def priority_order(self, rank: Sequence[int] | None = None) -> list[int]:
        """``PRIORITY_BASED`` as ORT would run this graph if node ``i`` had index ``rank[i]``: what a
        planner that rewrites the file order gets back from ORT (Shape/Size still jump the queue)."""
        return self._kahn_priority(rank)

    def _kahn_priority(self, rank: Sequence[int] | None = None) -> list[int]:
        n = len(self.nodes)
        indeg = [len(self.input_nodes(i)) for i in range(n)]

        def key(i: int) -> tuple[int, int, int]:
            high = self.nodes[i].op_type in ("Shape", "Size")
            return (0 if high else 1, rank[i] if rank is not None else i, i)

        ready = [key(i) for i in range(n) if indeg[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, _, i = heapq.heappop(ready)
            order.append(i)
            for j in sorted(self.output_nodes(i)):
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, key(j))
        return order


def _free_names(g: GraphProto) -> set[str]:
    """Names a subgraph (and its nested subgraphs) reads but does not define: its implicit inputs."""
    defined = {v.name for v in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    used: set[str] = set()
    for n in g.node:
        used.update(x for x in n.input if x)
        for a in n.attribute:
            for sg in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs) if a.type == AttributeProto.GRAPHS else []):
                used.update(_free_names(sg))
    return used - defined


def build(graph: GraphProto, path: str = "", parent: OrtGraph | None = None) -> OrtGraph:
    """ORT's view of ``graph`` and, recursively, of its subgraphs (paths ``<node label>/<attr>``)."""
    g = OrtGraph(proto=graph, path=path, parent=parent)
    g.initializers = {t.name: t for t in graph.initializer}
    g.inputs = [v.name for v in graph.input if v.name not in g.initializers]
    g.outputs = [v.name for v in graph.output]
    for proto in graph.node:
        if proto.op_type == "Constant" and proto.domain in ("", "ai.onnx") and len(proto.output) == 1:
            t = _constant_value(proto)
            if t is not None:
                g.initializers[proto.output[0]] = t
                g.constant_nodes[proto.output[0]] = proto
                continue
        node = OrtNode(index=len(g.nodes), proto=proto, graph=g)
        g.nodes.append(node)
    for node in g.nodes:
        for o in node.outputs:
            if o:
                g.producer[o] = node.index
        for slot, name in enumerate(node.inputs):
            if name:
                g.consumers.setdefault(name, []).append((node.index, slot))
    for node in g.nodes:
        implicit: list[str] = []
        for attr in node.proto.attribute:
            subs = [attr.g] if attr.type == AttributeProto.GRAPH else (
                list(attr.graphs) if attr.type == AttributeProto.GRAPHS else [])
            for k, sg in enumerate(subs):
                suffix = f"[{k}]" if attr.type == AttributeProto.GRAPHS else ""
                sub_path = f"{path}/{node.label}/{attr.name}{suffix}" if path else f"{node.label}/{attr.name}{suffix}"
                node.subgraphs.append((attr.name + suffix, build(sg, sub_path, g)))
                for name in sorted(_free_names(sg)):
                    if name not in implicit:
                        implicit.append(name)
        node.implicit_inputs = implicit
        for name in implicit:
            g.implicit_users.setdefault(name, []).append(node.index)
    return g


def _constant_value(node: NodeProto) -> TensorProto | None:
    """The tensor a Constant node stands for (``value`` attribute or the scalar/list variants)."""
    from onnx import helper, numpy_helper
    import numpy as np

    for a in node.attribute:
        if a.name == "value" and a.type == AttributeProto.TENSOR:
            t = TensorProto()
            t.CopyFrom(a.t)
            t.name = node.output[0]
            return t
        if a.name in ("value_float", "value_int", "value_floats", "value_ints"):
            v = helper.get_attribute_value(a)
            dtype = np.float32 if "float" in a.name else np.int64
            return numpy_helper.from_array(np.array(v, dtype=dtype), node.output[0])
    return None


def walk(g: OrtGraph) -> Iterator[OrtGraph]:
    """``g`` and every nested subgraph, depth first."""
    yield g
    for node in g.nodes:
        for _, sg in node.subgraphs:
            yield from walk(sg)
