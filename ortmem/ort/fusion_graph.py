"""One graph as ORT's ``Graph`` answers its fusion rules' questions, without weight bytes.

Why a view of its own: the fusion replays (:mod:`.matmul_add_fusion`, :mod:`.attention_pattern`,
:mod:`.constant_sharing`) and the matchers built on them (``ortmem.passes.rules.dq_matmul_match``,
``ortmem.passes.rules.dq_gather_match``) ask what ORT's ``Graph`` knows: edges and their counts, which
initializers are *constant* (outer scopes included), element types and shapes as ORT resolves them,
the opset an op resolves to, ORT's topological order. :class:`FusionGraph` answers those on top of
the shared :class:`~ortmem.ort.graph_index.GraphIndex`, whose maps it names as the index does
(``consumers``: explicit ``(node, slot)`` reads; ``readers``: every node reading a value, implicit
reads included; ``computed_by``: ORT's producers, Constant nodes left out), in file order.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto

from ortmem.onnxfile.walk import node_label, subgraph_path
from ortmem.ort.graph_index import index_graph
from ortmem.ort.value_types import Dim, TypeInfo, ValueTypes

# ORT's GraphOptimizationLevel values (onnxruntime_c_api.h): 0 disable, 1 basic, 2 extended, 3 layout, 99 all.
LEVEL_BASIC = 1
LEVEL_EXTENDED = 2


@dataclass
class Initializer:
    """An initializer as ORT's Graph holds it: a TensorProto (for a Constant node, the attribute
    tensor; for a sparse one, a metadata stand-in), and whether a Constant node made it."""

    proto: TensorProto
    from_constant_node: bool = False


class FusionGraph:
    """One graph (main or subgraph) in file order: node ``i`` is ``nodes[i]``; ``parent`` is the
    enclosing graph, where outer-scope names are looked up."""

    def __init__(self, proto: GraphProto, path: str, parent: "FusionGraph | None", ir_version: int,
                 opset: int, types: ValueTypes):
        index = index_graph(proto)
        self.index = index
        self.path = path
        self.parent = parent
        self.ir_version = ir_version
        self.opset = opset
        self.nodes: list[NodeProto] = index.nodes
        self.inputs = {vi.name for vi in proto.input}
        self.outputs = {vi.name for vi in proto.output}
        self.inits: dict[str, Initializer] = {t.name: Initializer(t) for t in proto.initializer}
        for sp in proto.sparse_initializer:
            meta = TensorProto(name=sp.values.name, data_type=sp.values.data_type, dims=list(sp.dims))
            self.inits[sp.values.name] = Initializer(meta)
        for i, value in index.constants.items():
            self.inits[self.nodes[i].output[0]] = Initializer(value, from_constant_node=True)
        self.types = types
        #: AttentionPatternCache's ``attn_add_nodes`` (:mod:`.attention_pattern`), computed on demand.
        self.attn_adds: set[int] | None = None
        self._topo: dict[int, int] | None = None

    def label(self, i: int) -> str:
        return node_label(self.nodes[i], i)

    # -- the index's maps, per value --------------------------------------------------------------
    def consumers(self, value: str) -> list[tuple[int, int]]:
        """Explicit reads of ``value``: ``(node, input slot)``."""
        return list(self.index.consumers.get(value, ()))

    def readers(self, value: str) -> list[int]:
        """Every node reading ``value``, explicitly or from a subgraph (``Graph::GetConsumerNodes``)."""
        return list(self.index.readers.get(value, ()))

    def implicit_users(self, value: str) -> list[int]:
        """Nodes whose subgraphs read ``value`` from this graph."""
        return list(self.index.implicit_users.get(value, ()))

    def computed_by(self, value: str) -> int | None:
        """The node computing ``value`` (None for inputs, initializers and folded Constant nodes)."""
        return self.index.computed_by.get(value) if value else None

    # -- ORT Graph queries ------------------------------------------------------------------------
    def edges(self, value: str) -> int:
        """Node::GetOutputEdgesCount contribution of one value: explicit input slots plus implicit users."""
        if not value:
            return 0
        return len(self.index.consumers.get(value, ())) + len(self.index.implicit_users.get(value, ()))

    def produces_graph_output(self, i: int) -> bool:
        return any(o in self.outputs for o in self.nodes[i].output if o)

    def node_edges(self, i: int) -> int:
        return sum(self.edges(o) for o in self.nodes[i].output if o)

    def topo_position(self, i: int) -> int:
        """Position in GraphViewer::GetNodesInTopologicalOrder (core/graph/graph_viewer.cc).

        ORT walks Graph::ReverseDFSFrom(leaf nodes, leave = append) with NodeCompare (lower index first):
        the leaves are pushed in index order and the stack pops the last one first; a node's input nodes
        are pushed in ascending index order, so its highest-index producer is finished first.
        """
        if self._topo is None:
            self._topo = {k: pos for pos, k in enumerate(self.index.ort_order("DEFAULT"))}
        return self._topo.get(i, -1)

    def is_local_value(self, name: str) -> bool:
        return name in self.inputs or name in self.index.computed_by or name in self.inits

    def constant_initializer(self, name: str) -> "tuple[FusionGraph, Initializer] | None":
        """Graph::GetConstantInitializer(name, check_outer_scope=true) (core/graph/graph.cc)."""
        if not name:
            return None
        if name in self.inits:
            # CanOverrideInitializer(): IR >= 4 lets a graph input of the same name override it
            if self.ir_version >= 4 and name in self.inputs:
                return None
            return self, self.inits[name]
        if name in self.inputs or name in self.index.computed_by:
            return None  # a local value shadows any outer-scope initializer
        if self.parent is not None:
            return self.parent.constant_initializer(name)
        return None

    def type_of(self, name: str) -> TypeInfo | None:
        if name in self.inits:
            t = self.inits[name].proto
            return TypeInfo(t.data_type, [("v", int(d)) for d in t.dims])
        known = self.types.get(self.path, name)
        if known is not None:
            return known
        if not self.is_local_value(name) and self.parent is not None:
            return self.parent.type_of(name)
        return None

    def op_since(self, versions: tuple[int, ...]) -> int | None:
        """since_version of an ONNX-domain op with these schema ``versions`` at this model's opset (the
        schema ORT resolves)."""
        cands = [v for v in versions if v <= self.opset]
        return max(cands) if cands else None


def fusion_graphs(model: ModelProto) -> list[FusionGraph]:
    """The main graph and every subgraph, depth first (paths as :func:`ortmem.onnxfile.walk.subgraph_path`);
    one :class:`ValueTypes` for all of them, asked only when a rule needs a type."""
    types = ValueTypes(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graphs: list[FusionGraph] = []

    def visit(proto: GraphProto, path: str, parent: FusionGraph | None) -> None:
        g = FusionGraph(proto, path, parent, model.ir_version, opset, types)
        graphs.append(g)
        for i, subs in enumerate(g.index.subgraphs):
            for attr, sg in subs:
                visit(sg, subgraph_path(path, g.label(i), attr), g)

    visit(model.graph, "", None)
    return graphs


# -- shapes and attributes, as the rules compare them ----------------------------------------------

def dim_eq(a: Dim, b: Dim) -> bool:
    """ORT's operator== on TensorShapeProto_Dimension: values equal, or identical non-empty params."""
    if a[0] == "v":
        return b[0] == "v" and a[1] == b[1]
    if a[0] == "p":
        return b[0] == "p" and a[1] == b[1]
    return False


def is_vector_of(ti: TypeInfo | None, n: int) -> bool:
    """A known shape of exactly ``[n]``."""
    return ti is not None and ti.shape is not None and len(ti.shape) == 1 and ti.shape[0] == ("v", n)


def format_shape(ti: TypeInfo | None) -> str:
    if ti is None or ti.shape is None:
        return "unknown"
    return "[" + ", ".join(str(v) if k != "?" else "?" for k, v in ti.shape) + "]"


def attribute(node: NodeProto, name: str):
    """The value of attribute ``name`` of ``node``, or None."""
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


def tensor_type_name(code: int) -> str:
    """``int4``, ``float16``...: an element type as the rules' messages name it."""
    try:
        return TensorProto.DataType.Name(code).lower()
    except ValueError:
        return f"type {code}"
