"""The one graph index under passes and planners: what ORT's ``Graph`` knows, without weight bytes.

Two layers. :class:`GraphIndex` is one graph in *file* order: every node, producers, explicit
consumers (node, input slot), subgraphs and the outer-scope names they read (ORT's implicit inputs,
:func:`free_names`), the Constant nodes ORT turns into initializers and their values
(:func:`constant_value`), a topological order and ORT's two execution orders. :class:`OrtGraph`
(:func:`build`) is ORT's own view on top of it: Constant nodes become initializers, the other nodes
are numbered as ORT numbers them, subgraphs are nested ``OrtGraph``s. The matchers (through
``ortmodel/fusion_graph``) and the partitioner work in file order; the estimator, liveness and
recompute in ORT's numbering. Each rule below exists once; what follows is what ORT does.

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
``GraphOptimizationLevel.ORT_DISABLE_ALL`` it is exact (``tests/plan/estimate/test_estimator.py`` checks it against
ORT's own profile).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence

from onnx import GraphProto, ModelProto, NodeProto, TensorProto

from ortmem.errors import PlanError
from ortmem.onnxfile.walk import node_subgraphs, subgraph_path
from ortmem.ort.settings import ExecutionOrder

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


# ------------------------------------------------------------------------------------- graph index
def free_names(graph: GraphProto) -> set[str]:
    """Names ``graph`` (a subgraph) and its nested subgraphs read but do not define: what ORT makes
    implicit inputs of the node that owns it. A sparse initializer defines its name (ORT densifies it
    at load); a subgraph output may name an outer value directly, which reads it too."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        defined.update(o for o in node.output if o)
        used.update(x for x in node.input if x)
        for _, sg in node_subgraphs(node):
            used |= free_names(sg)
    used.update(v.name for v in graph.output)
    return used - defined


def constant_value(node: NodeProto) -> TensorProto | None:
    """The initializer ORT makes of a ``Constant`` node (``Graph::Graph`` converts them at load), named
    as the node's output; None for a node that is not such a Constant or a form not decoded here
    (sparse, strings: ORT still folds them, ortmem plans them as nodes). The ``value`` tensor is
    returned as is when it already carries the output's name (no copy of an embedded payload)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    from onnx import AttributeProto, helper, numpy_helper
    import numpy as np

    for a in node.attribute:
        if a.name == "value" and a.type == AttributeProto.TENSOR:
            if a.t.name == node.output[0]:
                return a.t
            t = TensorProto()
            t.CopyFrom(a.t)
            t.name = node.output[0]
            return t
        if a.name in ("value_float", "value_int", "value_floats", "value_ints"):
            v = helper.get_attribute_value(a)
            dtype = np.float32 if "float" in a.name else np.int64
            return numpy_helper.from_array(np.array(v, dtype=dtype), node.output[0])
    return None


@dataclass
class GraphIndex:
    """One graph in file order, indexed once: node ``i`` is ``proto.node[i]``.

    ``producer`` maps a value to the node writing it (any node); ``computed_by`` leaves out the
    Constant nodes ORT turns into initializers (``constants``: file index -> value), so it is ORT's
    producer map. ``consumers``: value -> ``(node, input slot)`` for explicit inputs;
    ``implicit_inputs[i]``: outer-scope names node ``i``'s subgraphs read (per subgraph in attribute
    order, each sorted, first occurrence kept), ``implicit_users`` the reverse; ``readers``: value ->
    every node reading it explicitly or implicitly, once each, in node order.
    """

    proto: GraphProto
    nodes: list[NodeProto]
    constants: dict[int, TensorProto]
    subgraphs: list[list[tuple[str, GraphProto]]]
    implicit_inputs: list[list[str]]
    producer: dict[str, int] = field(default_factory=dict)
    computed_by: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    implicit_users: dict[str, list[int]] = field(default_factory=dict)
    readers: dict[str, list[int]] = field(default_factory=dict)
    _ort_edges: tuple[list[list[int]], list[list[int]]] | None = None

    def node_inputs(self, i: int) -> list[str]:
        """Every value node ``i`` reads: explicit inputs (empty optional ones left out), then the names
        its subgraphs read from outside, sorted, that it does not read explicitly."""
        ins = [x for x in self.nodes[i].input if x]
        ins.extend(sorted(x for x in set(self.implicit_inputs[i]) if x not in ins))
        return ins

    # ---------------------------------------------------------------------------------- ordering
    def topological_order(self) -> list[int]:
        """All nodes (Constant nodes included) in an order that runs: the file's order when it is
        topological, else Kahn's order preferring the lowest index. Raises PlanError on a cycle."""
        n = len(self.nodes)
        inputs = [self.node_inputs(i) for i in range(n)]
        if all(self.producer.get(x, -1) < i for i, ins in enumerate(inputs) for x in ins):
            return list(range(n))
        deps: list[set[int]] = [set() for _ in range(n)]
        users: list[list[int]] = [[] for _ in range(n)]
        for i, ins in enumerate(inputs):
            for x in ins:
                p = self.producer.get(x)
                if p is not None and p != i and p not in deps[i]:
                    deps[i].add(p)
                    users[p].append(i)
        waiting = [len(d) for d in deps]
        ready = [i for i in range(n) if waiting[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != n:
            raise PlanError("the graph has a cycle: no execution order exists")
        return order

    def ort_edges(self) -> tuple[list[list[int]], list[list[int]]]:
        """``(input nodes, output nodes)`` of every node as ORT's edges connect them (explicit and
        implicit inputs; folded Constant nodes have none), sorted by index; computed once."""
        if self._ort_edges is None:
            n = len(self.nodes)
            ins: list[list[int]] = [[] for _ in range(n)]
            outs: list[list[int]] = [[] for _ in range(n)]
            for i, node in enumerate(self.nodes):
                if i in self.constants:
                    continue
                srcs = {self.computed_by[x] for x in [*node.input, *self.implicit_inputs[i]] if x in self.computed_by}
                srcs.discard(i)
                ins[i] = sorted(srcs)
                dsts: set[int] = set()
                for o in node.output:
                    dsts.update(j for j, _ in self.consumers.get(o, ()))
                    dsts.update(self.implicit_users.get(o, ()))
                dsts.discard(i)
                outs[i] = sorted(dsts)
            self._ort_edges = (ins, outs)
        return self._ort_edges

    def ort_order(self, order: ExecutionOrder = "DEFAULT", rank: Sequence[int] | None = None) -> list[int]:
        """The non-Constant nodes in the order ORT executes them (see the module docstring). ``rank``
        (``PRIORITY_BASED`` only): node ``i`` treated as if its index were ``rank[i]``."""
        if order == "PRIORITY_BASED":
            return self._kahn_priority(rank)
        return self._reverse_dfs()

    def _reverse_dfs(self) -> list[int]:
        ins, outs = self.ort_edges()
        real = [i for i in range(len(self.nodes)) if i not in self.constants]
        stack: list[tuple[int, bool]] = [(i, False) for i in real if not outs[i]]
        visited = [False] * len(self.nodes)
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
            for j in ins[i]:
                if not visited[j]:
                    stack.append((j, False))
        return order

    def _kahn_priority(self, rank: Sequence[int] | None) -> list[int]:
        ins, outs = self.ort_edges()
        indeg = [len(x) for x in ins]

        def key(i: int) -> tuple[int, int, int]:
            high = self.nodes[i].op_type in ("Shape", "Size")
            return (0 if high else 1, rank[i] if rank is not None else i, i)

        ready = [key(i) for i in range(len(self.nodes)) if i not in self.constants and indeg[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, _, i = heapq.heappop(ready)
            order.append(i)
            for j in outs[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, key(j))
        return order


def index_graph(graph: GraphProto | ModelProto) -> GraphIndex:
    """Index ``graph`` (a model's main graph when given a model); subgraphs are indexed by whoever
    walks into them (:func:`build` does)."""
    g = graph.graph if isinstance(graph, ModelProto) else graph
    nodes = list(g.node)
    constants = {i: t for i, n in enumerate(nodes) if (t := constant_value(n)) is not None}
    subgraphs = [node_subgraphs(n) for n in nodes]
    implicit: list[list[str]] = []
    for subs in subgraphs:
        names: list[str] = []
        for _, sg in subs:
            for name in sorted(free_names(sg)):
                if name not in names:
                    names.append(name)
        implicit.append(names)
    idx = GraphIndex(proto=g, nodes=nodes, constants=constants, subgraphs=subgraphs, implicit_inputs=implicit)
    for i, node in enumerate(nodes):
        for o in node.output:
            if o:
                idx.producer[o] = i
                if i not in constants:
                    idx.computed_by[o] = i
        for slot, name in enumerate(node.input):
            if name:
                idx.consumers.setdefault(name, []).append((i, slot))
    for i, names in enumerate(implicit):
        for name in names:
            idx.implicit_users.setdefault(name, []).append(i)
    for i, node in enumerate(nodes):
        for name in dict.fromkeys([*(x for x in node.input if x), *implicit[i]]):
            idx.readers.setdefault(name, []).append(i)
    return idx


def topological_order(graph: GraphProto | ModelProto) -> list[int]:
    """:meth:`GraphIndex.topological_order` of ``graph``'s nodes."""
    return index_graph(graph).topological_order()


# ------------------------------------------------------------------------------------- ORT's view
@dataclass
class OrtNode:
    """A node as ORT holds it: its index among the non-Constant nodes of its graph."""

    index: int
    proto: NodeProto
    graph: "OrtGraph"
    file_index: int = -1  # position in the GraphProto
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
    """One graph (main or subgraph) with ORT's node numbering and producer/consumer maps, read off
    its :class:`GraphIndex` (``index``)."""

    proto: GraphProto
    path: str
    parent: "OrtGraph | None"
    index: GraphIndex | None = None
    ort_of_file: dict[int, int] = field(default_factory=dict)  # file index -> ORT index (non-Constant nodes)
    nodes: list[OrtNode] = field(default_factory=list)
    initializers: dict[str, TensorProto] = field(default_factory=dict)  # incl. Constant nodes' values
    constant_nodes: dict[str, NodeProto] = field(default_factory=dict)  # output name -> Constant node
    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # value -> [(node, slot)]
    implicit_users: dict[str, list[int]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------------------------- scoping
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
        assert self.index is not None, "an OrtGraph comes from build()"
        return [self.ort_of_file[f] for f in self.index.ort_order(order)]

    def priority_order(self, rank: Sequence[int] | None = None) -> list[int]:
        """``PRIORITY_BASED`` as ORT would run this graph if node ``i`` had index ``rank[i]``: what a
        planner that rewrites the file order gets back from ORT (Shape/Size still jump the queue)."""
        assert self.index is not None, "an OrtGraph comes from build()"
        file_rank: list[int] | None = None
        if rank is not None:
            file_rank = [0] * len(self.index.nodes)
            for node in self.nodes:
                file_rank[node.file_index] = rank[node.index]
        return [self.ort_of_file[f] for f in self.index.ort_order("PRIORITY_BASED", file_rank)]


def build(graph: GraphProto, path: str = "", parent: OrtGraph | None = None) -> OrtGraph:
    """ORT's view of ``graph`` and, recursively, of its subgraphs (paths ``<node label>/<attr>``)."""
    idx = index_graph(graph)
    g = OrtGraph(proto=graph, path=path, parent=parent, index=idx)
    g.initializers = {t.name: t for t in graph.initializer}
    g.inputs = [v.name for v in graph.input if v.name not in g.initializers]
    g.outputs = [v.name for v in graph.output]
    to_ort = g.ort_of_file
    for f, proto in enumerate(idx.nodes):
        value = idx.constants.get(f)
        if value is not None:
            g.initializers[proto.output[0]] = value
            g.constant_nodes[proto.output[0]] = proto
            continue
        to_ort[f] = len(g.nodes)
        g.nodes.append(OrtNode(index=len(g.nodes), proto=proto, graph=g, file_index=f))
    g.producer = {v: to_ort[f] for v, f in idx.computed_by.items()}
    g.consumers = {v: [(to_ort[f], slot) for f, slot in uses] for v, uses in idx.consumers.items()}
    g.implicit_users = {v: [to_ort[f] for f in users] for v, users in idx.implicit_users.items()}
    for node in g.nodes:
        node.implicit_inputs = idx.implicit_inputs[node.file_index]
        for name, sg in idx.subgraphs[node.file_index]:
            node.subgraphs.append((name, build(sg, subgraph_path(path, node.label, name), g)))
    return g


def walk(g: OrtGraph) -> Iterator[OrtGraph]:
    """``g`` and every nested subgraph, depth first."""
    yield g
    for node in g.nodes:
        for _, sg in node.subgraphs:
            yield from walk(sg)
