"""A model under analysis: its nodes relative to the original file, its liveness, the order ORT is told to use.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import NodeProto

from ortmem.ort import graph_index as og
from ortmem.plan.estimate.liveness import Context, Liveness, analyze


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


def graph_with(ctx: Context, nodes: list[NodeProto]) -> onnx.ModelProto:
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


