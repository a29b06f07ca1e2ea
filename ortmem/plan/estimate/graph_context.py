"""What the planners know about one model before any order is evaluated: its ORT graph view and shapes.

Why a module of its own: the estimator (:mod:`ortmem.plan.estimate`) and liveness
(:mod:`ortmem.plan.estimate.liveness`) both need the :class:`Context` (shapes, ORT's view of the main graph, what
ORT removes, kernel workspace); liveness also needs the estimator's plan to fill it. Keeping the context
here lets the estimator depend on it without depending on liveness, so the two form no import cycle.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

import onnx

from ortmem.onnxfile.model import Model
from ortmem.plan.estimate import activations as act
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og

ModelLike = Union[str, os.PathLike, onnx.ModelProto, Model]


# ------------------------------------------------------------------------------------- context
@dataclass
class Context:
    """What liveness needs about one model, computed once and shared by every order evaluated on it.

    ``origin`` maps ``id()`` of a node of a *rewritten* graph to the node of the analysed graph it
    copies (see :meth:`derive`), so a rewrite is scored without re-running shape inference or the
    estimator's recipe: a clone has its original's shapes, workspace and constant-ness.
    """

    model: onnx.ModelProto
    root: og.OrtGraph
    shapes: shp.Shapes
    removed: frozenset[int]
    workspace: act.WorkspaceFn
    dims: dict[str, int]
    execution_order: og.ExecutionOrder = "DEFAULT"
    ort_view: dict[str, shp.TensorShape] = field(default_factory=dict)  # shapes as ORT's planner sees them
    _symbolic: shp.Shapes | None = None

    def inplace_slots(self, node: og.OrtNode) -> list[int]:
        """Input slots ``node`` may overwrite, as ORT 1.31.1's CPU planner decides: the kernel declares
        ``MayInplace(0, 0)`` (:data:`ortmem.plan.estimate.activations.ORT_CPU_INPLACE_OPS`) and input 0's shape,
        as ORT infers it with symbolic dims unbound, is fully known (``SameShape`` in
        ``onnxruntime/core/framework/allocation_planner.cc`` accepts equal values or equal non-empty
        dim_params; an unnamed unknown dim never matches)."""
        if node.domain not in ("", "ai.onnx") or node.op_type not in act.ORT_CPU_INPLACE_OPS or not node.inputs:
            return []
        s = self.ort_view.get(node.inputs[0])
        if s is None or s.dims is None or any(d == "?" for d in s.dims):
            return []
        return [0]

    def activation(self, order: Sequence[int] | og.ExecutionOrder | None = None,
                   unknown: dict | None = None) -> act.GraphActivation:
        """:func:`ortmem.plan.estimate.activations.graph_activation` of the main graph with this context's rules."""
        if order is None or isinstance(order, str):
            kind: og.ExecutionOrder = order or self.execution_order  # type: ignore[assignment]
            return act.graph_activation(self.root, self.shapes, kind, self.workspace, unknown, self.removed,
                                        inplace=self.inplace_slots)
        return act.graph_activation(self.root, self.shapes, self.execution_order, self.workspace, unknown,
                                    self.removed, order=list(order), inplace=self.inplace_slots)

    def symbolic_dims(self, name: str) -> list[int | str] | None:
        """The dims of ``name`` before ``dims`` were bound (computed once, on first use)."""
        if self._symbolic is None:
            self._symbolic = shp.infer_shapes(self.model, self.root, {})
        s = self._symbolic.get(self.root, name)
        return None if s is None or s.dims is None else list(s.dims)

    def dims_of(self, name: str) -> list[int | str] | None:
        s = self.shapes.get(self.root, name)
        return None if s is None or s.dims is None else list(s.dims)

    def nbytes(self, name: str) -> int:
        return act.value_bytes(self.root, name, self.shapes, {})

    def derive(self, model: onnx.ModelProto, origins: Sequence[og.OrtNode], renamed: Mapping[str, str]) -> "Context":
        """The context of a rewrite of this model: ``origins[i]`` is the analysed node that the i-th
        non-Constant node of ``model``'s graph copies; ``renamed`` maps each new value name to the
        value it recomputes (same shape). Initializers and graph inputs must be unchanged."""
        root = og.build(model.graph)
        if len(root.nodes) != len(origins):
            raise ValueError("origins must align with the rewritten graph's nodes")
        table = dict(self.shapes.types.get("", {}))
        for new, old in renamed.items():
            if old in table:
                table[new] = table[old]
        shapes = shp.Shapes(types={**self.shapes.types, "": table}, unresolved_symbols=self.shapes.unresolved_symbols)
        origin = {id(n): o for n, o in zip(root.nodes, origins)}
        removed = frozenset(id(n) for n, o in zip(root.nodes, origins) if id(o) in self.removed)
        base_ws = self.workspace

        def workspace(node: og.OrtNode, sh: shp.Shapes) -> int:
            return base_ws(origin.get(id(node), node), sh)

        view = dict(self.ort_view)
        for new, old in renamed.items():
            if old in view:
                view[new] = view[old]
        ctx = Context(model, root, shapes, removed, workspace, self.dims, self.execution_order, view)
        ctx._symbolic = self._symbolic
        return ctx


def load_proto(model: ModelLike) -> onnx.ModelProto:
    """A ModelProto for analysis: weights are never needed, so a path is read without external data
    and a :class:`ortmem.Model` gives its weightless skeleton."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, Model):
        return model.skeleton
    return onnx.load(os.fspath(model), load_external_data=False)


def ort_view(proto: onnx.ModelProto) -> dict[str, shp.TensorShape]:
    """Main-graph shapes from ONNX's own inference with symbolic dims unbound and no data propagation:
    what ORT's graph resolution infers, which decides in-place reuse."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - keep what the graph declares
        inferred = proto
    g = inferred.graph
    out: dict[str, shp.TensorShape] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = shp.shape_of(vi.type)
        if t is not None:
            # onnx's Python API names unknown dims "unk__N"; ORT's resolution leaves them unnamed
            if t.dims is not None:
                t.dims = ["?" if isinstance(d, str) and d.startswith("unk__") else d for d in t.dims]
            out[vi.name] = t
    return out
