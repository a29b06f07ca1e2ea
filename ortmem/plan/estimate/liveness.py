"""Live activation bytes at every step of ONNX Runtime's execution order, the peak, and what is alive across it.

Why a module of its own: the estimator (:mod:`ortmem.plan.estimate`) needs one number per model, the
activation peak; recompute and order planning (:mod:`ortmem.plan.recompute`) need the whole picture:
which buffer is alive at which step, who produced it, who reads it last, and which buffers are alive
*across* the peak (produced before it, read after it) and so could be given back and rebuilt later.
Nothing is computed twice: shapes come from :func:`ortmem.plan.estimate.shapes.infer_shapes` (symbolic dims
bound from ``dims``), the order from :mod:`ortmem.ort.graph_index` (ORT's ``DEFAULT`` reverse DFS and
``PRIORITY_BASED`` Kahn, ``onnxruntime/core/graph/graph_viewer.cc``), the step-by-step accounting
(aliasing kernels, in-place writes, graph outputs living to the end, 256-byte arena granules,
per-node workspace, subgraph peaks) from :func:`ortmem.plan.estimate.activations.graph_activation`, and what
ORT turns into constants before running (constant folding, DQ nodes fused into MatMulNBits) plus the
kernels' workspace from the estimator's own recipe (``estimate.plan_model`` / ``estimate.workspace_fn``).

Only the main graph is planned; a node with subgraphs counts their peak as its workspace.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence, Union

import onnx

from ortmem.plan.estimate import activations as act
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og
from ortmem.plan.estimate.estimator import workspace_fn
from ortmem.ort.settings import session_settings
from ortmem.plan.estimate.recipe import nchwc_block, plan_model
from ortmem.plan.estimate.graph_context import Context, ModelLike, load_proto, ort_view
from ortmem.base.units import MiB

OrderLike = Union[str, Sequence[int]]


def context(model: ModelLike, dims: Mapping[str, int] | None = None, *, session_options=None,
            accuracy_level: int | None = None) -> Context:
    """Shapes (``dims`` bound), ORT's graph view, the nodes ORT folds or fuses away, and kernel workspace.

    ``session_options`` (an ``onnxruntime.SessionOptions``) sets the optimization level (what is
    folded or fused before the run) and the execution order; ORT's defaults otherwise.
    """
    proto = load_proto(model)
    st = session_settings(session_options, accuracy_level=accuracy_level)
    root = og.build(proto.graph)
    shapes = shp.infer_shapes(proto, root, dict(dims or {}))
    model_file = os.path.basename(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else ""
    plan = plan_model(root, proto, shapes, st, model_file)
    estimator_ws = workspace_fn(plan, st, st.graph_optimization_level >= 99 and bool(nchwc_block()))

    def workspace(node: og.OrtNode, sh: shp.Shapes) -> int:
        return estimator_ws(node, sh) + act.kernel_temporaries(node, sh)

    return Context(proto, root, shapes, plan.removed, workspace, dict(dims or {}), st.execution_order,
                   ort_view(proto))


def ort_optimized(model: str | os.PathLike | bytes | onnx.ModelProto, out_path: str | os.PathLike, *,
                  level: str = "ORT_ENABLE_EXTENDED", folder: str | os.PathLike | None = None) -> onnx.ModelProto:
    """The graph ORT will actually execute: a throwaway session at ``level`` writes its optimized model
    to ``out_path`` (initializers over 1 KiB into ``<out_path>.data`` beside it), returned without
    external data.

    Why plan on it: ORT's optimizers (level >= 1) fuse nodes and give every new node an index past
    the existing ones, and both execution orders break ties by index, so the order ORT runs a graph in
    is only predictable on the graph after optimization. Reloading an optimized graph optimizes
    nothing more (checked on 1.31.1: same nodes, and ``DEFAULT`` and ``PRIORITY_BASED`` replays equal
    ORT's profile at ``ORT_ENABLE_ALL``), so a plan made on it is a plan for what ORT runs. EXTENDED
    (not ALL) keeps the file independent of the CPU's NCHWc block size; level 3 layout changes still
    happen at load for Conv models. ORT writes the nodes in the order it executed the original model
    (``Graph::ToGraphProto`` follows the default topological order), so the file's own order is the
    baseline the planner counts savings from; ``metadata_props["ortmem.ort_optimized"]`` says so.
    ``folder`` resolves a skeleton's external data
    (``session.model_external_initializers_file_folder_path``). Pre-packing is off: only the graph is
    wanted, and creation then reads no weight it does not have to.
    """
    import onnxruntime as ort

    out = os.fspath(out_path)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.optimized_model_filepath = out
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                os.path.basename(out) + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.add_session_config_entry("session.disable_prepacking", "1")
    if folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", os.fspath(folder))
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else \
        (bytes(model) if isinstance(model, (bytes, bytearray)) else os.fspath(model))
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    del sess
    optimized = onnx.load(out, load_external_data=False)
    mark = optimized.metadata_props.add()  # the file's order is ORT's run of the model it came from
    mark.key, mark.value = "ortmem.ort_optimized", level
    onnx.save(optimized, out)  # the graph only: initializers are in <out>.data
    return optimized


# ------------------------------------------------------------------------------------- results
@dataclass
class Tensor:
    """One arena buffer of the main graph over its life (positions are steps of the order)."""

    name: str  # the value whose producer allocated the buffer
    values: list[str]  # every value sharing it (aliases, in-place outputs), ``name`` first
    nbytes: int  # arena bytes (256-byte granules)
    start: int  # step that produced it
    end: int  # last step that reads it (``len(order)`` for a graph output)
    producer: str  # node label
    op: str
    consumers: list[int]  # steps reading any of ``values`` (explicitly or from a subgraph)
    dims: list[int | str] | None = None

    def alive_at(self, p: int) -> bool:
        return self.start <= p <= self.end

    def across(self, p: int) -> bool:
        """Alive at step ``p`` without being read or written by it: could be dropped before ``p``
        and rebuilt after."""
        return self.start < p < self.end and p not in self.consumers


@dataclass
class Step:
    position: int
    node: str
    op: str
    index: int  # ORT node index
    live_bytes: int  # alive while the node runs: buffers, its new outputs, workspace
    workspace_bytes: int


@dataclass
class Liveness:
    """Live bytes at every step of one order of the main graph."""

    order_kind: str  # "DEFAULT" | "PRIORITY_BASED" | "custom"
    order: list[int]
    steps: list[Step]
    peak_bytes: int
    peak_position: int
    tensors: list[Tensor]
    unknown: list[dict[str, Any]] = field(default_factory=list)

    @property
    def peak_node(self) -> str:
        return self.steps[self.peak_position].node if self.steps else ""

    def alive_at(self, p: int) -> list[Tensor]:
        return [t for t in self.tensors if t.alive_at(p)]

    def across(self, p: int) -> list[Tensor]:
        return [t for t in self.tensors if t.across(p)]

    @property
    def alive_at_peak(self) -> list[Tensor]:
        return self.alive_at(self.peak_position) if self.steps else []

    @property
    def across_peak(self) -> list[Tensor]:
        """Buffers alive at the peak that the peak node neither reads nor writes, largest first."""
        return sorted(self.across(self.peak_position), key=lambda t: -t.nbytes) if self.steps else []

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------- analysis
def analyze(ctx: Context, order: OrderLike | None = None) -> Liveness:
    """Liveness of ``ctx``'s main graph over ``order``: ``"DEFAULT"``, ``"PRIORITY_BASED"`` (ORT's
    orders, replayed), a list of node indices (a topological order, e.g. a planned one), or None for
    the order the context's session options select."""
    g = ctx.root
    kind = ctx.execution_order if order is None else order
    unknown: dict = {}
    ga = ctx.activation(kind, unknown)
    label = kind if isinstance(kind, str) else "custom"
    pos = {i: p for p, i in enumerate(ga.order)}
    steps = [Step(r.position, r.node.label, r.node.op_type, r.node.index, r.live_bytes, r.workspace_bytes)
             for r in ga.rows]
    readers: dict[str, list[int]] = {}
    for i in ga.order:
        n = g.nodes[i]
        for v in {*n.inputs, *n.implicit_inputs}:
            if v:
                readers.setdefault(v, []).append(pos[i])
    tensors: list[Tensor] = []
    for b in ga.buffers:
        prod = g.nodes[ga.order[b.start]]
        cons = sorted({p for v in b.values for p in readers.get(v, ())})
        tensors.append(Tensor(b.root, list(b.values), b.nbytes, b.start, b.end, prod.label, prod.op_type, cons,
                              ctx.dims_of(b.root)))
    peak_pos = max(range(len(steps)), key=lambda p: (steps[p].live_bytes, -p)) if steps else 0
    return Liveness(label, list(ga.order), steps, ga.peak_bytes, peak_pos, tensors,
                    [asdict(u) for u in unknown.values()])


def liveness(model: ModelLike, dims: Mapping[str, int] | None = None, order: OrderLike | None = None, *,
             session_options=None) -> Liveness:
    """Liveness of ``model`` (path, ModelProto or :class:`ortmem.Model`; no weight byte is read) over
    ORT's ``order`` (default: the one ``session_options`` select, ORT's ``DEFAULT`` otherwise)."""
    return analyze(context(model, dims, session_options=session_options), order)


def by_order(ctx: Context) -> dict[str, Liveness]:
    """Liveness over both of ORT's execution orders."""
    return {k: analyze(ctx, k) for k in ("DEFAULT", "PRIORITY_BASED")}


def render(lv: Liveness, *, top: int = 10) -> str:
    """The peak and what is alive across it, for people."""
    m = lambda b: f"{b / MiB:,.2f} MiB"  # noqa: E731
    lines = [f"order {lv.order_kind}: {len(lv.steps)} steps, peak {m(lv.peak_bytes)} at step {lv.peak_position} "
             f"({lv.peak_node})"]
    across = lv.across_peak
    if across:
        lines.append(f"alive across the peak ({m(sum(t.nbytes for t in across))} in {len(across)} buffers):")
        for t in across[:top]:
            lines.append(f"  {t.name[:48]:48} {t.op:14} {m(t.nbytes):>12}  steps {t.start}..{t.end}  dims {t.dims}")
    if lv.unknown:
        lines.append(f"{len(lv.unknown)} tensors of unknown size counted as 0 (pass --dim NAME=VALUE)")
    return "\n".join(lines)
