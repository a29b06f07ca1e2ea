"""What an estimate says: per side (ORT, ortmem cold, ortmem warm) the peaks and steady bytes, per node the activation table, and its rendering.

Part of :mod:`ortmem.plan.estimate` (see ``estimator`` for the method)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ortmem.base.units import MiB


# --------------------------------------------------------------------------------------- results
@dataclass
class Side:
    """One way of creating the session (plain ORT, or through ortmem's hook). Bytes, absolute RSS."""

    session_peak_bytes: int
    steady_bytes: int
    session_peak_bytes_with_hygiene: int
    steady_bytes_with_hygiene: int
    session_peak_bytes_without_hygiene: int
    steady_bytes_without_hygiene: int
    after_create_bytes_without_hygiene: int
    after_create_bytes_with_hygiene: int
    in_use: dict[str, int] = field(default_factory=dict)  # steady memory in use by kind, above baseline
    peak_at: str = ""  # what was being done when resident memory peaked (without hygiene)


@dataclass
class NodeRow:
    """One node of the per-node table, in execution order (subgraph nodes after their parent)."""

    position: int
    graph: str
    node: str
    op: str
    unique_name: str
    weights_bytes: int  # initializers first used here (shared ones charged once; outer scope included)
    weights: list[str]
    inputs_bytes: int
    outputs_bytes: int
    workspace_bytes: int
    live_bytes: int  # activations alive at this node in its own graph, workspace included
    subgraph_weights_bytes: int = 0
    unknown: list[str] = field(default_factory=list)


@dataclass
class Estimate:
    model: str
    settings: dict[str, Any]
    ort: Side
    ortmem: Side  # the hook on a cold start, or a warm start without pre-packed weights (the twin)
    ortmem_prepacked: Side  # a warm start loading the entry's pre-packed weights (the default)
    ortmem_cold: Side  # the first start, which converts into the cache (the ``ortmem`` side elsewhere)
    activation_peak_bytes: int
    activation_peak_bytes_by_order: dict[str, int]
    unknown_shapes: list[dict[str, Any]]
    unresolved_dims: list[str]
    weights: dict[str, int]
    nodes: list[NodeRow]
    baseline_bytes: int
    notes: list[str] = field(default_factory=list)
    #: part of every ortmem side: what a process's first ortmem session imports (once per process,
    #: shared by every later session in it; plain ORT's side does not pay it)
    ortmem_import_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def render(e: Estimate, *, max_nodes: int = 40) -> str:
    """The estimate for people: totals, then the heaviest nodes."""
    m = lambda b: f"{b / MiB:,.1f} MiB"  # noqa: E731
    lines = [f"model: {e.model}",
             f"weights: {m(e.weights['total_bytes'])} ({m(e.weights['embedded_bytes'])} embedded, "
             f"{m(e.weights['external_bytes'])} external)",
             f"process baseline (interpreter, numpy, onnxruntime): {m(e.baseline_bytes)}; ortmem's own imports "
             f"(in its sides, once per process): {m(e.ortmem_import_bytes)}",
             f"{'':22}{'peak':>14}{'steady':>14}{'peak+hyg':>14}{'steady+hyg':>14}"]
    for label, s in (("onnxruntime", e.ort), ("ortmem cold start", e.ortmem_cold), ("ortmem", e.ortmem),
                     ("ortmem pre-packed", e.ortmem_prepacked)):
        lines.append(f"{label:22}{m(s.session_peak_bytes_without_hygiene):>14}{m(s.steady_bytes_without_hygiene):>14}"
                     f"{m(s.session_peak_bytes_with_hygiene):>14}{m(s.steady_bytes_with_hygiene):>14}")
    lines.append(f"activation peak ({e.settings['execution_order']}): {m(e.activation_peak_bytes)}"
                 + "".join(f"; {k}: {m(v)}" for k, v in e.activation_peak_bytes_by_order.items()
                           if k != e.settings["execution_order"]))
    if e.unresolved_dims:
        lines.append(f"unresolved dims (pass --dim NAME=VALUE): {', '.join(e.unresolved_dims)}")
    if e.unknown_shapes:
        lines.append(f"{len(e.unknown_shapes)} tensors of unknown size counted as 0, e.g. "
                     + ", ".join(u["value"] for u in e.unknown_shapes[:5]))
    heavy = sorted(e.nodes, key=lambda r: -(r.weights_bytes + r.live_bytes))[:max_nodes]
    if heavy:
        lines.append(f"{'node':40}{'op':18}{'weights':>12}{'outputs':>12}{'workspace':>12}{'live':>12}")
        for r in sorted(heavy, key=lambda r: r.position):
            name = (r.graph + ":" if r.graph else "") + r.node
            lines.append(f"{name[:39]:40}{r.op[:17]:18}{m(r.weights_bytes):>12}{m(r.outputs_bytes):>12}"
                         f"{m(r.workspace_bytes):>12}{m(r.live_bytes):>12}")
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)
