"""Walk every tensor and graph of a ModelProto, subgraphs included, with a path that names it.

Initializers live in more places than ``model.graph.initializer``: If/Loop/Scan bodies, sparse
initializers, Constant-style attribute tensors and function bodies. Every stage of ortmem (loading,
inspection, estimates) must see all of them, or a weight is silently dropped or double counted.
"""
from __future__ import annotations

from typing import Iterator

import onnx
from onnx import AttributeProto, GraphProto, ModelProto, TensorProto

from ortmem.base.records import record


@record
class TensorSite:
    """One TensorProto and where it sits.

    ``graph`` is "" for the main graph and ``"<node>/<attr>[/...]"`` for a subgraph; ``kind`` is
    "initializer", "sparse_values", "sparse_indices" or "attribute". A named tuple, not a frozen
    dataclass: one is made per tensor on every load, and a frozen dataclass costs 4x as much to
    create (a model with 1e5 initializers).
    """

    graph: str
    kind: str
    tensor: TensorProto

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.graph, self.kind, self.tensor.name)


def node_label(node: onnx.NodeProto, index: int) -> str:
    """A node's name, or a stable stand-in for nodes exported without one."""
    return node.name or f"{node.op_type}#{index}"


def node_subgraphs(node: onnx.NodeProto) -> list[tuple[str, GraphProto]]:
    """A node's subgraphs (If branches, Loop/Scan bodies) as ``(attribute name, graph)``; a GRAPHS
    attribute's graphs are named ``name[j]``."""
    out: list[tuple[str, GraphProto]] = []
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            out.append((attr.name, attr.g))
        elif attr.type == AttributeProto.GRAPHS:
            out.extend((f"{attr.name}[{j}]", g) for j, g in enumerate(attr.graphs))
    return out


def subgraph_path(path: str, label: str, attribute: str) -> str:
    """The path of a subgraph (attribute ``attribute`` of the node labelled ``label``) inside the graph
    at ``path``: "" is the main graph, ``"<node>/<attr>[/...]"`` below it. Every module that keys
    anything by graph builds the path here, so their keys agree."""
    return f"{path}/{label}/{attribute}" if path else f"{label}/{attribute}"


def iter_graphs(graph: GraphProto, path: str = "") -> Iterator[tuple[str, GraphProto]]:
    """The graph itself and every nested subgraph, depth first, with their paths."""
    yield path, graph
    for i, node in enumerate(graph.node):
        for name, sub in node_subgraphs(node):
            yield from iter_graphs(sub, subgraph_path(path, node_label(node, i), name))


def iter_tensor_sites(model: ModelProto) -> Iterator[TensorSite]:
    """Every TensorProto in the model (main graph, subgraphs, functions), once each."""
    graphs = list(iter_graphs(model.graph))
    for path, graph in graphs:
        for t in graph.initializer:
            yield TensorSite(path, "initializer", t)
        for s in graph.sparse_initializer:
            yield TensorSite(path, "sparse_values", s.values)
            yield TensorSite(path, "sparse_indices", s.indices)
        for i, node in enumerate(graph.node):
            yield from _attribute_tensors(node, i, path)
    for fn in model.functions:
        for i, node in enumerate(fn.node):
            yield from _attribute_tensors(node, i, f"function:{fn.domain}.{fn.name}")


def _attribute_tensors(node: onnx.NodeProto, index: int, path: str) -> Iterator[TensorSite]:
    label = node_label(node, index)
    for attr in node.attribute:
        where = f"{path}|{label}.{attr.name}" if path else f"{label}.{attr.name}"
        if attr.type == AttributeProto.TENSOR:
            yield TensorSite(where, "attribute", attr.t)
        elif attr.type == AttributeProto.TENSORS:
            for t in attr.tensors:
                yield TensorSite(where, "attribute", t)
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            yield TensorSite(where, "sparse_values", attr.sparse_tensor.values)
            yield TensorSite(where, "sparse_indices", attr.sparse_tensor.indices)


def external_data_dict(tensor: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def declared_dims(tp: onnx.TypeProto) -> tuple[int, list[int | str | None] | None] | None:
    """A value's declared tensor type as (element type, dims): a dim is an int (``dim_value``), a
    str (a non-empty ``dim_param``) or None (neither); dims None when no shape is declared (ORT's
    ``NodeArg::Shape() == nullptr``). None for a value that is not a tensor."""
    if not tp.HasField("tensor_type"):
        return None
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return tt.elem_type, None
    dims: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tt.elem_type, dims
