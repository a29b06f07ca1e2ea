"""Value types (element type and shape) as ONNX Runtime's own ``Graph::Resolve`` gives them.

Why ORT answers, not ``onnx.shape_inference``
---------------------------------------------
The fusion rules (MatMulAddFusion's shape conditions above all) ask what ORT's ``NodeArg::Type()`` and
``Shape()`` say about activations, so the authority is the installed ORT's inference: its bundled onnx,
its com.microsoft schemas (onnx cannot infer contrib ops) and, in newer releases, its own propagation of
shape values. onnx's inference differs in ways the rules can see: it invents ``unk__N`` names for
unknown dims (two of them then compare equal where ORT has two unknown dims), and its data propagation
is not ORT's. It also costs memory nothing gives back: the first call builds onnx's operator schema
registry in this process, several MiB that stay for the life of the process, while ORT's own
registry is resident anyway for the session about to be created.

How
---
A weightless copy of the model is *loaded* by ``onnxruntime_pybind11_state.InferenceSession``: ORT
parses it and resolves the graph, and the session is never initialized (no kernels, no partitioning,
no execution plan, no weight read). In the copy, tensors above 4 KiB keep their type and dims but no
bytes (small ones keep their values, which shape inference may read: Reshape targets, Slice starts);
big tensors inside subgraphs, which ORT's checker refuses without bytes, move up to the main graph
under the same name, where outer-scope lookup finds them; and every node output of the main graph is
made a graph output, so ``outputs_meta`` lists its resolved type.

What falls back to onnx
-----------------------
Values *inside* subgraphs (If/Loop/Scan bodies): ORT cannot expose them, so they are typed by onnx
shape inference, run once and only when such a value is asked about. The whole model falls back the
same way when ORT refuses the copy (an op domain it knows only through the user's custom-op library,
a name that moving subgraph tensors up would shadow): what the model declares plus onnx's
inference.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, TypeProto, ValueInfoProto

from ortmem.base.dtypes import byte_size, numel
from ortmem.errors import UnsupportedDtypeError
from ortmem.onnxfile.walk import declared_dims, iter_graphs

log = logging.getLogger(__name__)

Dim = tuple[str, object]  # ("v", int) | ("p", str) | ("?", None)

#: Tensors up to this size keep their bytes in the copy: shape inference reads the values of small
#: constants (shape, axes, starts); a weight is far larger.
SMALL_TENSOR_BYTES = 4096

# ORT names element types in ``tensor(<name>)`` with TensorProto's enum names in lower case.
_ELEM_TYPES = {name.lower(): value for name, value in TensorProto.DataType.items()}
_ORT_FATAL = 4  # SessionOptions.log_severity_level: the copy's problems are ours to report, not ORT's log


@dataclass
class TypeInfo:
    elem_type: int
    shape: list[Dim] | None  # None: no shape known (NodeArg::Shape() == nullptr)


def _dim(d: int | str | None) -> Dim:
    """A dim as the rules compare it: a value, a non-empty name, or unknown."""
    if isinstance(d, int):
        return ("v", d)
    return ("p", d) if d else ("?", None)


def type_info(tp: TypeProto) -> TypeInfo | None:
    """A declared ``TypeProto`` as :class:`TypeInfo`; None for a value that is not a tensor."""
    declared = declared_dims(tp)
    if declared is None:
        return None
    elem_type, dims = declared
    return TypeInfo(elem_type, None if dims is None else [_dim(d) for d in dims])


class ValueTypes:
    """Types of a model's values per graph path ("" the main graph, onnx_walk's paths below), each
    source consulted on the first question that needs it."""

    def __init__(self, model: ModelProto):
        self._model = model

    def get(self, path: str, name: str) -> TypeInfo | None:
        if path == "" and self._by_ort is not None:
            return self._by_ort.get(name)
        return self._by_onnx.get(path, {}).get(name)

    @cached_property
    def _by_ort(self) -> dict[str, TypeInfo] | None:
        return ort_resolved_types(self._model)

    @cached_property
    def _by_onnx(self) -> dict[str, dict[str, TypeInfo]]:
        return onnx_inferred_types(self._model)


# -- ORT's Graph::Resolve -----------------------------------------------------------------------------

def ort_resolved_types(model: ModelProto) -> dict[str, TypeInfo] | None:
    """Main-graph value types as the installed ORT resolves them; None where ORT refuses the copy."""
    from onnxruntime.capi import onnxruntime_pybind11_state as native

    copy = _resolvable_copy(model)
    if copy is None:
        return None
    options = native.SessionOptions()
    options.log_severity_level = _ORT_FATAL
    try:
        session = native.InferenceSession(options, copy.SerializeToString(), False, False)
        metas = list(session.inputs_meta) + list(session.outputs_meta)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind types
        log.debug("ORT did not resolve the weightless copy (%s); onnx shape inference types the model", exc)
        return None
    out: dict[str, TypeInfo] = {}
    for meta in metas:
        ti = _from_ort(meta.type, meta.shape)
        if ti is not None:
            out[meta.name] = ti
    return out


def _from_ort(type_name: str, shape: list) -> TypeInfo | None:
    if not (type_name.startswith("tensor(") and type_name.endswith(")")):
        return None  # sequences, maps, optionals, sparse tensors: never a fusion operand
    elem = _ELEM_TYPES.get(type_name[len("tensor("):-1])
    if elem is None:
        return None
    # The binding gives [] both for a scalar and for an unknown shape; no rule accepts either, so
    # both read as "no shape known".
    return TypeInfo(elem, [_dim(d) for d in shape] if shape else None)


def _is_big(t: TensorProto) -> bool:
    """By type and dims, never ``ByteSize()``: protobuf serializes a message to measure it, which
    for an embedded weight is the weight's size again in memory."""
    if t.data_location == TensorProto.EXTERNAL:
        return True
    try:
        return byte_size(t.data_type, t.dims) > SMALL_TENSOR_BYTES
    except UnsupportedDtypeError:  # strings and unknown types: no fixed size, count elements
        return numel(t.dims) > SMALL_TENSOR_BYTES // 8


def _stand_in(t: TensorProto) -> TensorProto:
    """``t`` without bytes where it is big: neither inference reads a weight's values."""
    return TensorProto(name=t.name, data_type=t.data_type, dims=list(t.dims)) if _is_big(t) else t


def _constant_tensor(node: NodeProto) -> TensorProto | None:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    for a in node.attribute:
        if a.name == "value" and a.type == AttributeProto.TENSOR:
            return a.t
    return None


def _resolvable_copy(model: ModelProto) -> ModelProto | None:
    """The weightless copy ORT resolves (module docstring); None where moving subgraph tensors up
    could change what a name refers to."""
    hoisted: list[TensorProto] = []
    graph = _weightless_graph(model.graph, hoisted, main=True)
    if hoisted:
        counts = _value_name_counts(model.graph)
        if any(counts[t.name] > 1 for t in hoisted):
            return None
        graph.initializer.extend(hoisted)
    listed = {vi.name for vi in graph.output}
    for node in graph.node:
        for name in node.output:
            if name and name not in listed:
                listed.add(name)
                graph.output.append(ValueInfoProto(name=name))
    return _model_with(model, graph)


def _model_with(model: ModelProto, graph: GraphProto) -> ModelProto:
    copy = ModelProto(ir_version=model.ir_version, producer_name=model.producer_name)
    copy.opset_import.extend(model.opset_import)
    copy.functions.extend(model.functions)
    copy.graph.CopyFrom(graph)
    return copy


def _weightless_graph(g: GraphProto, hoisted: list[TensorProto] | None, *, main: bool) -> GraphProto:
    """``g`` with every big tensor as a stand-in; with ``hoisted`` given, a subgraph's big
    initializers and Constant values go there instead (ORT's checker refuses them without bytes)."""
    hoist = hoisted is not None and not main
    out = GraphProto(name=g.name)
    out.input.extend(g.input)
    out.output.extend(g.output)
    out.value_info.extend(g.value_info)
    for t in g.initializer:
        (hoisted if hoist and _is_big(t) else out.initializer).append(_stand_in(t))
    for sp in g.sparse_initializer:
        dense = TensorProto(name=sp.values.name, data_type=sp.values.data_type, dims=list(sp.dims))
        (hoisted if hoist else out.initializer).append(dense)
    for n in g.node:
        const = _constant_tensor(n)
        if hoist and const is not None and _is_big(const) and n.output:
            stand_in = _stand_in(const)
            stand_in.name = n.output[0]
            hoisted.append(stand_in)
            continue
        m = NodeProto(name=n.name, op_type=n.op_type, domain=n.domain)
        m.input.extend(n.input)
        m.output.extend(n.output)
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                m.attribute.append(AttributeProto(name=a.name, type=a.type,
                                                  g=_weightless_graph(a.g, hoisted, main=False)))
            elif a.type == AttributeProto.GRAPHS:
                b = AttributeProto(name=a.name, type=a.type)
                b.graphs.extend(_weightless_graph(s, hoisted, main=False) for s in a.graphs)
                m.attribute.append(b)
            elif a.type == AttributeProto.TENSOR:
                b = AttributeProto(name=a.name, type=a.type)
                b.t.CopyFrom(_stand_in(a.t))
                m.attribute.append(b)
            else:
                m.attribute.append(a)
        out.node.append(m)
    return out


def _value_name_counts(g: GraphProto) -> Counter[str]:
    """In how many graphs (main and subgraphs) each value name is defined."""
    counts: Counter[str] = Counter()
    for _, graph in iter_graphs(g):
        names = {vi.name for vi in graph.input}
        names.update(t.name for t in graph.initializer)
        names.update(sp.values.name for sp in graph.sparse_initializer)
        names.update(o for n in graph.node for o in n.output if o)
        counts.update(names)
    return counts


# -- onnx shape inference (subgraph values, and the fallback) ------------------------------------------

def onnx_inferred_types(model: ModelProto) -> dict[str, dict[str, TypeInfo]]:
    """Declared value_info plus onnx shape inference, per graph path, on a weightless copy (embedded
    weights are never copied). Values downstream of a contrib op may have no shape here where ORT has
    one; the rules then read "no shape"."""
    import onnx.shape_inference

    copy = _model_with(model, _weightless_graph(model.graph, None, main=True))
    try:
        inferred = onnx.shape_inference.infer_shapes(copy, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - fall back to what the model declares
        inferred = copy
    out: dict[str, dict[str, TypeInfo]] = {}
    for path, graph in iter_graphs(inferred.graph):
        types: dict[str, TypeInfo] = {}
        for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
            ti = type_info(vi.type)
            if ti is not None and (vi.name not in types or (types[vi.name].shape is None and ti.shape is not None)):
                types[vi.name] = ti
        out[path] = types
    return out
