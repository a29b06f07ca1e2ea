"""Run-time activation memory: shapes from ONNX shape inference, lifetimes over ORT's execution order.

Why this way: activation memory is what ORT's arena holds while a run is in flight, which is the
sum of the tensors alive at each step; their sizes come from shape inference on the weightless
skeleton (tensor dims are metadata, so it is cheap), symbolic dimensions are resolved from the
caller's ``dims`` and whatever stays unknown is *reported*, never guessed. Lifetimes follow the
order ORT executes nodes in (:mod:`ortmem.ort.graph_index`).

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

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence


from ortmem.ort import graph_index as og
from ortmem.plan.estimate.shapes import Shapes, UnknownShape, granule, loop_trip_count


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
        return 2 * granule(n) if n else 0
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
            gb = granule(b)
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
    return sum(granule(value_bytes(sg, v, shapes, unknown)) for v in names if v and v in made)


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
    carried = sum(granule(value_bytes(body.graph, v, shapes, unknown)) for v in outs[1:1 + n_carried] if v)
    scans = sum(granule(value_bytes(body.graph, v, shapes, unknown)) for v in outs[1 + n_carried:] if v)
    loop_out = sum(granule(value_bytes(g, o, shapes, unknown)) for o in node.outputs if o)
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
        if granule(value_bytes(g, v, shapes, unknown)) == granule(nbytes) and nbytes > 0:
            return r
    return None
