"""Trade compute for memory on inference graphs: recompute long-lived cheap tensors, and pick a node order
that lowers the activation peak (issue 7).

ONNX Runtime's memory optimizer (``orttraining/core/optimizer/memory_optimizer``) recomputes cheap
activations, but only in training graphs. Inference graphs have the same problem in another form: a
tensor built once early and read late (the 4-D attention mask and rotary tables exporters build once
and hand to every layer, casts of shared inputs, long skip connections) sits in memory through every
layer's peak. This module finds such tensors on the liveness of ORT's own execution order
(:mod:`ortmem.plan.liveness`), reports what recomputing them would save, and rewrites the graph.

**Candidates.** For every arena buffer, its readers are split into *groups*: two consecutive readers
share a group unless some step between them holds more than both of them (then keeping the tensor
alive between them costs memory where it matters). The first group keeps the original; every later
group gets a *clone*: the smallest subgraph that produces the values the group reads from tensors
alive anyway at the group's first reader (graph inputs, initializers, ORT-folded constants, tensors
produced earlier and still read later), built only from deterministic ops on the allow-list below. A
clone is one *occurrence*; occurrences are clustered by *pattern* (the clone's op types in order,
``"Range+Greater+Where+...+"``, as ORT's summary names them).

**Cost classes.** ``free`` (shape/alias ops), ``cheap`` (element-wise, comparisons, data movement:
Cast, Expand, Tile, Where, Range, Gelu, Sigmoid, Cos, Slice, Concat, Gather, ...), ``expensive``
(MatMul, Gemm, Softmax, the LayerNorm family, reductions, Conv): used only when asked. Anything else
(random ops, control flow, unknown or contrib ops not listed) is never recomputed.

**Choosing.** Savings are never estimated: each cluster is *applied* and the rewritten graph's peak
recomputed with the same liveness model; a cluster is worth its saving at the peak divided by its
extra FLOPs. The greedy loop applies the best cluster, re-verifies the peak (recomputation can extend
the lives of its inputs, or a clone can land in the new peak), and repeats until the peak is under
the budget or nothing lowers it further. The chosen entries form the plan string
(``pattern:1:count,...``, ORT's memory-optimizer syntax; count ``-1`` = all occurrences, ``N`` = the
``N`` clones nearest the end of the run); applying a plan replays the same steps.

**Order.** ORT decides when a clone runs, not the file: ``DEFAULT`` is a reverse DFS from the graph
outputs (``Graph::ReverseDFSFrom`` in ``onnxruntime/core/graph/graph.cc``, called from
``GraphViewer::GraphViewer`` in ``graph_viewer.cc``) that expands a node's inputs highest index first,
so an input produced by a *low-index* node is emitted last, right before its consumer.
``PRIORITY_BASED`` is Kahn's sort with ``PriorityNodeCompare`` (Shape/Size first, then lower index):
it follows the file order. Both break ties by node index, and nodes ORT's optimizers create at level
>= 1 (fusions) get the highest indices, so both are predictable only on the graph ORT has already
optimized: plan on :func:`ortmem.plan.liveness.ort_optimized` (the CLI does by default). Two
placements are planned, replayed and scored, and the lower peak wins (DEFAULT on a tie):

* ``DEFAULT``: each clone is placed in the file right after the producers of its inputs (at the front
  when it reads only graph inputs); the reverse DFS then emits it just before its readers;
* ``PRIORITY_BASED`` (always with ``order=True``): the file is written in the order ORT runs now, each
  clone at the step before its readers where its own transient plus its result held until the
  readers costs least.

The chosen kind is recorded in ``metadata_props`` (``ortmem.recompute.execution_order``) together with
``ortmem.recompute.disabled_optimizers = CommonSubexpressionElimination``: ORT's CSE (level 1,
``onnxruntime/core/optimizer/common_subexpression_elimination.cc``) merges nodes with the same op,
attributes and inputs, i.e. exactly our clones, back into one (checked on 1.31.1); the session config
key ``optimization.disable_specified_optimizers`` turns it off.

**The guard.** The live set is what the plan lowers; ORT's arena (power-of-two growth, chunks not
split below half) and memory patterns (one block per run laid out by first fit, kernel scratch beside
it) decide resident memory under ORT's defaults, and a rewrite can lower the first and raise the
second. :func:`verify` measures both models under the defaults in fresh processes; the CLI refuses a
rewrite it finds worse.

**Peak-minimizing order.** Candidates (ORT's two orders; greedy list schedules that prefer the ready
node with the lowest immediate footprint, or the largest release; a beam search over list schedules
keeping the best partial schedule per set of executed nodes) improved by local moves around the
peak (sink the exclusive producer cone of a buffer alive across the peak to just before its first
reader; hoist a reader and its missing ancestors before the peak), each scored exactly with
``PRIORITY_BASED``'s own replay of the rewritten file. :func:`exhaustive_order` enumerates every
topological order of a small graph, for the tests.

Outputs are bit-identical: a clone runs the same kernel on the same inputs as its original (ORT's CPU
kernels are deterministic for a given shape and thread count; the allow-list holds no reduction whose
blocking could depend on position in the run).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import onnx
from onnx import NodeProto

from ..estimate import activations as act
from ...ortmodel import graph_index as og
from ..estimate.liveness import Context, Liveness, ModelLike, analyze, context, load_proto

MiB = 1 << 20
META_PREFIX = "ortmem.recompute."
ORT_OPTIMIZED_KEY = "ortmem.ort_optimized"  # set by liveness.ort_optimized: the file order is ORT's run order
CSE = "CommonSubexpressionElimination"
PLAN_VERSION = "1"

# --------------------------------------------------------------------------------- the allow-list
FREE_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Size"}
CHEAP_OPS = {
    # element-wise math
    "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Reciprocal", "Sqrt", "Exp", "Log", "Erf", "Sin", "Cos", "Tan",
    "Tanh", "Sigmoid", "HardSigmoid", "Relu", "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign", "Gelu", "Clip",
    "Min", "Max", "Floor", "Ceil", "Round", "Sign", "Mod", "Sum", "Mean",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "Where", "IsNaN", "IsInf",
    # construction and data movement
    "Cast", "CastLike", "Expand", "Tile", "Range", "ConstantOfShape", "Trilu", "Concat", "Slice", "Gather",
    "GatherElements", "Transpose", "Split", "Pad", "EyeLike", "OneHot", "Dropout",
}
#: com.microsoft ops (ORT's contrib kernels) of the same classes
CHEAP_CONTRIB = {"Gelu", "FastGelu", "QuickGelu", "BiasGelu"}
EXPENSIVE_OPS = {
    "MatMul", "Gemm", "Softmax", "LogSoftmax", "LayerNormalization", "ReduceMean", "ReduceSum", "ReduceMax",
    "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "CumSum",
    "Conv", "ConvTranspose", "Einsum", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
}
EXPENSIVE_CONTRIB = {"FusedMatMul", "FusedConv", "MatMulNBits", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                     "SkipSimplifiedLayerNormalization"}
CLASS_RANK = {"free": 0, "cheap": 1, "expensive": 2}


def cost_class(node: og.OrtNode) -> str | None:
    """``free``, ``cheap``, ``expensive``, or None when the node must never be recomputed (not on the
    allow-list, has subgraphs, or is not deterministic, e.g. Dropout with a training-mode input)."""
    if node.subgraphs:
        return None
    op, dom = node.op_type, node.domain
    if dom in ("", "ai.onnx"):
        if op == "Dropout" and len(node.inputs) > 2 and node.inputs[2]:
            return None
        if op in FREE_OPS:
            return "free"
        if op in CHEAP_OPS:
            return "cheap"
        if op in EXPENSIVE_OPS:
            return "expensive"
        return None
    if dom == "com.microsoft":
        if op in CHEAP_CONTRIB:
            return "cheap"
        if op in EXPENSIVE_CONTRIB:
            return "expensive"
    return None


def _numel(ctx: Context, name: str) -> int:
    s = ctx.shapes.get(ctx.root, name)
    if s is None or not s.known:
        return 0
    return math.prod(s.dims)  # type: ignore[arg-type]


def node_flops(ctx: Context, node: og.OrtNode) -> int:
    """Extra work of running ``node`` once more, in FLOPs (element operations for data movement)."""
    cls = cost_class(node)
    if cls == "free" or cls is None:
        return 0
    out = sum(_numel(ctx, o) for o in node.outputs if o)
    op = node.op_type
    if op in ("MatMul", "Gemm", "FusedMatMul", "MatMulNBits"):
        a = ctx.shapes.get(ctx.root, node.inputs[0])
        k = int(a.dims[-1]) if a is not None and a.known and a.dims else 0  # type: ignore[index]
        if op == "Gemm" and any(at.name == "transA" and at.i for at in node.proto.attribute) and a is not None \
                and a.known and len(a.dims) == 2:
            k = int(a.dims[0])  # type: ignore[index]
        return 2 * out * k
    if op in ("Conv", "ConvTranspose"):
        w = ctx.shapes.get(ctx.root, node.inputs[1])
        per = math.prod(w.dims[1:]) if w is not None and w.known else 1  # type: ignore[arg-type]
        return 2 * out * int(per)
    if op in ("Softmax", "LogSoftmax"):
        return 5 * out
    if "Normalization" in op:
        return 8 * out
    if op.startswith("Reduce") or op == "CumSum":
        return _numel(ctx, node.inputs[0])
    if op in ("Exp", "Log", "Erf", "Sin", "Cos", "Tan", "Tanh", "Sigmoid", "Gelu", "FastGelu", "QuickGelu",
              "BiasGelu", "Pow", "Softplus", "Elu", "Selu"):
        return 4 * out
    return out


# --------------------------------------------------------------------------------------- state
Entry = tuple  # ("keep", k) -> node k of the original file; ("new", NodeProto)


@dataclass
class State:
    """A (possibly rewritten) model under analysis: its node list as entries relative to the original
    file (so the rewrite can be re-emitted on the full model, weights and all), its liveness context
    (a derivation of the original's) and the execution order ORT will be told to use."""

    ctx: Context
    entries: list[Entry]
    kind: og.ExecutionOrder
    base: "State | None" = None
    _lv: Liveness | None = None

    @property
    def liveness(self) -> Liveness:
        if self._lv is None:
            self._lv = analyze(self.ctx, self.kind)
        return self._lv

    @property
    def peak(self) -> int:
        return self.liveness.peak_bytes


def initial_state(ctx: Context, kind: og.ExecutionOrder = "DEFAULT") -> State:
    return State(ctx, [("keep", k) for k in range(len(ctx.model.graph.node))], kind)


def _graph_with(ctx: Context, nodes: list[NodeProto]) -> onnx.ModelProto:
    """A copy of ``ctx.model`` with ``nodes`` as its main graph's nodes (weightless skeletons copy cheaply)."""
    m = onnx.ModelProto()
    g = ctx.model.graph
    saved = list(g.node)
    del g.node[:]
    try:
        m.CopyFrom(ctx.model)
    finally:
        g.node.extend(saved)
    m.graph.node.extend(nodes)
    return m


# ----------------------------------------------------------------------------------- discovery
@dataclass
class Occurrence:
    """One clone: recompute ``values`` of buffer ``tensor`` for the readers in ``consumers``."""

    tensor: str
    values: list[str]
    nbytes: int
    group: int  # 1 = the second reader group, ...
    first_reader: int  # step of the group's first reader (in the state's order)
    consumers: list[int]  # node indices (state graph)
    subgraph: list[int]  # node indices recomputed, in execution order
    sources: list[str]  # tensors the clone reads
    pattern: str
    cost_class: str
    flops: int


@dataclass
class Cluster:
    pattern: str
    cost_class: str
    occurrences: list[Occurrence]  # nearest the end of the run first (what a count keeps)

    @property
    def flops(self) -> int:
        return sum(o.flops for o in self.occurrences)

    @property
    def tensors(self) -> list[str]:
        return list(dict.fromkeys(o.tensor for o in self.occurrences))


def _readers(lv: Liveness, g: og.OrtGraph) -> tuple[dict[str, list[int]], dict[str, bool]]:
    """Steps reading each value, and whether some reader reads it from inside a subgraph."""
    readers: dict[str, list[int]] = {}
    implicit: dict[str, bool] = {}
    for p, i in enumerate(lv.order):
        n = g.nodes[i]
        for v in n.inputs:
            if v:
                readers.setdefault(v, []).append(p)
        for v in n.implicit_inputs:
            readers.setdefault(v, []).append(p)
            implicit[v] = True
    return readers, implicit


def _groups(positions: list[int], live: list[int]) -> list[list[int]]:
    """Reader steps split where some step between two consecutive readers holds more than both."""
    positions = sorted(set(positions))
    if not positions:
        return []
    groups = [[positions[0]]]
    for a, b in zip(positions, positions[1:]):
        gap = max(live[a + 1:b], default=0)
        if gap > max(live[a], live[b]):
            groups.append([b])
        else:
            groups[-1].append(b)
    return groups


def discover(state: State, classes: Iterable[str] = ("free", "cheap"), *, max_nodes: int = 48,
             min_bytes: int = 1) -> list[Occurrence]:
    """Every occurrence in ``state``: clones of buffers read by two or more reader groups, built from
    ops of the given cost ``classes``, at most ``max_nodes`` nodes each."""
    ctx, lv = state.ctx, state.liveness
    g = ctx.root
    allowed = set(classes)
    order = lv.order
    pos = {i: p for p, i in enumerate(order)}
    live = [s.live_bytes for s in lv.steps]
    readers, implicit = _readers(lv, g)
    last = {v: max(ps) for v, ps in readers.items()}
    outputs = set(g.outputs)
    removed = ctx.removed

    def available(x: str, q: int, own: set[str]) -> bool:
        if x in own:
            return False
        if x in g.inputs or g.find_initializer(x) is not None:
            return True
        p = g.producer.get(x)
        if p is None:
            return True  # outer scope or graph input under another name: not ours to free
        if id(g.nodes[p]) in removed:
            return True  # ORT folds it into a constant before the run
        if pos.get(p, q) >= q:
            return False
        return x in outputs or last.get(x, -1) >= q

    found: list[Occurrence] = []
    for t in lv.tensors:
        if t.nbytes < min_bytes or any(v in outputs for v in t.values) or any(implicit.get(v) for v in t.values):
            continue
        groups = _groups(t.consumers, live)
        if len(groups) < 2:
            continue
        own = set(t.values)
        for k, grp in enumerate(groups[1:], start=1):
            q = grp[0]
            cons = [order[p] for p in grp]
            wanted = [v for v in t.values if any(v in g.nodes[c].inputs for c in cons)]
            sub: set[int] = set()
            stack = list(wanted)
            ok = True
            seen: set[str] = set()
            srcs: list[str] = []
            while stack and ok:
                x = stack.pop()
                if x in seen:
                    continue
                seen.add(x)
                if available(x, q, own):
                    srcs.append(x)
                    continue
                p = g.producer.get(x)
                node = g.nodes[p] if p is not None else None
                cls = cost_class(node) if node is not None else None
                if node is None or cls is None or cls not in allowed or id(node) in removed:
                    ok = False
                    break
                if p not in sub:
                    sub.add(p)
                    if len(sub) > max_nodes:
                        ok = False
                        break
                    stack.extend(v for v in node.inputs if v)
            if not ok or not sub:
                continue
            nodes = sorted(sub, key=lambda i: pos[i])
            cls = max((cost_class(g.nodes[i]) or "cheap" for i in nodes), key=lambda c: CLASS_RANK[c])
            pattern = _pattern(g, sub)
            found.append(Occurrence(t.name, wanted, t.nbytes, k, q, cons, nodes, sorted(set(srcs)), pattern, cls,
                                    sum(node_flops(ctx, g.nodes[i]) for i in nodes)))
    return found


def _pattern(g: og.OrtGraph, sub: set[int]) -> str:
    """The clone's op types in a topological order that depends on structure, not node numbering
    (Kahn over the subgraph, the alphabetically first ready op next), ``+``-joined as ORT names them;
    so the same plan string selects the same clones whatever order or file layout the model has."""
    indeg = {i: len(g.input_nodes(i) & sub) for i in sub}
    ready = sorted((g.nodes[i].op_type, i) for i in sub if indeg[i] == 0)
    out: list[str] = []
    while ready:
        op, i = ready.pop(0)
        out.append(op + "+")
        for j in g.output_nodes(i) & sub:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append((g.nodes[j].op_type, j))
        ready.sort(key=lambda t: t[0])
    return "".join(out)


def clusters(occurrences: Iterable[Occurrence]) -> list[Cluster]:
    """Occurrences grouped by pattern; within a cluster the clones nearest the end of the run first."""
    by: dict[str, list[Occurrence]] = {}
    for o in occurrences:
        by.setdefault(o.pattern, []).append(o)
    out = []
    for pattern, occ in by.items():
        occ.sort(key=lambda o: (-o.first_reader, o.tensor))
        cls = max((o.cost_class for o in occ), key=lambda c: CLASS_RANK[c])
        out.append(Cluster(pattern, cls, occ))
    out.sort(key=lambda c: (min(o.first_reader for o in c.occurrences), c.pattern))
    return out


# ------------------------------------------------------------------------------------- rewriting
def _fresh(base: str, taken: set[str], tag: str) -> str:
    name = f"{base}__{tag}"
    k = 1
    while name in taken:
        k += 1
        name = f"{base}__{tag}{k}"
    taken.add(name)
    return name


def _ort_to_file(protos: Sequence[onnx.NodeProto], g) -> dict[int, int]:
    """File position of each ORT node index: ORT folds single-output Constant nodes into
    initializers, so they have no node index and the numbering skips them."""
    out: dict[int, int] = {}
    for k, proto in enumerate(protos):
        if proto.op_type == "Constant" and proto.domain in ("", "ai.onnx") and len(proto.output) == 1 \
                and proto.output[0] in g.constant_nodes:
            continue
        out[len(out)] = k
    return out


def apply(state: State, occurrences: Sequence[Occurrence]) -> tuple[State, list[Occurrence]]:
    """``state`` with ``occurrences`` cloned and their readers rewired (see the module docstring for
    where clones go in the file). Occurrences that touch nodes an earlier one rewired are skipped
    (they reappear, re-derived, in the next round). Returns the new state and what was applied."""
    ctx = state.ctx
    g = ctx.root
    lv = state.liveness
    pos = {i: p for p, i in enumerate(lv.order)}
    protos = list(ctx.model.graph.node)
    ort_to_file = _ort_to_file(protos, g)  # and the reverse, file_to_ort, below
    taken = {o for n in protos for o in n.output} | {n.name for n in protos} | set(g.inputs) | \
        {t.name for t in ctx.model.graph.initializer}
    entries = list(state.entries)
    new_protos: dict[int, NodeProto] = {}  # file position -> rewired copy
    touched_sub: set[int] = set()
    touched_cons: set[int] = set()
    applied: list[Occurrence] = []
    clones: list[tuple[Occurrence, list[NodeProto], list[og.OrtNode]]] = []
    renamed: dict[str, str] = {}
    for occ in occurrences:
        if set(occ.subgraph) & touched_cons or set(occ.consumers) & touched_sub:
            continue
        mapping: dict[str, str] = {}
        made: list[NodeProto] = []
        for i in occ.subgraph:
            src = g.nodes[i].proto
            c = NodeProto()
            c.CopyFrom(new_protos.get(ort_to_file[i], src))
            c.name = _fresh(src.name or src.op_type, taken, "rc")
            for s, v in enumerate(c.input):
                if v in mapping:
                    c.input[s] = mapping[v]
            for s, v in enumerate(c.output):
                if v:
                    nv = _fresh(v, taken, "rc")
                    mapping[v] = nv
                    renamed[nv] = v
                    c.output[s] = nv
            made.append(c)
        for ci in occ.consumers:
            k = ort_to_file[ci]
            p = new_protos.get(k)
            if p is None:
                p = NodeProto()
                p.CopyFrom(protos[k])
                new_protos[k] = p
            for s, v in enumerate(p.input):
                if v in occ.values:
                    p.input[s] = mapping[v]
        touched_sub.update(occ.subgraph)
        touched_cons.update(occ.consumers)
        clones.append((occ, made, [g.nodes[i] for i in occ.subgraph]))
        applied.append(occ)
    if not applied:
        return state, []
    for k, p in new_protos.items():
        entries[k] = ("new", p)

    # file layout
    const_pos = [k for k in range(len(protos)) if k not in ort_to_file.values()]
    if state.kind == "PRIORITY_BASED":
        # the file in the order ORT runs now, each clone at the cheapest step before its group's reader
        before: dict[int, list[int]] = {}
        live = [st.live_bytes for st in lv.steps]
        for n, (occ, _, _) in enumerate(clones):
            before.setdefault(lv.order[_clone_step(ctx, occ, pos, live)], []).append(n)
        layout: list[tuple[str, int, int]] = [("file", k, -1) for k in const_pos]
        # nodes ORT folds into constants never run (the order leaves them out): first, in file order
        layout += [("file", ort_to_file[i], -1) for i in range(len(g.nodes)) if id(g.nodes[i]) in ctx.removed]
        for i in lv.order:
            for n in before.get(i, []):
                layout += [("clone", n, j) for j in range(len(clones[n][1]))]
            layout.append(("file", ort_to_file[i], -1))
    else:
        # the original file order, each clone right after the last producer of what it reads
        after: dict[int, list[int]] = {}
        for n, (occ, _, _) in enumerate(clones):
            prods = [g.producer[s] for s in occ.sources if s in g.producer and id(g.nodes[g.producer[s]]) not in ctx.removed]
            anchor = max((ort_to_file[p] for p in prods), default=-1)
            after.setdefault(anchor, []).append(n)
        layout = [("file", k, -1) for k in const_pos]
        for n in after.get(-1, []):
            layout += [("clone", n, j) for j in range(len(clones[n][1]))]
        for i in range(len(g.nodes)):
            k = ort_to_file[i]
            layout.append(("file", k, -1))
            for n in after.get(k, []):
                layout += [("clone", n, j) for j in range(len(clones[n][1]))]
    nodes: list[NodeProto] = []
    new_entries: list[Entry] = []
    origins: list[og.OrtNode] = []
    file_to_ort = {k: i for i, k in ort_to_file.items()}
    for kind, a, j in layout:
        if kind == "file":
            e = entries[a]
            nodes.append(e[1] if e[0] == "new" else protos[a])
            new_entries.append(e)
            if a in file_to_ort:
                origins.append(g.nodes[file_to_ort[a]])
        else:
            occ, made, orig = clones[a]
            nodes.append(made[j])
            new_entries.append(("new", made[j]))
            origins.append(orig[j])
    model = _graph_with(ctx, nodes)
    new_ctx = ctx.derive(model, origins, renamed)
    return State(new_ctx, new_entries, state.kind, base=state), applied


def _clone_transient(ctx: Context, occ: Occurrence) -> int:
    """Peak of the clone's own tensors while it runs (its nodes in order; aliases free; a tensor freed
    after its last reader inside the clone; the recomputed values kept)."""
    g = ctx.root
    sub = occ.subgraph
    last: dict[str, int] = {}
    for k, i in enumerate(sub):
        for v in g.nodes[i].inputs:
            last[v] = k
    live = peak = 0
    held: dict[str, int] = {}
    for k, i in enumerate(sub):
        node = g.nodes[i]
        alias = node.op_type in act.ALIAS_OPS and node.domain in ("", "ai.onnx")
        new = 0 if alias else sum(act._granule(ctx.nbytes(o)) for o in node.outputs if o)
        peak = max(peak, live + new + ctx.workspace(node, ctx.shapes))
        live += new
        for o in node.outputs:
            if o and not alias:
                held[o] = act._granule(ctx.nbytes(o))
        for v in list(held):
            if v not in occ.values and last.get(v, -1) <= k:
                live -= held.pop(v)
    return peak


def _clone_step(ctx: Context, occ: Occurrence, pos: dict[int, int], live: list[int]) -> int:
    """Where to run a clone under ``PRIORITY_BASED``: the step ``p`` between its sources and its group's
    first reader ``q`` minimising ``max(live[p] + transient, max(live[p:q]) + bytes)`` (the clone's own
    peak at ``p``, then its result held until ``q``), the latest such step on ties."""
    g = ctx.root
    q = occ.first_reader
    lo = 0
    for v in occ.sources:
        p = g.producer.get(v)
        if p is not None and p in pos:
            lo = max(lo, pos[p] + 1)
    lo = min(lo, q)
    transient = _clone_transient(ctx, occ)
    best, best_cost = q, None
    run_max = 0
    for p in range(q, lo - 1, -1):  # walking back: max(live[p:q]) grows
        if p < q:
            run_max = max(run_max, live[p])
        cost = max(live[p] + transient, run_max + occ.nbytes)
        if best_cost is None or cost < best_cost:
            best, best_cost = p, cost
    return best


def reorder(state: State, order: Sequence[int]) -> State:
    """``state`` with its file written in ``order`` (node indices of ``state``'s graph), to be run with
    ``PRIORITY_BASED`` (which then follows the file, Shape/Size nodes excepted)."""
    ctx = state.ctx
    g = ctx.root
    protos = list(ctx.model.graph.node)
    ort_to_file = _ort_to_file(protos, g)
    const_pos = [k for k in range(len(protos)) if k not in ort_to_file.values()]
    order = _with_removed(ctx, order)
    layout = const_pos + [ort_to_file[i] for i in order]
    nodes = [protos[k] for k in layout]
    entries = [state.entries[k] for k in layout]
    origins = [g.nodes[i] for i in order]
    new_ctx = ctx.derive(_graph_with(ctx, nodes), origins, {})
    return State(new_ctx, entries, "PRIORITY_BASED", base=state)


# ---------------------------------------------------------------------------------------- orders
def _active(ctx: Context, order: Sequence[int]) -> list[int]:
    """``order`` without the nodes ORT folds into constants (they never run)."""
    return [i for i in order if id(ctx.root.nodes[i]) not in ctx.removed]


def _with_removed(ctx: Context, order: Sequence[int]) -> list[int]:
    """The folded nodes first (in file order; they read only constants), then ``order``'s others."""
    rem = [i for i in range(len(ctx.root.nodes)) if id(ctx.root.nodes[i]) in ctx.removed]
    return rem + _active(ctx, order)


def evaluate_order(ctx: Context, order: Sequence[int]) -> int:
    """Peak of ``order`` exactly as the liveness model counts it."""
    return ctx.activation(order, {}).peak_bytes


def realized(ctx: Context, order: Sequence[int]) -> list[int]:
    """The order ORT's ``PRIORITY_BASED`` runs once the file is written in ``order``."""
    rank = [0] * len(ctx.root.nodes)
    for r, i in enumerate(_with_removed(ctx, order)):
        rank[i] = r
    return _active(ctx, ctx.root.priority_order(rank))


def _sizes(ctx: Context) -> tuple[dict[str, int], set[str]]:
    g = ctx.root
    local = {o for n in g.nodes if id(n) not in ctx.removed for o in n.outputs if o}
    return {v: act._granule(ctx.nbytes(v)) for v in local}, local


def greedy_order(ctx: Context, mode: str = "footprint", base: Sequence[int] | None = None) -> list[int]:
    """A list schedule: at each step the ready node with the lowest immediate footprint (``footprint``:
    live + new outputs + workspace, ties to the larger release) or the largest net release
    (``release``: freed - allocated), ties to ``base`` (default ORT's ``DEFAULT`` order)."""
    g = ctx.root
    n = len(g.nodes)
    base = list(base) if base is not None else g.execution_order("DEFAULT")
    rank = {i: r for r, i in enumerate(base)}
    size, local = _sizes(ctx)
    outputs = set(g.outputs)
    users: dict[str, set[int]] = {}
    for i, node in enumerate(g.nodes):
        for v in {*node.inputs, *node.implicit_inputs}:
            if v in local:
                users.setdefault(v, set()).add(i)
    remaining = {v: len(u) for v, u in users.items()}
    indeg = [len(g.input_nodes(i)) for i in range(n)]
    ready = {i for i in range(n) if indeg[i] == 0}
    live = 0
    order: list[int] = []
    alias = act.ALIAS_OPS
    while ready:
        best, best_key = -1, None
        for i in ready:
            node = g.nodes[i]
            new = 0 if (node.op_type in alias and node.domain in ("", "ai.onnx")) or id(node) in ctx.removed else \
                sum(size.get(o, 0) for o in node.outputs if o)
            freed = sum(size.get(v, 0) for v in {*node.inputs, *node.implicit_inputs}
                        if v in remaining and remaining[v] == 1 and v not in outputs)
            ws = ctx.workspace(node, ctx.shapes) if new else 0
            key = (live + new + ws, new - freed, rank[i]) if mode == "footprint" else (new - freed, live + new + ws, rank[i])
            if best_key is None or key < best_key:
                best, best_key = i, key
        i = best
        ready.discard(i)
        order.append(i)
        node = g.nodes[i]
        if not ((node.op_type in alias and node.domain in ("", "ai.onnx")) or id(node) in ctx.removed):
            live += sum(size.get(o, 0) for o in node.outputs if o)
        for v in {*node.inputs, *node.implicit_inputs}:
            if v in remaining:
                remaining[v] -= 1
                if remaining[v] == 0 and v not in outputs:
                    live -= size.get(v, 0)
        for j in g.output_nodes(i):
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.add(j)
    if len(order) != n:
        raise ValueError("graph has a cycle")
    return _active(ctx, order)


def beam_order(ctx: Context, width: int = 16, max_nodes: int = 600) -> list[int] | None:
    """List scheduling with a beam: partial schedules ranked by (peak so far, live now), one kept per
    set of executed nodes (the live set depends on the set only), ``width`` kept per step. Approaches
    exhaustive search on small graphs; None above ``max_nodes`` (quadratic in the graph size)."""
    g = ctx.root
    n = len(g.nodes)
    if n > max_nodes:
        return None
    size, local = _sizes(ctx)
    outputs = set(g.outputs)
    users: dict[str, int] = {}
    for node in g.nodes:
        for v in {*node.inputs, *node.implicit_inputs}:
            if v in local:
                users[v] = users.get(v, 0) + 1
    alias = act.ALIAS_OPS

    def new_bytes(i: int) -> int:
        node = g.nodes[i]
        if (node.op_type in alias and node.domain in ("", "ai.onnx")) or id(node) in ctx.removed:
            return 0
        return sum(size.get(o, 0) for o in node.outputs if o)

    new = [new_bytes(i) for i in range(n)]
    ws = [ctx.workspace(g.nodes[i], ctx.shapes) if new[i] else 0 for i in range(n)]
    ins = [[v for v in {*g.nodes[i].inputs, *g.nodes[i].implicit_inputs} if v in users] for i in range(n)]
    preds = [g.input_nodes(i) for i in range(n)]
    # beam entries: (peak, live, order, done, remaining-users)
    beam = [(0, 0, [], frozenset(), dict(users))]
    for _ in range(n):
        cand: dict[frozenset, tuple] = {}
        for peak, live, order, done, rem in beam:
            ready = [i for i in range(n) if i not in done and preds[i] <= done]
            for i in ready:
                step_peak = max(peak, live + new[i] + ws[i])
                r2 = dict(rem)
                freed = 0
                for v in ins[i]:
                    r2[v] -= 1
                    if r2[v] == 0 and v not in outputs:
                        freed += size.get(v, 0)
                live2 = live + new[i] - freed
                d2 = done | {i}
                prev = cand.get(d2)
                if prev is None or (step_peak, live2) < (prev[0], prev[1]):
                    cand[d2] = (step_peak, live2, order + [i], d2, r2)
        beam = sorted(cand.values(), key=lambda e: (e[0], e[1]))[:width]
    return _active(ctx, beam[0][2]) if beam else None


def _cone_up(g: og.OrtGraph, start: int, lo: int, pos: dict[int, int]) -> set[int]:
    """``start`` and its ancestors placed at or after step ``lo``."""
    cone, stack = set(), [start]
    while stack:
        i = stack.pop()
        if i in cone:
            continue
        cone.add(i)
        stack.extend(j for j in g.input_nodes(i) if pos.get(j, -1) >= lo)
    return cone


def _cone_down(g: og.OrtGraph, producer: int, pos: dict[int, int]) -> set[int]:
    """``producer`` and its ancestors whose every reader is inside the set (an exclusive producer cone)."""
    cone = {producer}
    changed = True
    while changed:
        changed = False
        for i in list(cone):
            for j in g.input_nodes(i):
                if j in cone or j not in pos:
                    continue
                if all(k in cone for k in g.output_nodes(j)):
                    cone.add(j)
                    changed = True
    return cone


def _move(order: list[int], members: set[int], target: int) -> list[int]:
    """``order`` with ``members`` (kept in their relative order) moved to just before step ``target``."""
    moved = [i for i in order if i in members]
    rest = [(p, i) for p, i in enumerate(order) if i not in members]
    out, done = [], False
    for p, i in rest:
        if not done and p >= target:
            out.extend(moved)
            done = True
        out.append(i)
    if not done:
        out.extend(moved)
    return out


def _valid(g: og.OrtGraph, order: list[int]) -> bool:
    """Every edge between nodes of ``order`` points forward (folded nodes are not in it)."""
    pos = {i: p for p, i in enumerate(order)}
    return all(pos[j] < pos[i] for i in order for j in g.input_nodes(i) if j in pos)


def improve_order(ctx: Context, order: Sequence[int], *, rounds: int = 40, realize: bool = True) -> list[int]:
    """Local moves around the peak (see the module docstring), accepted while they lower the peak.
    With ``realize`` each candidate is scored as ORT's ``PRIORITY_BASED`` would run it."""
    g = ctx.root
    cur = list(realized(ctx, order) if realize else order)
    cur_peak = evaluate_order(ctx, cur)
    for _ in range(rounds):
        lv = analyze(ctx, cur)
        p = lv.peak_position
        pos = {i: k for k, i in enumerate(cur)}
        tries: list[list[int]] = []
        for t in lv.across_peak[:12]:  # sink what is alive across the peak
            prod = cur[t.start]
            firsts = [c for c in t.consumers if c > p]
            if not firsts:
                continue
            cone = _cone_down(g, prod, pos)
            target = min(min(pos[j] for j in g.output_nodes(i) if j not in cone) if g.output_nodes(i) - cone else len(cur)
                         for i in cone)
            if target > p:
                tries.append(_move(cur, cone, target))
            for c in firsts[:2]:  # hoist its next reader (and what that reader still needs) above the peak
                cone_up = _cone_up(g, cur[c], p, pos)
                tries.append(_move(cur, cone_up, p))
        best, best_peak = None, cur_peak
        for cand in tries:
            if not _valid(g, cand):
                continue
            cand = realized(ctx, cand) if realize else cand
            pk = evaluate_order(ctx, cand)
            if pk < best_peak:
                best, best_peak = cand, pk
        if best is None:
            break
        cur, cur_peak = best, best_peak
    return cur


@dataclass
class OrderResult:
    order: list[int]  # as ORT will run it (PRIORITY_BASED replay of the rewritten file)
    peak_bytes: int
    default_peak_bytes: int
    priority_peak_bytes: int
    tried: dict[str, int] = field(default_factory=dict)  # candidate -> peak


def best_order(ctx: Context, *, rounds: int = 40) -> OrderResult:
    """The lowest-peak order found (see the module docstring), as ORT would run it."""
    g = ctx.root
    cands = {
        "DEFAULT": _active(ctx, g.execution_order("DEFAULT")),
        "PRIORITY_BASED": _active(ctx, g.execution_order("PRIORITY_BASED")),
        "greedy-footprint": greedy_order(ctx, "footprint"),
        "greedy-release": greedy_order(ctx, "release"),
    }
    beam = beam_order(ctx)
    if beam is not None:
        cands["beam"] = beam
    tried: dict[str, int] = {}
    best, best_peak = None, None
    for name, o in cands.items():
        o2 = improve_order(ctx, o, rounds=rounds)
        pk = evaluate_order(ctx, o2)
        tried[name] = evaluate_order(ctx, realized(ctx, o))
        tried[name + "+moves"] = pk
        if best_peak is None or pk < best_peak:
            best, best_peak = o2, pk
    assert best is not None and best_peak is not None
    return OrderResult(best, best_peak, evaluate_order(ctx, cands["DEFAULT"]),
                       evaluate_order(ctx, cands["PRIORITY_BASED"]), tried)


def topological_orders(g: og.OrtGraph, limit: int = 200_000) -> Iterable[list[int]]:
    """Every topological order of ``g``'s main graph (raises past ``limit``)."""
    n = len(g.nodes)
    preds = [g.input_nodes(i) for i in range(n)]
    succs = [g.output_nodes(i) for i in range(n)]
    indeg = [len(p) for p in preds]
    order: list[int] = []
    count = [0]

    def rec(ready: set[int]):
        if len(order) == n:
            count[0] += 1
            if count[0] > limit:
                raise ValueError(f"more than {limit} topological orders")
            yield list(order)
            return
        for i in sorted(ready):
            order.append(i)
            nxt = set(ready)
            nxt.discard(i)
            for j in succs[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    nxt.add(j)
            yield from rec(nxt)
            for j in succs[i]:
                indeg[j] += 1
            order.pop()

    yield from rec({i for i in range(n) if indeg[i] == 0})


def exhaustive_order(ctx: Context, limit: int = 200_000) -> tuple[list[int], int]:
    """The lowest-peak topological order by enumeration (small graphs: tests and comparisons)."""
    best, best_peak = None, None
    for o in topological_orders(ctx.root, limit):
        pk = evaluate_order(ctx, o)
        if best_peak is None or pk < best_peak:
            best, best_peak = o, pk
    assert best is not None and best_peak is not None
    return best, best_peak


# ------------------------------------------------------------------------------------ plan strings
@dataclass(frozen=True)
class PlanEntry:
    pattern: str
    strategy: int = 1  # 1 = recompute (ORT's code); 0 = leave alone
    count: int = -1  # -1 = every occurrence

    def __str__(self) -> str:
        return f"{self.pattern}:{self.strategy}:{self.count}"


def parse_plan(text: str) -> list[PlanEntry]:
    """``"A+B+:1:-1,C+:1:2"`` -> entries (ORT's memory-optimizer syntax)."""
    out: list[PlanEntry] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        bits = part.split(":")
        if len(bits) != 3 or not bits[0].endswith("+"):
            raise ValueError(f"plan entry {part!r} is not PATTERN+:STRATEGY:COUNT")
        try:
            strategy, count = int(bits[1]), int(bits[2])
        except ValueError:
            raise ValueError(f"plan entry {part!r}: strategy and count must be integers") from None
        if strategy not in (0, 1) or count == 0 or count < -1:
            raise ValueError(f"plan entry {part!r}: strategy 0 or 1, count -1 or >= 1")
        out.append(PlanEntry(bits[0], strategy, count))
    return out


def format_plan(entries: Sequence[PlanEntry]) -> str:
    return ",".join(str(e) for e in entries)


# ------------------------------------------------------------------------------------ session settings
#: ORT's session config key (``onnxruntime_session_options_config_keys.h``) naming graph transformers
#: to skip, ``;``-separated; checked on 1.31.1 to keep CSE from merging clones.
DISABLE_OPTIMIZERS_KEY = "optimization.disable_specified_optimizers"


def _changes(order: str, disabled: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"execution_order": order}
    if disabled:
        out["session_config"] = {DISABLE_OPTIMIZERS_KEY: ";".join(disabled)}
    return out


def merge_config_value(key: str, ours: str, theirs: str | None) -> str:
    """A config value combining the user's and ours (the disabled-optimizer list is a union)."""
    if key != DISABLE_OPTIMIZERS_KEY or not theirs:
        return ours
    names = [n for n in theirs.split(";") if n]
    names += [n for n in ours.split(";") if n and n not in names]
    return ";".join(names)


def apply_session_changes(so, changes: Mapping[str, Any]):
    """Apply ``changes`` (from :func:`apply_for_session` or :func:`recorded_settings`) to an
    ``onnxruntime.SessionOptions`` in place, and return it. For people and scripts running a
    rewritten model with plain ONNX Runtime; the hook applies the same changes to a scoped copy."""
    import onnxruntime as ort

    if "execution_order" in changes:
        so.execution_order = getattr(ort.ExecutionOrder, str(changes["execution_order"]))
    for key, value in (changes.get("session_config") or {}).items():
        current = so.get_session_config_entry(key) if _has_config(so, key) else None
        so.add_session_config_entry(key, merge_config_value(key, str(value), current))
    return so


def _has_config(so, key: str) -> bool:
    try:
        so.get_session_config_entry(key)
        return True
    except Exception:  # noqa: BLE001 - ORT raises for a key never set
        return False


# ------------------------------------------------------------------------------------ the planner
@dataclass
class ClusterReport:
    """One row of the summary."""

    pattern: str
    cost_class: str
    occurrences: int
    tensors: list[dict[str, Any]]  # name, dims symbolic / resolved, bytes
    saved_bytes: int  # at the peak, applying this cluster alone to the original (exact)
    extra_flops: int
    plan: str
    chosen: bool = False


@dataclass
class Result:
    """What the planner decided, and the rewritten model's node list."""

    model: str
    dims: dict[str, int]
    execution_order: str  # what ORT must be told
    original_peak_bytes: int
    original_peak_bytes_by_order: dict[str, int]
    peak_bytes: int  # predicted, with the plan (and order) applied
    budget_bytes: int | None
    plan: str
    order_applied: bool
    clusters: list[ClusterReport]
    steps: list[dict[str, Any]]  # each greedy choice with the peak re-verified after it
    notes: list[str]
    state: State | None = None
    original: State | None = None
    baseline: str = "DEFAULT"  # what original_peak_bytes counts: ORT's DEFAULT order, or the file's order
    changed: bool = False  # something (nodes, order, or the file itself) is worth shipping

    @property
    def saved_bytes(self) -> int:
        return self.original_peak_bytes - self.peak_bytes

    @property
    def has_clones(self) -> bool:
        entries = self.state.entries if self.state is not None else []
        return self.changed and any(e[0] == "new" and "__rc" in e[1].name for e in entries)

    def session_changes(self) -> dict[str, Any]:
        """How the session must be created for the prediction to hold (empty when nothing changed):
        ``{"execution_order": "DEFAULT" | "PRIORITY_BASED", "session_config": {key: value}}``."""
        if not self.changed:
            return {}
        return _changes(self.execution_order, [CSE] if self.has_clones else [])

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("state", "original")}
        d["saved_bytes"] = self.saved_bytes
        d["clusters"] = [asdict(c) for c in self.clusters]
        d["session_changes"] = self.session_changes()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _dims_pair(ctx: Context, name: str) -> dict[str, Any]:
    return {"name": name, "dims": ctx.symbolic_dims(name), "resolved": ctx.dims_of(name), "bytes": ctx.nbytes(name)}


def _select(cluster: Cluster, count: int) -> list[Occurrence]:
    return list(cluster.occurrences if count == -1 else cluster.occurrences[:count])


def plan(model: ModelLike, dims: Mapping[str, int] | None = None, *, budget: int | None = None,
         plan_text: str | None = None, order: bool = False, expensive: bool = False, max_rounds: int = 32,
         ctx: Context | None = None, session_options=None, baseline: str | None = None,
         min_saved_bytes: int | None = None) -> Result:
    """Decide a recompute plan (and optionally an order) for ``model`` at ``dims``.

    ``plan_text`` applies exactly that plan; otherwise clusters are chosen greedily by savings per
    FLOP until the predicted peak is at most ``budget`` (None: as low as recompute gets it). The peak
    is re-verified after each choice; nothing that does not lower it is applied. ``expensive`` allows
    the expensive class (MatMul, Softmax, LayerNorm, ...). ``order`` adds the peak-minimizing order
    (then the model runs with ``PRIORITY_BASED``); it is kept only if it lowers the peak further.

    ``baseline`` is the order the savings are counted from, what the user runs today: ``"DEFAULT"``
    (ORT's default order of this file) or ``"file"`` (the file's own node order). ORT writes an
    optimized model in exactly the order it executed the model it optimized (``Graph::ToGraphProto``
    walks ``GraphViewer``'s default topological order; checked on 1.31.1: equal node for node), so for
    a graph from :func:`ortmem.plan.liveness.ort_optimized` the file order *is* the original model's
    run; None picks ``"file"`` when the model carries ``ortmem.ort_optimized`` in its metadata.
    ``min_saved_bytes`` (default: 1% of the baseline peak, at least one arena granule) is the least saving worth
    a rewrite: below it the model is left as is, since ORT's arena can lose more than that to a new
    layout (see :func:`verify`).
    """
    ctx = ctx or context(model, dims, session_options=session_options)
    if baseline is None:
        baseline = "file" if any(p.key == ORT_OPTIMIZED_KEY for p in ctx.model.metadata_props) else "DEFAULT"
    if baseline not in ("DEFAULT", "file"):
        raise ValueError(f"baseline must be 'DEFAULT' or 'file', not {baseline!r}")
    classes = ("free", "cheap", "expensive") if expensive else ("free", "cheap")
    kinds: list[og.ExecutionOrder] = ["DEFAULT", "PRIORITY_BASED"]  # recompute placed for either, then (order) reordered
    results = [_plan_kind(ctx, kind, classes, budget, plan_text, order, max_rounds, baseline, min_saved_bytes)
               for kind in kinds]
    # the lowest predicted peak; on a tie DEFAULT, whose clone placement survives ORT renumbering nodes
    return min(results, key=lambda r: (r.peak_bytes, r.execution_order != "DEFAULT"))


def _replay(state: State, entries: Sequence[PlanEntry], classes: Sequence[str],
            notes: list[str] | None = None, steps: list[dict[str, Any]] | None = None) -> State:
    """``entries`` applied one after the other, each to the clusters discovered on the state before it."""
    for entry in entries:
        if entry.strategy == 0:
            continue
        cl = next((c for c in clusters(discover(state, classes)) if c.pattern == entry.pattern), None)
        if cl is None:
            if notes is not None:
                notes.append(f"plan entry {entry} matches nothing in this model")
            continue
        state, applied = apply(state, _select(cl, entry.count))
        if steps is not None:
            steps.append({"entry": str(entry), "occurrences": len(applied), "peak_bytes": state.peak})
    return state


def _plan_kind(ctx: Context, kind: og.ExecutionOrder, classes: Sequence[str], budget: int | None,
               plan_text: str | None, order: bool, max_rounds: int, baseline: str = "DEFAULT",
               min_saved_bytes: int | None = None) -> Result:
    orig = initial_state(ctx, "DEFAULT")
    by_order = {"DEFAULT": orig.peak, "PRIORITY_BASED": initial_state(ctx, "PRIORITY_BASED").peak}
    if baseline == "file":
        by_order["file"] = analyze(ctx, list(range(len(ctx.root.nodes)))).peak_bytes
    base_peak = by_order["file" if baseline == "file" else "DEFAULT"]
    notes: list[str] = []
    if orig.liveness.unknown:
        notes.append(f"{len(orig.liveness.unknown)} tensors have unknown sizes (counted as 0): pass every "
                     "symbolic dimension with --dim NAME=VALUE")
    start = initial_state(ctx, kind)

    # the summary: every cluster on the original, scored alone (exact)
    reports: list[ClusterReport] = []
    for cl in clusters(discover(start, classes)):
        st2, applied = apply(start, cl.occurrences)
        saved = start.peak - st2.peak if applied else 0
        reports.append(ClusterReport(cl.pattern, cl.cost_class, len(cl.occurrences),
                                     [_dims_pair(ctx, t) for t in cl.tensors], saved, cl.flops,
                                     str(PlanEntry(cl.pattern))))

    state = start
    steps: list[dict[str, Any]] = []
    chosen: list[PlanEntry] = []
    if plan_text is not None:
        chosen = [e for e in parse_plan(plan_text) if e.strategy == 1]
        state = _replay(state, chosen, classes, notes, steps)
    else:
        for _ in range(max_rounds):
            if budget is not None and state.peak <= budget:
                break
            best = None
            for cl in clusters(discover(state, classes)):
                new, applied = apply(state, cl.occurrences)
                saved = state.peak - new.peak
                if not applied or saved <= 0:
                    continue
                score = (saved / (cl.flops + 1), saved)
                if best is None or score > best[0]:
                    best = (score, cl, new, len(applied))
            if best is None:
                break
            _, cl, new, n = best
            steps.append({"entry": str(PlanEntry(cl.pattern)), "occurrences": n, "saved_bytes": state.peak - new.peak,
                          "peak_bytes": new.peak})
            chosen.append(PlanEntry(cl.pattern))
            state = new
        if len(chosen) > 1:  # greedy is path-dependent: drop a choice the final plan does better without
            for entry in list(chosen):
                trial = [e for e in chosen if e != entry]
                alt = _replay(start, trial, classes)
                if alt.peak <= state.peak and (budget is None or alt.peak <= budget or state.peak > budget):
                    steps.append({"entry": f"dropped {entry}", "peak_bytes": alt.peak})
                    chosen, state = trial, alt
        if budget is not None and state.peak > budget:
            notes.append(f"budget {budget} B not reached: recompute gets the peak to {state.peak} B")
    chosen_patterns = {e.pattern for e in chosen}
    for r in reports:
        r.chosen = r.pattern in chosen_patterns

    order_applied = False
    if order:
        res = best_order(state.ctx)
        if res.peak_bytes < state.peak:
            new = reorder(state, res.order)
            if new.peak < state.peak:
                steps.append({"entry": "order", "peak_bytes": new.peak, "saved_bytes": state.peak - new.peak})
                state = new
                order_applied = True
        if not order_applied:
            notes.append("no order found below the current peak")
    final_kind = state.kind
    differs = state.base is not None or final_kind != "DEFAULT" or baseline == "file"
    least = max(act.ARENA_GRANULE, base_peak // 100) if min_saved_bytes is None else min_saved_bytes
    changed = differs and base_peak - state.peak >= max(least, 1)
    if differs and 0 < base_peak - state.peak < least:
        notes.append(f"the best rewrite saves {(base_peak - state.peak) / MiB:.2f} MiB, under the "
                     f"{least / MiB:.2f} MiB worth a new layout: nothing applied")
    if not changed:
        # never ship a rewrite (or an order switch) that does not lower the peak of what runs today
        if state.base is not None:
            notes.append("the rewrite does not lower the predicted peak: nothing applied")
        state, final_kind, chosen, order_applied = orig, "DEFAULT", [], False
        for r in reports:
            r.chosen = False
    name = ctx.model.graph.name
    return Result(name, dict(ctx.dims), final_kind, base_peak, by_order, state.peak if changed else base_peak, budget,
                  format_plan(chosen), order_applied, reports, steps, notes, state, orig, baseline, changed)


# ------------------------------------------------------------------------------------ materialize
def materialize(result: Result, full: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """The rewritten model: ``full`` (the original model with its weights, or None for the analysed
    skeleton) with the planned node list, and the run settings in ``metadata_props``. Initializers are
    not touched (nor read)."""
    base = full if full is not None else result.original.ctx.model  # type: ignore[union-attr]
    if result.state is None or not result.changed:
        return base
    src = list(base.graph.node)
    nodes = [src[e[1]] if e[0] == "keep" else e[1] for e in result.state.entries]
    out = onnx.ModelProto()
    g = base.graph
    saved = list(g.node)
    del g.node[:]
    try:
        out.CopyFrom(base)
    finally:
        g.node.extend(saved)
    out.graph.node.extend(nodes)
    # value_info of recomputed values: copies of the originals'
    vi = {v.name: v for v in base.graph.value_info}
    for e in result.state.entries:
        if e[0] == "new":
            for o in e[1].output:
                if "__rc" in o:
                    orig = o.split("__rc")[0]
                    if orig in vi:
                        c = out.graph.value_info.add()
                        c.CopyFrom(vi[orig])
                        c.name = o
    meta = {
        "execution_order": result.execution_order,
        "disabled_optimizers": CSE if result.has_clones else "",
        "plan": result.plan,
        "order": "1" if result.order_applied else "0",
        "dims": json.dumps(result.dims, sort_keys=True),
        "original_peak_bytes": str(result.original_peak_bytes),
        "predicted_peak_bytes": str(result.peak_bytes),
        "version": PLAN_VERSION,
    }
    keep = [p for p in out.metadata_props if not p.key.startswith(META_PREFIX)]
    del out.metadata_props[:]
    out.metadata_props.extend(keep)
    for k, v in meta.items():
        p = out.metadata_props.add()
        p.key, p.value = META_PREFIX + k, v
    return out


def recorded_settings(model: onnx.ModelProto) -> dict[str, Any]:
    """The session changes a rewritten model records (empty for a model ortmem did not rewrite)."""
    meta = {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
    if not meta:
        return {}
    return _changes(meta.get("execution_order", "DEFAULT"), [x for x in meta.get("disabled_optimizers", "").split(";") if x])


# ------------------------------------------------------------------------------------ the summary
def render(result: Result) -> str:
    """ORT-style memory-optimizer summary: one row per pattern, with the plan string that enables it."""
    m = lambda b: f"{b / MiB:,.2f} MiB"  # noqa: E731
    lines = [
        "=" * 100,
        f"ortmem recompute summary: {result.model}  dims {result.dims}",
        f"activation peak, as ORT runs the model today: {m(result.original_peak_bytes)} "
        + ("(the file's node order, which is ORT's order for the model it optimized)" if result.baseline == "file"
           else "(ExecutionOrder.DEFAULT)")
        + f"; ORT's orders of this file: DEFAULT {m(result.original_peak_bytes_by_order['DEFAULT'])}, "
        f"PRIORITY_BASED {m(result.original_peak_bytes_by_order['PRIORITY_BASED'])}",
        f"activation peak, with the plan: {m(result.peak_bytes)}  (saves {m(result.saved_bytes)}, "
        f"run with ExecutionOrder.{result.execution_order}"
        + (f", config {DISABLE_OPTIMIZERS_KEY}={CSE}" if result.has_clones else "")
        + ")",
        f"plan: {result.plan or '(none)'}" + ("  + peak-minimizing order" if result.order_applied else ""),
        "-" * 100,
        "|Freq | Recompute opportunities (clustered by pattern; each row is one plan entry)",
        "|_____|" + "_" * 93,
    ]
    if not result.clusters:
        lines.append("|0    | none: no buffer read by two reader groups can be rebuilt from the allow-list")
    floor = result.original_peak_bytes // 100
    shown = [r for r in result.clusters if r.chosen or abs(r.saved_bytes) >= max(floor, 1) or
             max((t["bytes"] for t in r.tensors), default=0) >= floor]
    for r in sorted(shown, key=lambda r: (-r.saved_bytes, r.pattern)):
        lines.append(f"|{r.occurrences:<5}|>>Recompute {r.pattern}")
        status = "Enabled (chosen)" if r.chosen else f"Disabled. Enable with --plan '{r.plan}'"
        lines.append(f"|     |  Status       : {status}")
        for t in r.tensors[:4]:
            lines.append(f"|     |  Tensor       : {t['name']}  {t['dims']} = {t['resolved']}  {m(t['bytes'])}")
        if len(r.tensors) > 4:
            lines.append(f"|     |  ... and {len(r.tensors) - 4} more tensors")
        lines.append(f"|     |  Saved at peak: {m(r.saved_bytes)} (this row alone, verified on the rewritten graph)")
        lines.append(f"|     |  Extra compute: {r.extra_flops / 1e6:,.1f} MFLOP per run ({r.cost_class})")
        lines.append("|_____|" + "_" * 93)
    if len(shown) < len(result.clusters):
        lines.append(f"|     | {len(result.clusters) - len(shown)} more patterns of tensors under 1% of the peak, saving "
                     "nothing at it (in --json)")
    for s in result.steps:
        extra = f", {s['occurrences']} clones" if "occurrences" in s else ""
        saved = f", saves {m(s['saved_bytes'])}" if "saved_bytes" in s else ""
        lines.append(f"step: {s['entry']}{extra} -> peak {m(s['peak_bytes'])}{saved} (re-verified)")
    lines += [f"note: {n}" for n in result.notes]
    lines.append("=" * 100)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the guard
class _Runs:
    """A session whose ``run`` runs ``n`` times: ``ortmem.measure.probe`` measures one ``run`` call,
    and the default peak is a matter of several runs (the arena grows, memory patterns kick in)."""

    def __init__(self, sess: Any, n: int) -> None:
        self._sess, self._n = sess, max(1, n)

    def get_inputs(self):
        return self._sess.get_inputs()

    def get_outputs(self):
        return self._sess.get_outputs()

    def run(self, names, feeds):
        out = None
        for _ in range(self._n):
            out = self._sess.run(names, feeds)
        return out


def _probe_session(model_path: str, options: Mapping[str, Any], *, live: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if live:
        from ...hygiene import set_malloc_thresholds

        set_malloc_thresholds(mmap_threshold=128 << 10, trim_threshold=128 << 10)
        so.enable_cpu_mem_arena = False
        so.enable_mem_pattern = False
    apply_session_changes(so, recorded_settings(onnx.load(model_path, load_external_data=False)))
    return _Runs(ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"]), int(options.get("runs", 1)))


def probe_default(model_path: str, options: dict) -> Any:
    """Probe strategy (``"ortmem.plan.recompute:probe_default"``): ORT's defaults (arena, memory
    patterns, ``ORT_ENABLE_ALL``) with the settings the model records, ``options["runs"]`` runs."""
    return _probe_session(model_path, options, live=False)


def probe_live(model_path: str, options: dict) -> Any:
    """Probe strategy: arena and memory patterns off, glibc's thresholds pinned at 128 KiB, so resident
    memory follows the live set."""
    return _probe_session(model_path, options, live=True)


@dataclass
class Verdict:
    """Fresh-process measurements of a rewrite against the model it replaces, ORT's defaults."""

    original_bytes: list[int]  # resident memory over the runs above resident memory after creation
    rewritten_bytes: list[int]
    tolerance_bytes: int
    ok: bool

    @property
    def saved_bytes(self) -> int:
        return int(statistics.median(self.original_bytes) - statistics.median(self.rewritten_bytes))


def verify(original: str | os.PathLike, rewritten: str | os.PathLike, dims: Mapping[str, int], *, runs: int = 3,
           repeat: int = 2, tolerance_bytes: int | None = None, options: Mapping[str, Any] | None = None) -> Verdict:
    """Measure both models the way users run them (ORT defaults, ``runs`` runs, each model in
    ``repeat`` fresh processes) and say whether the rewrite keeps the default peak (median resident
    memory of the runs above resident memory after creation) within ``tolerance_bytes`` of the
    original's (default: 2% of it, at least 2 MiB: the same file measures up to 2.5 MiB apart between
    sets of fresh processes under ORT's defaults, docs/recompute.md). A planner's live-set prediction
    cannot see what ORT's arena and memory patterns do with a new layout (power-of-two arena growth,
    the pattern block, kernel scratch taken beside it), so a rewrite is shipped only when this says so."""
    from ...measure.probe import probe

    opts = {"dims": dict(dims), "runs": runs, **dict(options or {})}
    res = {}
    for key, path in (("original", original), ("rewritten", rewritten)):
        vals = []
        for _ in range(max(1, repeat)):
            r = probe("ortmem.plan.recompute:probe_default", os.fspath(path), options=opts)
            vals.append(int(r.peak_run_bytes or 0) - int(r.rss_after_create_bytes))
        res[key] = vals
    base = statistics.median(res["original"])
    tol = max(2 << 20, int(0.02 * base)) if tolerance_bytes is None else tolerance_bytes
    ok = statistics.median(res["rewritten"]) <= base + tol
    return Verdict(res["original"], res["rewritten"], tol, ok)


# ------------------------------------------------------------------------------------ the hook
def apply_for_session(model: onnx.ModelProto | ModelLike, recompute: Any, dims: Mapping[str, int] | None = None,
                      *, session_options=None, folder: str | os.PathLike | None = None,
                      workdir: str | os.PathLike | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """What ``ortmem.InferenceSession(..., recompute=...)`` calls: ``(new_model, session_changes)``.

    ``model`` is what the hook is about to hand ORT: a path, or the skeleton (weights never read)
    whose external data lives in ``folder``. ``recompute``:

    * ``True`` / ``"auto"``: lower the peak as far as cheap recomputation gets it;
    * an ``int``: a budget in bytes;
    * a plan string (``"PATTERN+:1:-1,..."``, from ``ortmem recompute``'s summary);
    * ``"order"``: only the peak-minimizing order;
    * a dict with any of ``plan``, ``budget``, ``order`` (bool), ``expensive`` (bool), ``optimize``
      (bool, default: True when ``workdir`` is given), ``verify`` (bool, default False), ``dims``
      (symbolic dimension sizes, merged over ``dims``: sizes decide the plan).

    ``optimize``: plan on the graph ORT executes (:func:`ortmem.plan.liveness.ort_optimized`, a
    throwaway session at ``ORT_ENABLE_EXTENDED`` without pre-packing) instead of the graph as given,
    which is exact only at ``ORT_DISABLE_ALL``: ORT's fusions renumber nodes and so reorder them. The
    optimized model and its ``model.onnx.data`` are written into ``workdir`` (the caller's, kept until
    the session is created); ``session_changes["model_folder"]`` then names it, for
    ``session.model_external_initializers_file_folder_path``. ``verify``: measure the rewrite
    against the original under ORT's defaults in fresh processes (:func:`verify`; seconds to minutes)
    and refuse it (return the model unchanged, ``{}``) when its default peak is higher.

    A model already rewritten by ortmem (its ``metadata_props`` say so) comes back unchanged with the
    settings it records. ``session_changes`` is ``{}`` when nothing is worth changing, otherwise
    ``{"execution_order": "DEFAULT" | "PRIORITY_BASED", "session_config": {...}}`` (the config holds
    ``optimization.disable_specified_optimizers = CommonSubexpressionElimination`` when clones exist:
    ORT's CSE would merge them back). See docs/recompute.md, "The session hook".
    """
    proto = load_proto(model)
    recorded = recorded_settings(proto)
    if recorded or recompute in (None, False):
        return proto, recorded
    req: dict[str, Any] = {}
    if recompute is True or recompute == "auto":
        pass
    elif recompute == "order":
        req = {"order": True, "plan": ""}
    elif isinstance(recompute, bool):
        pass
    elif isinstance(recompute, int):
        req = {"budget": int(recompute)}
    elif isinstance(recompute, str):
        req = {"plan": recompute}
    elif isinstance(recompute, Mapping):
        unknown = set(recompute) - {"plan", "budget", "order", "expensive", "optimize", "verify", "dims"}
        if unknown:
            raise ValueError(f"recompute options not understood: {sorted(unknown)}")
        req = dict(recompute)
        dims = {**dict(dims or {}), **dict(req.pop("dims", None) or {})}
    else:
        raise TypeError(f"recompute must be True, an int budget, a plan string or a dict, not {type(recompute).__name__}")
    optimize = bool(req.get("optimize", workdir is not None))
    if (optimize or req.get("verify")) and workdir is None:
        raise ValueError("recompute with optimize or verify needs a workdir for the models it writes")
    analysed: onnx.ModelProto = proto
    opt_path = None
    if optimize:
        from ..estimate.liveness import ort_optimized

        opt_path = os.path.join(os.fspath(workdir), "model.onnx")  # type: ignore[arg-type]
        src = os.fspath(model) if isinstance(model, (str, os.PathLike)) else proto
        analysed = ort_optimized(src, opt_path, folder=folder)
    res = plan(analysed, dims, budget=req.get("budget"), plan_text=req.get("plan"), order=bool(req.get("order")),
               expensive=bool(req.get("expensive")), session_options=session_options)
    if not res.changed:
        return proto, {}
    new = materialize(res, analysed)
    changes = res.session_changes()
    if optimize:
        changes["model_folder"] = os.fspath(workdir)  # type: ignore[arg-type]
    if req.get("verify"):
        rewritten = os.path.join(os.fspath(workdir), "rewritten.onnx")  # type: ignore[arg-type]
        ref = os.fspath(model) if isinstance(model, (str, os.PathLike)) else opt_path
        if not optimize or ref is None:
            raise ValueError("verify needs optimize (the rewritten model's data lives in workdir)")
        onnx.save(new, rewritten)
        if not verify(ref, rewritten, dict(dims or {})).ok:
            return proto, {}
    return new, changes
