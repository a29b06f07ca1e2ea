"""Tensor shapes for the estimator and the planners: ONNX (and symbolic) shape inference on the weightless
skeleton with ``dims`` bound, ORT's contrib ops, what stays unknown reported; sizes in the arena's granule.

Part of :mod:`ortmem.plan.estimate` (see ``activations`` for how shapes become activation memory)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import onnx
from onnx import TensorProto

from ortmem.base.dtypes import dtype_info
from ortmem.onnxfile.walk import declared_dims
from ortmem.ort import graph_index as og

ARENA_GRANULE = 256


def granule(n: int) -> int:
    return -(-n // ARENA_GRANULE) * ARENA_GRANULE


@dataclass
class TensorShape:
    """A value's element type and dims; a dim is an int, or a str for a symbol left unresolved."""

    elem_type: int
    dims: list[int | str] | None  # None: rank unknown

    @property
    def known(self) -> bool:
        return self.dims is not None and all(isinstance(d, int) for d in self.dims)

    def nbytes(self) -> int | None:
        if not self.known or not self.elem_type:
            return None
        try:
            bits = dtype_info(self.elem_type).bits
        except Exception:  # strings and other variable-size types
            return None
        return (math.prod(self.dims) * bits + 7) // 8  # type: ignore[arg-type]


@dataclass
class UnknownShape:
    graph: str
    value: str
    shape: list[int | str] | None
    reason: str


@dataclass
class Shapes:
    """Shapes of every value in every graph: ``types[graph path][value]``."""

    types: dict[str, dict[str, TensorShape]] = field(default_factory=dict)
    unresolved_symbols: set[str] = field(default_factory=set)

    def get(self, g: og.OrtGraph, name: str) -> TensorShape | None:
        gg: og.OrtGraph | None = g
        while gg is not None:  # outer-scope values
            t = self.types.get(gg.path, {}).get(name)
            if t is not None:
                return t
            gg = gg.parent
        return None


def shape_of(tp: onnx.TypeProto) -> TensorShape | None:
    declared = declared_dims(tp)
    if declared is None:
        return None
    elem_type, dims = declared
    return TensorShape(elem_type, None if dims is None else ["?" if d is None else d for d in dims])


def infer_shapes(skeleton: onnx.ModelProto, root: og.OrtGraph, dims: Mapping[str, int]) -> Shapes:
    """ONNX shape inference with graph-input symbols bound to ``dims`` (names found nowhere else stay
    symbols). The skeleton holds no weight bytes, so this costs what the graph costs."""
    m = onnx.ModelProto()
    m.CopyFrom(skeleton)
    init_names = {t.name for t in m.graph.initializer}
    symbols: set[str] = set()
    for vi in m.graph.input:
        if vi.name in init_names or not vi.type.HasField("tensor_type"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param:
                if d.dim_param in dims:
                    v = int(dims[d.dim_param])
                    d.Clear()
                    d.dim_value = v
                else:
                    symbols.add(d.dim_param)
    for graph in _graphs(m.graph):  # the same symbol declared inside a subgraph means the same size
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            if vi.type.HasField("tensor_type"):
                for d in vi.type.tensor_type.shape.dim:
                    if d.dim_param and d.dim_param in dims:
                        v = int(dims[d.dim_param])
                        d.Clear()
                        d.dim_value = v
    shapes = Shapes(unresolved_symbols=symbols)
    by_path = {g.path: g for g in og.walk(root)}
    _collect(_infer_with_contrib(m).graph, root, shapes, by_path)
    sym = symbolic_shapes(m)
    if sym is not None:  # ORT's own inference follows Shape->Gather->Concat chains much further
        _collect(sym.graph, root, shapes, by_path)
    return shapes


def symbolic_shapes(m: onnx.ModelProto) -> onnx.ModelProto | None:
    """``onnxruntime.tools.symbolic_shape_infer`` (shipped with onnxruntime; knows com.microsoft ops and
    evaluates shape arithmetic), on a copy whose external initializers are declared as graph inputs of
    their shape: the tool would otherwise try to read their bytes."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except Exception:  # noqa: BLE001 - an onnxruntime without its tools
        return None
    c = onnx.ModelProto()
    c.CopyFrom(m)
    _externals_as_inputs(c.graph)
    _shape_stand_ins(c.graph, _ranks(c))
    try:
        return _infer_without_dump(SymbolicShapeInference, c)
    except Exception:  # noqa: BLE001 - it gives up on some graphs (optional Loop inputs, unknown ops)
        return None


def _infer_without_dump(tool: type, m: onnx.ModelProto) -> onnx.ModelProto | None:
    """``SymbolicShapeInference.infer_shapes`` minus its last step: when inference is incomplete the
    tool saves ``sym_shape_infer_temp.onnx`` into the current directory before raising, a write
    the user never asked for. Same loop as the tool's own (``onnxruntime/tools/symbolic_shape_infer.py``);
    an incomplete result is ``None``, as the tool's exception was."""
    sym = tool(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess_output_rank, verbose
    complete = False
    sym._preprocess(m)
    while sym.run_:
        complete = sym._infer_impl()
    sym._update_output_from_vi()
    return sym.out_mp_ if complete else None


_REDUCE_STAND_IN = {"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ReduceMax",
                    "ReduceMin", "ReduceProd", "ReduceMean"}


def _ranks(m: onnx.ModelProto) -> dict[str, int]:
    """Ranks of main-graph values from ONNX's inference (enough to spell a Transpose)."""
    out: dict[str, int] = {}
    inferred = _infer(m)
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = shape_of(vi.type)
        if t is not None and t.dims is not None:
            out[vi.name] = len(t.dims)
    for t in m.graph.initializer:
        out[t.name] = len(t.dims)
    return out


def _shape_stand_ins(g: onnx.GraphProto, ranks: Mapping[str, int] | None = None) -> None:
    """Ops ORT's optimizer creates that ``symbolic_shape_infer`` has no rule for (it then gives up on
    the whole graph), replaced in this private copy by standard ops of the same output shape:
    ``FusedMatMul`` is a ``MatMul`` (``alpha`` scales values, not shapes), behind a ``Transpose`` of
    the last two axes for ``transA``/``transB`` when the operand's rank is known; ``FusedConv`` is a
    ``Conv`` (its activation is element-wise); a reduction with axes as an input is a ``ReduceSum``."""
    ranks = ranks or {}
    extra: list[tuple[int, onnx.NodeProto]] = []
    for k, n in enumerate(g.node):
        if n.domain == "com.microsoft" and n.op_type == "FusedMatMul":
            flags = {a.name: a.i for a in n.attribute}
            if flags.get("transBatchA") or flags.get("transBatchB"):
                continue
            pending: list[tuple[int, onnx.NodeProto]] = []
            for slot, name in ((0, "transA"), (1, "transB")):
                if not flags.get(name):
                    continue
                r = ranks.get(n.input[slot])
                if r is None or r < 2:
                    pending = []
                    break
                perm = list(range(r - 2)) + [r - 1, r - 2]
                pending.append((slot, onnx.helper.make_node("Transpose", [n.input[slot]],
                                                            [f"{n.input[slot]}__shape_T{k}"], perm=perm)))
            else:
                for slot, t in pending:
                    extra.append((k, t))
                    n.input[slot] = t.output[0]
                n.domain, n.op_type = "", "MatMul"
                del n.attribute[:]
        elif n.domain in ("", "ai.onnx") and n.op_type in _REDUCE_STAND_IN and len(n.input) >= 2:
            n.op_type = "ReduceSum"  # axes as an input (opset 18+): the one reduction the tool follows
        elif n.domain == "com.microsoft" and n.op_type == "FusedConv":
            keep = [a for a in n.attribute if a.name not in ("activation", "activation_params")]
            del n.attribute[:]
            n.attribute.extend(keep)
            n.domain, n.op_type = "", "Conv"
            del n.input[3:]  # the optional residual input Z
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _shape_stand_ins(a.g)
            for sg in a.graphs:
                _shape_stand_ins(sg)
    for k, t in reversed(extra):  # each Transpose right before the node that reads it
        g.node.insert(k, t)


def _externals_as_inputs(g: onnx.GraphProto) -> None:
    keep, moved = [], []
    for t in g.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            moved.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del g.initializer[:]
    g.initializer.extend(keep)
    names = {i.name for i in g.input}
    g.input.extend(v for v in moved if v.name not in names)
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _externals_as_inputs(a.g)
            for sg in a.graphs:
                _externals_as_inputs(sg)


def _infer(m: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # a model ONNX's checker dislikes: keep whatever the graph declared itself
        return m


def _infer_with_contrib(m: onnx.ModelProto, max_rounds: int = 64) -> onnx.ModelProto:
    """ONNX inference stops at operators it does not know (com.microsoft MatMulNBits): give those
    outputs their shape as ``value_info`` and infer again, until nothing new is learnt."""
    m = _infer(m)
    for _ in range(max_rounds):
        added = 0
        for graph in _graphs(m.graph):
            known = {vi.name: vi for vi in [*graph.input, *graph.value_info, *graph.output]}
            init = {t.name: t for t in graph.initializer}
            for node in graph.node:
                if node.domain != "com.microsoft" or node.op_type != "MatMulNBits" or not node.output:
                    continue
                out = node.output[0]
                if out in known and shape_of(known[out].type) is not None and shape_of(known[out].type).known:
                    continue
                a = known.get(node.input[0])
                sa = shape_of(a.type) if a is not None else None
                if sa is None or sa.dims is None or node.input[0] in init:
                    continue
                dims = [*sa.dims[:-1], _attr_int(node, "N")]
                vi = onnx.helper.make_tensor_value_info(out, sa.elem_type, dims)
                outputs = [o for o in graph.output if o.name == out]
                if outputs:
                    outputs[0].CopyFrom(vi)
                else:
                    graph.value_info.append(vi)
                added += 1
        if not added:
            break
        m = _infer(m)
    return m


def _graphs(graph: onnx.GraphProto):
    yield graph
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    yield from _graphs(sg)


def _collect(graph: onnx.GraphProto, g: og.OrtGraph, shapes: Shapes, by_path: dict[str, og.OrtGraph]) -> None:
    table = shapes.types.setdefault(g.path, {})
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        s = shape_of(vi.type)
        if s is not None and (vi.name not in table or (s.known and not table[vi.name].known)):
            table[vi.name] = s
    for name, t in g.initializers.items():
        table[name] = TensorShape(t.data_type, [int(d) for d in t.dims])
    # subgraphs: the (possibly inferred) graph has the same nodes in the same file positions
    for node in g.nodes:
        proto = graph.node[node.file_index]
        subs = []
        for a in proto.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                subs.append(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                subs.extend(a.graphs)
        for (_, sg), sproto in zip(node.subgraphs, subs):
            _collect(sproto, sg, shapes, by_path)
    _contrib_shapes(g, shapes)


def _attr_int(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _contrib_shapes(g: og.OrtGraph, shapes: Shapes) -> None:
    """Shapes ONNX's inference leaves out because it does not know com.microsoft ops, and Loop outputs
    declared without a shape: a carried output has its body output's shape, a scan output
    ``[trip count, *body output]`` when the trip count is a constant."""
    table = shapes.types[g.path]
    for node in g.nodes:
        if node.op_type == "Loop" and node.domain in ("", "ai.onnx") and node.subgraphs:
            body = node.subgraphs[0][1]
            n_carried = max(0, len(node.inputs) - 2)
            trips = loop_trip_count(node, g)
            for k, o in enumerate(node.outputs):
                t = table.get(o)
                b = shapes.types.get(body.path, {}).get(body.outputs[k + 1]) if k + 1 < len(body.outputs) else None
                if not o or (t is not None and t.known) or b is None or not b.known:
                    continue
                if k < n_carried:
                    table[o] = TensorShape(b.elem_type, list(b.dims))  # type: ignore[arg-type]
                elif trips is not None:
                    table[o] = TensorShape(b.elem_type, [trips, *b.dims])  # type: ignore[misc]
        if node.domain == "com.microsoft" and node.op_type == "MatMulNBits" and node.outputs:
            a = shapes.get(g, node.inputs[0])
            out = node.outputs[0]
            if a is not None and a.dims is not None and (out not in table or not table[out].known):
                table[out] = TensorShape(a.elem_type, [*a.dims[:-1], _attr_int(node.proto, "N")])


def loop_trip_count(node: og.OrtNode, g: og.OrtGraph) -> int | None:
    """The Loop's ``M`` when it is a constant scalar whose bytes sit in the graph (<= 127 B stay in the
    proto), else None (a run-time value)."""
    if not node.inputs or not node.inputs[0]:
        return None
    hit = g.find_initializer(node.inputs[0])
    if hit is None or hit[1].data_location == TensorProto.EXTERNAL:
        return None
    try:
        from onnx import numpy_helper

        return int(numpy_helper.to_array(hit[1]).reshape(-1)[0])
    except Exception:  # noqa: BLE001 - not a readable scalar
        return None

