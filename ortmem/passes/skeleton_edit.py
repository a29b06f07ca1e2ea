"""Edits of a model skeleton that every rewrite rule makes: fresh names, nodes replaced in one graph,
dead nodes and initializers dropped, tensors pointed at their place in the output, aliases.

Why a module of its own: the rules (:mod:`ortmem.passes.rules.dq_matmul`, :mod:`ortmem.passes.rules.dq_gather`) only say *what* replaces
a node; how a graph's node list is rebuilt (once per graph, deepest graph first, names kept unique,
nodes that nothing reads any more removed to a fixed point) is the same for every rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import onnx
from onnx import TensorProto

from ortmem.errors import ConversionError
from ortmem.onnxfile.walk import is_external, iter_graphs, node_label
from ortmem.passes.tensors import OutTensor

#: The domain of ORT's contrib ops (MatMulNBits, GatherBlockQuantized) the rules emit.
MS_DOMAIN = "com.microsoft"


def all_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor and value name used anywhere in the model (subgraphs included)."""
    names: set[str] = set()
    for _, g in iter_graphs(model.graph):
        names.update(t.name for t in g.initializer)
        names.update(v.name for v in list(g.input) + list(g.output) + list(g.value_info))
        for n in g.node:
            names.update(n.input)
            names.update(n.output)
    return names


class FreshNames:
    """Hands out names no other name in the set uses (``base``, else ``base_1``, ``base_2``...)."""

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self.taken: set[str] = set(taken)

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name


def point_to(t: TensorProto, location: str, o: OutTensor) -> None:
    """Make ``t`` external data at ``o``'s place in ``location``."""
    t.ClearField("raw_data")
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(o.offset)), ("length", str(o.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v


def external_tensor(o: OutTensor, location: str) -> TensorProto:
    """A new initializer for ``o``, its bytes at ``o``'s place in ``location``."""
    t = TensorProto(name=o.name, data_type=o.data_type, dims=list(o.shape))
    point_to(t, location, o)
    return t


@dataclass(frozen=True)
class Alias:
    """A second initializer ``name`` over the bytes of ``source`` (as seen from ``graph_path``), with
    another element type or dims: the bytes are shared, whatever the source's placement."""

    graph_path: str
    name: str
    source: str
    data_type: int
    shape: tuple[int, ...]


def _scoped_initializer(graphs: dict[str, onnx.GraphProto], graph_path: str, name: str) -> TensorProto:
    """``name`` as seen from ``graph_path``: its own graph first, then the enclosing ones."""
    path = graph_path
    while True:
        g = graphs.get(path)
        if g is not None:
            for t in g.initializer:
                if t.name == name:
                    return t
        if not path:
            raise ConversionError("initializer to alias not found", tensor=name)
        path = path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""


def add_aliases(out: onnx.ModelProto, aliases: Iterable[Alias]) -> None:
    """One new initializer per alias: the source's bytes (external reference or inline raw bytes,
    copied as they are) under another element type or dims. Call it after the sources were pointed
    at their final place, so both name the same bytes."""
    graphs = dict(iter_graphs(out.graph))
    for a in aliases:
        src = _scoped_initializer(graphs, a.graph_path, a.source)
        t = TensorProto()
        t.CopyFrom(src)
        t.name = a.name
        if a.data_type != src.data_type and not (is_external(t) or t.raw_data):
            raise ConversionError("a tensor in typed fields cannot change its element type", tensor=a.source)
        t.data_type = a.data_type
        del t.dims[:]
        t.dims.extend(a.shape)
        graphs[a.graph_path].initializer.append(t)


def node_reads(n: onnx.NodeProto) -> set[str]:
    """Names a node reads: its inputs, and whatever its subgraphs read (implicit inputs)."""
    names = set(n.input)
    for attr in n.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                    list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []):
            for m in sub.node:
                names |= node_reads(m)
            names.update(o.name for o in sub.output)
    return names


class GraphEdit:
    """The edits of one graph, applied at once by :meth:`apply`.

    Rules ``replace`` a node (by index) with new nodes, ``remove`` nodes for certain, mark nodes
    ``droppable`` (they go once nothing reads their outputs: a DQ whose consumers were all
    rewritten), and add initializers. ``node_name`` keeps node names unique within the graph, as
    ONNX wants (ORT's names for unnamed MatMuls collide, "/MatMulAddFusion" twice, where ORT itself
    would uniquify them with Graph::GenerateNodeName); the names of replaced nodes are free.
    """

    def __init__(self, graph: onnx.GraphProto, replaced: set[int]) -> None:
        self.graph = graph
        self.labels = {node_label(n, i): i for i, n in enumerate(graph.node)}
        self.replace: dict[int, list[onnx.NodeProto]] = {}
        self.remove: set[int] = set()
        self.droppable: set[int] = set()
        self.node_name = FreshNames(n.name for i, n in enumerate(graph.node) if n.name and i not in replaced)

    def add_initializers(self, tensors: Iterable[TensorProto]) -> None:
        self.graph.initializer.extend(tensors)

    def apply(self) -> None:
        """Rebuild the node list: replacements in place, removed nodes out, then droppable nodes out
        until every one left has a reader (graph outputs and subgraphs' implicit inputs count)."""
        g = self.graph
        graph_outputs = {o.name for o in g.output}
        remove = set(self.remove)
        while True:
            kept = [(i, self.replace.get(i, [n])) for i, n in enumerate(g.node) if i not in remove]
            read: set[str] = set(graph_outputs)
            for _, nodes in kept:
                for n in nodes:
                    read |= node_reads(n)
            gone = {i for i, nodes in kept if i in self.droppable and not any(o in read for o in nodes[0].output if o)}
            if not gone:
                break
            remove |= gone
        final = [n for _, nodes in kept for n in nodes]
        del g.node[:]
        g.node.extend(final)


def drop_unused_initializers(model: onnx.ModelProto, candidates: set[tuple[str, str]]) -> None:
    """Remove the ``(graph path, name)`` initializers (and their graph inputs) that no node in any
    graph reads and no graph outputs any more."""
    used: set[str] = set()
    for _, g in iter_graphs(model.graph):
        for n in g.node:
            used.update(n.input)
        used.update(o.name for o in g.output)
    for path, g in iter_graphs(model.graph):
        drop = [t for t in g.initializer if (path, t.name) in candidates and t.name not in used]
        for t in drop:
            g.initializer.remove(t)
        names = {t.name for t in drop}
        for v in [v for v in g.input if v.name in names]:
            g.input.remove(v)
