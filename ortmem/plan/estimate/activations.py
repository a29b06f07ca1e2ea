"""Run-time activation memory: shapes from ONNX shape inference, lifetimes over ORT's execution order.

Why this way: activation memory is what ORT's arena holds while a run is in flight, which is the
sum of the tensors alive at each step; their sizes come from shape inference on the weightless
skeleton (tensor dims are metadata, so it is cheap), symbolic dimensions are resolved from the
caller's ``dims`` and whatever stays unknown is *reported*, never guessed. Lifetimes follow the
order ORT executes nodes in (:mod:`ortmem.ortmodel.graph_index`).

What ORT's allocation planner does that is modelled (``onnxruntime/core/framework/allocation_planner.cc``):
aliasing kernels (Reshape, Squeeze, Unsqueeze, Flatten, Identity) share their input's buffer; a
``MayInplace(0, 0)`` kernel (on ORT 1.31.1's CPU EP only the activation functions and Softmax, see
:data:`ORT_CPU_INPLACE_OPS`) writes into input 0's buffer when this is its last use; graph inputs
(fed by the caller) and initializers are not activations; graph outputs live to the end of the run.
Sizes are rounded up to the arena's 256-byte granule. Known per-node workspace: a MatMulNBits whose
weight is not pre-packed dequantizes B into a K*N*4-byte buffer on every run; a packed one quantizes
A to int8 blocks at accuracy level 4; a Conv outside the NCHWc layout uses an im2col buffer; a node
with subgraphs holds its subgraph's own activation peak while it runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import onnx
from onnx import TensorProto

from ...dtypes import dtype_info
from ...ortmodel import graph_index as og

ARENA_GRANULE = 256

ALIAS_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
#: Kernels that declare ``MayInplace(0, 0)`` on ORT 1.31.1's CPU EP, measured one op at a time on a
#: fresh 4 MiB activation with static shapes (``bench/recompute/inplace.py``): the activation
#: functions and Softmax/LogSoftmax. The binary element-wise ops (Add, Sub, Mul, Div, Pow, Sum, Max)
#: and Neg, Sqrt, Exp, Log, Erf, Abs, Floor, Ceil, Reciprocal, Gelu/FastGelu/QuickGelu and Dropout
#: always allocate a new output. ORT's planner (``allocation_planner.cc``) also needs the input's and
#: output's shapes to be provably equal (same dim values or the same non-empty dim_param), see
#: :meth:`ortmem.plan.estimate.liveness.Context.inplace_slots`, the one rule the estimator and the planners share.
ORT_CPU_INPLACE_OPS = frozenset({
    "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign", "Elu", "Selu", "Celu", "HardSigmoid",
    "ThresholdedRelu", "Shrink", "Clip", "Softmax", "LogSoftmax",
})


def _granule(n: int) -> int:
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


def _shape_of(tp: onnx.TypeProto) -> TensorShape | None:
    if not tp.HasField("tensor_type"):
        return None
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return TensorShape(tt.elem_type, None)
    dims: list[int | str] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append("?")
    return TensorShape(tt.elem_type, dims)


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
    sym = _symbolic(m)
    if sym is not None:  # ORT's own inference follows Shape->Gather->Concat chains much further
        _collect(sym.graph, root, shapes, by_path)
    return shapes


def _symbolic(m: onnx.ModelProto) -> onnx.ModelProto | None:
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
        t = _shape_of(vi.type)
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
                if out in known and _shape_of(known[out].type) is not None and _shape_of(known[out].type).known:
                    continue
                a = known.get(node.input[0])
                sa = _shape_of(a.type) if a is not None else None
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
        s = _shape_of(vi.type)
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


# ------------------------------------------------------------------------------------ fusions
def _scalar(g: og.OrtGraph, name: str) -> float | None:
    """The value of a one-element constant whose bytes are in the graph, else None."""
    hit = g.find_initializer(name) if name else None
    if hit is None or hit[1].data_location == TensorProto.EXTERNAL:
        return None
    try:
        from onnx import numpy_helper

        a = numpy_helper.to_array(hit[1])
        return float(a.reshape(-1)[0]) if a.size == 1 else None
    except Exception:  # noqa: BLE001 - not a readable number
        return None


def _only_consumer(g: og.OrtGraph, value: str, op: str) -> og.OrtNode | None:
    """The single node reading ``value`` when it is a default-domain ``op`` and ``value`` is no graph output."""
    users = g.consumers.get(value, [])
    if len(users) != 1 or value in g.outputs or g.implicit_users.get(value):
        return None
    n = g.nodes[users[0][0]]
    return n if n.op_type == op and n.domain in ("", "ai.onnx") else None


def _other_input(node: og.OrtNode, value: str) -> str | None:
    ins = [v for v in node.inputs if v]
    if len(ins) != 2 or value not in ins:
        return None
    return ins[1] if ins[0] == value else ins[0]


def _near(v: float | None, target: float, tol: float = 1e-3) -> bool:
    return v is not None and abs(v - target) <= tol * max(1.0, abs(target))


def ort_fusions(root: og.OrtGraph) -> dict[int, int]:
    """Element-wise chains ORT's level-2 optimizer replaces by one kernel on the CPU EP, as
    ``{id(inner node): id(last node)}`` for :func:`graph_activation`'s ``merged``.

    ``GeluFusion`` (``onnxruntime/core/optimizer/gelu_fusion.cc``): ``x -> Div(sqrt 2) | Mul(1/sqrt 2)
    -> Erf -> Add(1) -> Mul(x) -> Mul(0.5)``, or the 0.5 applied to ``x`` first
    (``Mul(x, 0.5) -> Mul(., Add)``), every inner value read once and no graph output; then
    ``BiasGeluFusion`` (``bias_gelu_fusion.cc``) takes in the ``Add`` of a 1-D constant bias that
    produces ``x`` when ``x`` is read by the Gelu alone. Measured on paraphrase-MiniLM-L3 (ORT 1.31.1,
    ``ortmem stats``): the FFN's ``Add -> Div -> Erf -> Add -> Mul -> Mul`` runs as one ``BiasGelu``,
    so the live peak is MatMul output + Gelu output, not three 4x-hidden tensors. Other fusions
    (attention, layer norm from primitives, QuickGelu, MatMul+Add) are not replayed."""
    merged: dict[int, int] = {}
    for g in og.walk(root):
        for div in g.nodes:
            if div.domain not in ("", "ai.onnx") or div.op_type not in ("Div", "Mul") or len(div.inputs) != 2:
                continue
            x, c = div.inputs
            if div.op_type == "Div" and not _near(_scalar(g, c), 2 ** 0.5):
                continue
            if div.op_type == "Mul":
                if not _near(_scalar(g, c), 0.5 ** 0.5):
                    x, c = c, x
                    if not _near(_scalar(g, c), 0.5 ** 0.5):
                        continue
            erf = _only_consumer(g, div.outputs[0], "Erf")
            add = erf and _only_consumer(g, erf.outputs[0], "Add")
            if add is None or not _near(_scalar(g, _other_input(add, erf.outputs[0]) or ""), 1.0):
                continue
            mul1 = _only_consumer(g, add.outputs[0], "Mul")
            if mul1 is None:
                continue
            other = _other_input(mul1, add.outputs[0])
            group: list[og.OrtNode] | None = None
            if other == x:  # x * (1 + erf) * 0.5
                mul2 = _only_consumer(g, mul1.outputs[0], "Mul")
                if mul2 is not None and _near(_scalar(g, _other_input(mul2, mul1.outputs[0]) or ""), 0.5):
                    group = [div, erf, add, mul1, mul2]
            elif other is not None and other in g.producer:  # (0.5 * x) * (1 + erf)
                half = g.nodes[g.producer[other]]
                if (half.op_type == "Mul" and half.domain in ("", "ai.onnx") and x in half.inputs
                        and _near(_scalar(g, _other_input(half, x) or ""), 0.5)
                        and _only_consumer(g, other, "Mul") is mul1):
                    group = [half, div, erf, add, mul1]
            if group is None:
                continue
            inner = {id(n) for n in group}
            users = {id(g.nodes[j]) for j, _ in g.consumers.get(x, [])}
            bias_add = g.nodes[g.producer[x]] if x in g.producer else None
            if (bias_add is not None and bias_add.op_type == "Add" and bias_add.domain in ("", "ai.onnx")
                    and users <= inner and x not in g.outputs and not g.implicit_users.get(x)
                    and any(len(hit[1].dims) == 1 for v in bias_add.inputs
                            if (hit := g.find_initializer(v)) is not None)):
                group.insert(0, bias_add)
            last = group[-1]
            for n in group[:-1]:
                merged[id(n)] = id(last)
    return merged


# ------------------------------------------------------------------------------------ lifetimes
WorkspaceFn = Callable[[og.OrtNode, Shapes], int]


def kernel_temporaries(node: og.OrtNode, shapes: Shapes) -> int:
    """Scratch buffers ORT 1.31.1's CPU kernels take from the arena while they run, beyond their outputs
    (measured with ``mem_in_use_peak`` per node, ``bench/recompute/inplace.py``): ``Where`` selects X
    and Y into two temporaries of the output's size before merging them (2x output). Element-wise,
    Softmax, Expand, MatMul and the rest measured none."""
    if node.op_type == "Where" and node.domain in ("", "ai.onnx") and node.outputs:
        s = shapes.get(node.graph, node.outputs[0])
        n = s.nbytes() if s is not None else None
        return 2 * _granule(n) if n else 0
    return 0


@dataclass
class NodeActivation:
    node: og.OrtNode
    position: int
    inputs_bytes: int
    outputs_bytes: int
    new_bytes: int  # outputs that took fresh arena memory (not aliased / in place)
    workspace_bytes: int
    live_bytes: int  # activations alive while this node runs, its outputs and workspace included
    unknown: list[str] = field(default_factory=list)


@dataclass
class Buffer:
    """One arena buffer over its life: allocated when ``values[0]`` was produced at position ``start``,
    freed after position ``end`` (inclusive; ``len(order)`` for graph outputs, which live to the end of
    the run). ``values`` are every tensor sharing it (aliasing kernels, in-place writes)."""

    root: str
    nbytes: int
    start: int
    end: int
    values: list[str] = field(default_factory=list)


@dataclass
class GraphActivation:
    graph: og.OrtGraph
    order: list[int]
    peak_bytes: int
    rows: list[NodeActivation]
    unknown: list[UnknownShape]
    subgraph_peaks: dict[int, int] = field(default_factory=dict)
    buffers: list[Buffer] = field(default_factory=list)  # every arena buffer of this graph, by start


def value_bytes(g: og.OrtGraph, name: str, shapes: Shapes, unknown: dict[tuple[str, str], UnknownShape]) -> int:
    s = shapes.get(g, name)
    n = s.nbytes() if s is not None else None
    if n is None:
        key = (g.path, name)
        if key not in unknown:
            if s is None:
                reason = "no shape inferred"
            elif s.dims is None:
                reason = "rank unknown"
            else:
                syms = [d for d in s.dims if isinstance(d, str)]
                reason = f"unresolved dims {syms}" if syms else "element type without a fixed size"
            unknown[key] = UnknownShape(g.path, name, s.dims if s is not None else None, reason)
        return 0
    return n


def graph_activation(g: og.OrtGraph, shapes: Shapes, order_kind: og.ExecutionOrder, workspace: WorkspaceFn,
                     unknown: dict[tuple[str, str], UnknownShape] | None = None,
                     removed: frozenset[int] = frozenset(), order: Sequence[int] | None = None,
                     inplace: Callable[[og.OrtNode], Sequence[int]] | None = None,
                     merged: Mapping[int, int] | None = None) -> GraphActivation:
    """Peak of the activations alive in ``g`` (subgraph peaks count as their node's workspace).

    ``removed`` holds ``id()`` of nodes ORT's optimizer turns into constants (folded chains, DQ nodes
    fused into MatMulNBits): they never run and their outputs are weights, not activations.
    ``order`` (node indices of ``g``, a topological order) replaces ORT's ``order_kind`` order for this
    graph only, so a planner can score a candidate order with the same rules (subgraphs keep
    ``order_kind``). ``inplace(node)`` names the input slots whose dying buffer ``node``'s first output
    may overwrite; ORT's rule is :meth:`ortmem.plan.estimate.liveness.Context.inplace_slots` (what the estimator
    and the planners pass); None: no in-place reuse. ``merged`` maps ``id()`` of a node ORT's optimizer
    fuses into a later one to ``id()`` of that last node of the group (:func:`ort_fusions`): the
    group's inner values are never allocated and what it reads from outside stays alive until the
    fused node has run, as it does for the single kernel ORT executes."""
    merged = merged or {}
    unknown = {} if unknown is None else unknown
    order = [i for i in (g.execution_order(order_kind) if order is None else order) if id(g.nodes[i]) not in removed]
    pos = {i: p for p, i in enumerate(order)}
    pos_of = {id(g.nodes[i]): p for i, p in pos.items()}
    outputs = set(g.outputs)
    local_values = {o for n in g.nodes if id(n) not in removed for o in n.outputs if o}

    # buffer roots: aliasing ops share their input's buffer
    root: dict[str, str] = {}

    def find(v: str) -> str:
        while v in root:
            v = root[v]
        return v

    last_use: dict[str, int] = {}
    group_reads: dict[int, list[str]] = {}  # id(last node of a fused group) -> what its inner nodes read
    for n in g.nodes:
        if id(n) in removed:
            continue
        at = pos_of.get(merged[id(n)], pos[n.index]) if id(n) in merged else pos[n.index]
        if id(n) in merged:
            group_reads.setdefault(merged[id(n)], []).extend([*n.inputs, *n.implicit_inputs])
        for v in [*n.inputs, *n.implicit_inputs]:
            if v in local_values:
                last_use[v] = max(last_use.get(v, -1), at)
    end = len(order)
    for v in outputs:
        if v in local_values:
            last_use[v] = end
    size: dict[str, int] = {}  # root -> bytes held
    buffers: dict[str, Buffer] = {}  # root -> its life (the record returned)
    holders: dict[str, int] = {}  # root -> number of values still alive sharing it
    alive_until: dict[str, int] = {}
    live = 0
    peak = 0
    rows: list[NodeActivation] = []
    sub_peaks: dict[int, int] = {}
    for p, i in enumerate(order):
        node = g.nodes[i]
        ws = workspace(node, shapes)
        subs = [graph_activation(sg, shapes, order_kind, workspace, unknown, removed, inplace=inplace, merged=merged)
                for _, sg in node.subgraphs]
        for sub in subs:
            sub_peaks[i] = max(sub_peaks.get(i, 0), sub.peak_bytes)
        ws += control_flow_workspace(node, g, subs, shapes, unknown) if subs else 0
        in_bytes = sum(value_bytes(g, v, shapes, unknown) for v in node.inputs if v and v in local_values
                       or (v in g.inputs))
        out_bytes = 0
        new = 0
        unk: list[str] = []
        for k, o in enumerate(node.outputs):
            if not o or id(node) in merged:  # inside a fused group: never materialised
                continue
            b = value_bytes(g, o, shapes, unknown)
            if (g.path, o) in unknown:
                unk.append(o)
            out_bytes += b
            src = node.inputs[0] if node.inputs else ""
            if k == 0 and node.op_type in ALIAS_OPS and node.domain in ("", "ai.onnx") and src:
                root[o] = find(src)  # a graph input or initializer aliased costs no arena memory either
                holders[find(src)] = holders.get(find(src), 0) + 1
                alive_until[o] = last_use.get(o, p)
                if find(src) in buffers:
                    buffers[find(src)].values.append(o)
                continue
            slots = inplace(node) if inplace is not None and k == 0 and o not in outputs else ()
            if slots:
                reuse = _inplace_source(node, g, shapes, unknown, local_values, last_use, p, find, size, holders, outputs, b,
                                        slots)
                if reuse is not None:
                    root[o] = reuse
                    holders[reuse] = holders.get(reuse, 0) + 1
                    alive_until[o] = last_use.get(o, p)
                    buffers[reuse].values.append(o)
                    continue
            gb = _granule(b)
            size[o] = gb
            buffers[o] = Buffer(o, gb, p, end, [o])
            holders[o] = 1
            alive_until[o] = last_use.get(o, p)  # an unused output dies right after its node
            live += gb
            new += gb
        peak = max(peak, live + ws)
        rows.append(NodeActivation(node, p, in_bytes, out_bytes, new, ws, live + ws, unk))
        # release every value whose last use was this node
        for v in [*node.inputs, *node.implicit_inputs, *node.outputs, *group_reads.get(id(node), ())]:
            if v in alive_until and alive_until[v] <= p:
                del alive_until[v]
                r = find(v)
                holders[r] = holders.get(r, 1) - 1
                if holders[r] <= 0 and r in size:
                    live -= size.pop(r)
                    buffers[r].end = p
    return GraphActivation(g, order, peak, rows, list(unknown.values()), sub_peaks, list(buffers.values()))


def _produced_output_bytes(sub: GraphActivation, shapes: Shapes, unknown: dict, names: Sequence[str]) -> int:
    """Arena bytes of those of ``names`` (outputs of ``sub``) that a node of ``sub`` writes itself."""
    sg = sub.graph
    made = {o for n in sg.nodes for o in n.outputs if o}
    return sum(_granule(value_bytes(sg, v, shapes, unknown)) for v in names if v and v in made)


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


def control_flow_workspace(node: og.OrtNode, g: og.OrtGraph, subs: list[GraphActivation], shapes: Shapes,
                           unknown: dict) -> int:
    """Arena bytes a node with subgraphs holds while it runs beyond its own outputs (which the caller
    counts as new at this node). ORT 1.31.1, ``onnxruntime/core/providers/cpu/controlflow/``:

    * ``If`` (if.cc ``IfImpl::Execute``): the branch's outputs are written straight into the If's
      outputs through custom fetch allocators, so the branch peak already holds them: workspace =
      branch peak - the branch outputs its own nodes write.
    * ``Loop`` (loop.cc ``LoopImpl::Execute``): no custom fetch allocator ("loop carried variables
      can change shape across iterations"); iteration k's fetches become iteration k+1's feeds
      (``SaveOutputsAndUpdateFeeds``), so during iteration k >= 2 the previous carried values are alive
      beside the body's peak, and the scan outputs of iterations 1..k-1 are kept for the final concat;
      after the last iteration the carried values are copied into newly allocated Loop outputs
      (``copy_tensor_from_mlvalue_to_output``) while the feeds (iteration N-1) and the fetches (N) are
      still held, and the scan outputs are concatenated into an N x per-iteration output
      (``ConcatenateLoopOutput``). Peak = max(body peak + carried + (N-1) x scans,
      2 x carried + N x scans + the Loop's outputs); workspace = that - the Loop's outputs.
    * anything else (Scan, ...): the largest subgraph peak.
    """
    op = node.op_type if node.domain in ("", "ai.onnx") else ""
    if op == "If":
        return max(max(0, s.peak_bytes - _produced_output_bytes(s, shapes, unknown, s.graph.outputs)) for s in subs)
    if op != "Loop" or len(subs) != 1:
        return max(s.peak_bytes for s in subs)
    body = subs[0]
    n_carried = max(0, len(node.inputs) - 2)
    outs = body.graph.outputs
    carried = sum(_granule(value_bytes(body.graph, v, shapes, unknown)) for v in outs[1:1 + n_carried] if v)
    scans = sum(_granule(value_bytes(body.graph, v, shapes, unknown)) for v in outs[1 + n_carried:] if v)
    loop_out = sum(_granule(value_bytes(g, o, shapes, unknown)) for o in node.outputs if o)
    trips = loop_trip_count(node, g)
    if trips is None:
        trips = 2  # the carried state is the same from the second iteration on
        scan_names = [o for o in node.outputs[n_carried:] if o]
        if scans and scan_names:
            unknown.setdefault((g.path, scan_names[0] + " (Loop trip count)"), UnknownShape(
                g.path, scan_names[0], None, "Loop trip count is not a constant: scan outputs counted for 2 iterations"))
    if trips <= 0:
        return 0
    prev = carried if trips >= 2 else 0  # iteration 1's feeds are the Loop's own inputs
    during = body.peak_bytes + prev + (trips - 1) * scans
    after = prev + carried + trips * scans + loop_out
    return max(0, max(during, after) - loop_out)


def _inplace_source(node, g, shapes, unknown, local_values, last_use, p, find, size, holders, outputs,
                    nbytes, slots) -> str | None:
    """The buffer of one of the input ``slots`` a MayInplace kernel would overwrite: same size,
    produced in this graph, no other holder left after this node, not a graph output."""
    for k, v in enumerate(node.inputs):
        if k not in slots:
            continue
        if not v or v not in local_values or v in outputs:
            continue
        r = find(v)
        if r not in size or last_use.get(v, -1) != p or holders.get(r, 0) != 1:
            continue
        if _granule(value_bytes(g, v, shapes, unknown)) == _granule(nbytes) and nbytes > 0:
            return r
    return None
