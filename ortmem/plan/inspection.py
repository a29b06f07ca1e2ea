"""``ortmem inspect``: what a user wants to know about a model before paying to load it.

Everything here comes from the skeleton and the weight metadata: no weight byte is read, so
inspecting a 10 GB model costs what inspecting its graph costs.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx

from ortmem.base.dtypes import byte_size, dtype_info
from ortmem.onnxfile.model import Model
from ortmem.onnxfile.walk import is_external, iter_graphs, iter_tensor_sites
from ortmem.plan.estimate import Estimate, estimate
from ortmem.base.units import MiB


@dataclass
class DtypeRow:
    dtype: str
    count: int = 0
    bytes: int = 0
    embedded_bytes: int = 0
    external_bytes: int = 0
    inline_bytes: int = 0  # small tensors kept inside the graph


@dataclass
class Inspection:
    path: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    ops: dict[str, int]
    initializers: list[DtypeRow]
    patterns: list[dict[str, Any]] = field(default_factory=list)
    estimate: Estimate | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d["estimate"] = self.estimate.to_dict() if self.estimate is not None else None
        return json.dumps(d, indent=2, default=str)


def _value_infos(values) -> list[dict[str, Any]]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]
        out.append({"name": v.name, "dtype": dtype_info(t.elem_type).name if t.elem_type else "?", "shape": dims})
    return out


def inspect_model(model: Model, dims: dict[str, int] | None = None) -> Inspection:
    skel = model.skeleton
    init_names = {t.name for t in skel.graph.initializer}
    inputs = [v for v in skel.graph.input if v.name not in init_names]
    ops: Counter[str] = Counter()
    for _, g in iter_graphs(skel.graph):
        for n in g.node:
            ops[f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type] += 1

    rows: dict[str, DtypeRow] = {}
    mapped = {(w.graph, w.kind, w.name): w for w in model.weights}
    for site in iter_tensor_sites(skel):
        t = site.tensor
        if t.data_type == onnx.TensorProto.STRING:
            name, nbytes = "string", sum(len(s) for s in t.string_data)
        else:
            name = dtype_info(t.data_type, tensor=t.name, file=str(model.path)).name
            nbytes = byte_size(t.data_type, tuple(t.dims))
        row = rows.setdefault(name, DtypeRow(name))
        row.count += 1
        row.bytes += nbytes
        w = mapped.get(site.key)
        if w is not None and w.embedded:
            row.embedded_bytes += nbytes
        elif is_external(t):
            row.external_bytes += nbytes
        else:
            row.inline_bytes += nbytes

    return Inspection(
        path=str(model.path),
        inputs=_value_infos(inputs),
        outputs=_value_infos(skel.graph.output),
        ops=dict(ops.most_common()),
        initializers=sorted(rows.values(), key=lambda r: -r.bytes),
        patterns=_patterns(skel),
        estimate=estimate(model, dims=dims),
    )


def _patterns(skel: onnx.ModelProto) -> list[dict[str, Any]]:
    """DQ+MatMul / DQ+Gather patterns and whether each is convertible (the matcher decides)."""
    try:
        from ortmem.passes.rules import dq_matmul_match
    except ImportError:  # pragma: no cover - the matcher ships with the package
        return []
    out = []
    result = dq_matmul_match.dq_matmul_match(skel)
    for c in result.candidates:
        out.append({"node": c.node_name, "convertible": True, "detail": c.describe()})
    for r in result.rejected:
        out.append({"node": r.node_name, "convertible": False, "detail": r.reason})
    return out


def render(ins: Inspection) -> str:
    lines = [f"model: {ins.path}", "inputs:"]
    lines += [f"  {v['name']}: {v['dtype']}{v['shape']}" for v in ins.inputs]
    lines.append("outputs:")
    lines += [f"  {v['name']}: {v['dtype']}{v['shape']}" for v in ins.outputs]
    lines.append("ops: " + ", ".join(f"{k} x{v}" for k, v in ins.ops.items()))
    lines.append("initializers:")
    lines.append(f"  {'dtype':<12}{'count':>7}{'MiB':>10}{'embedded':>10}{'external':>10}{'inline':>9}")
    for r in ins.initializers:
        lines.append(
            f"  {r.dtype:<12}{r.count:>7}{r.bytes / MiB:>10.1f}{r.embedded_bytes / MiB:>10.1f}"
            f"{r.external_bytes / MiB:>10.1f}{r.inline_bytes / MiB:>9.2f}"
        )
    conv = [p for p in ins.patterns if p["convertible"]]
    lines.append(f"quantized patterns: {len(conv)} convertible, {len(ins.patterns) - len(conv)} left as they are")
    for p in ins.patterns:
        lines.append(f"  {'ok ' if p['convertible'] else 'no '} {p['node']}: {p['detail']}")
    if ins.estimate is not None:
        e = ins.estimate
        lines.append(
            f"expected session-creation peak (estimate, process included): ORT {e.ort.session_peak_bytes / MiB:.0f} MiB, "
            f"ortmem {e.ortmem.session_peak_bytes / MiB:.0f} MiB (first start), "
            f"{e.ortmem_prepacked.session_peak_bytes / MiB:.0f} MiB (warm, pre-packed); "
            f"steady ORT {e.ort.steady_bytes / MiB:.0f} MiB, ortmem {e.ortmem.steady_bytes / MiB:.0f} MiB "
            f"(details: ortmem estimate)"
        )
    return "\n".join(lines)
