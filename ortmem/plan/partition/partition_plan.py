"""What :func:`ortmem.plan.partition.partition` returns: the stages, the devices, the tensors crossing
the cuts; ``plan.json`` (save/load) and the report for people.

A plan is read back (``PartitionPlan.load``) and run by :class:`ortmem.plan.partition.run.pipeline_session.PipelineSession`
without re-planning, so these types and their file format stand apart from how a plan is made.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ortmem.errors import PlanError

FORMAT = "ortmem.partition/1"
PLAN_FILE = "plan.json"


@dataclass
class StageInfo:
    """One stage: a contiguous run of nodes on one device, one sub-model, one session.

    Bytes: ``weight_bytes`` (union of the weights its nodes read), ``activation_bytes`` (its
    activation peak without workspace), ``workspace_bytes`` (what the node at the peak adds),
    ``overhead_bytes`` (per-session fixed cost assumed), ``estimated_bytes`` (the estimator's
    prediction of the session's peak above the process baseline, CPU stages with ``verify``).
    """

    index: int
    device: str
    provider: str
    provider_options: dict[str, Any]
    file: str
    nodes: list[str]
    replicated: list[str]
    modules: list[str]
    inputs: list[str]
    outputs: list[str]
    weight_bytes: int = 0
    activation_bytes: int = 0
    workspace_bytes: int = 0
    overhead_bytes: int = 0
    estimated_bytes: int | None = None
    node: str | None = None  # the machine it must run on (``node:<NODE>/...`` devices), None: this one

    @property
    def first_order_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.workspace_bytes + self.overhead_bytes

    @property
    def bytes(self) -> int:
        """What the plan holds this stage to: the estimate where there is one, else the first order."""
        return self.estimated_bytes if self.estimated_bytes is not None else self.first_order_bytes


@dataclass
class Crossing:
    """A tensor made in one stage and read in later ones (each a transfer when devices differ)."""

    name: str
    bytes: int | None  # with the plan's dims; None where a dim stayed symbolic
    elem_type: int
    shape: list[int | str] | None
    from_stage: int
    to_stages: list[int]


@dataclass
class DeviceReport:
    """Per device: budget, what was placed, the stages, and what did not fit and why."""

    name: str
    provider: str
    budget_bytes: int
    planning_budget_bytes: int  # what the planner was given (budget - overhead, - estimator corrections)
    stages: list[int]
    weight_bytes: int
    activation_bytes: int
    workspace_bytes: int
    overhead_bytes: int
    shared_credit_bytes: int  # weights read by two of its stages, counted once
    first_order_bytes: int
    estimated_bytes: int | None
    did_not_fit: list[str] = field(default_factory=list)
    node: str | None = None  # the machine the device is on (``node:<NODE>/...``), None: this one

    @property
    def placed_bytes(self) -> int:
        return self.estimated_bytes if self.estimated_bytes is not None else self.first_order_bytes

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.placed_bytes


@dataclass
class PartitionPlan:
    """The result of :func:`~ortmem.plan.partition.partition`; ``save``/``load`` round-trip it through ``plan.json``."""

    model: str
    inputs: list[str]
    outputs: list[str]
    devices: list[DeviceReport]
    stages: list[StageInfo]
    crossings: list[Crossing]
    device_map: dict[str, str]
    settings: dict[str, Any]
    out_dir: str | None = None
    weights_file: str | None = None
    weights_mode: str | None = None  # "link" | "copy"
    weight_bytes: int = 0  # distinct weight bytes of the model (what the shared file holds)
    ort: dict[str, Any] | None = None  # ORT's own settings for one session (see ort_settings)
    notes: list[str] = field(default_factory=list)
    format: str = FORMAT

    # -- boundaries
    def boundaries(self) -> list[dict[str, Any]]:
        """Per cut between stage k and k+1: the tensors alive across it and their bytes."""
        out = []
        for k in range(len(self.stages) - 1):
            live = [c for c in self.crossings if c.from_stage <= k < max(c.to_stages)]
            out.append({
                "after_stage": k,
                "from_device": self.stages[k].device,
                "to_device": self.stages[k + 1].device,
                "last_node": self.stages[k].nodes[-1] if self.stages[k].nodes else "",
                "first_node": self.stages[k + 1].nodes[0] if self.stages[k + 1].nodes else "",
                "tensors": [c.name for c in live],
                "bytes": sum(c.bytes or 0 for c in live),
            })
        return out

    # -- requests (what PipelineSession and RayPipeline check and route the same way)
    def last_readers(self) -> dict[str, int]:
        """Value -> index of the last stage that reads it (after it the value can go)."""
        out: dict[str, int] = {}
        for k, st in enumerate(self.stages):
            for x in st.inputs:
                out[x] = k
        return out

    def requested_outputs(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[str]:
        """The outputs a request asks for (all when None); ``ValueError`` on an unknown output or a
        missing input that a stage reads."""
        wanted = list(output_names) if output_names else list(self.outputs)
        unknown = [n for n in wanted if n not in self.outputs]
        if unknown:
            raise ValueError(f"unknown output name(s) {unknown}; the model's outputs are {self.outputs}")
        read = self.last_readers()
        missing = [n for n in self.inputs if n not in input_feed and n in read]
        if missing:
            raise ValueError(f"missing input(s) {missing}")
        return wanted

    def links(self) -> list[dict[str, Any]]:
        """Bytes per request sent from one node to another (plan's dims): each crossing tensor once
        per node that reads it, other than the node that made it (a node holding a tensor serves
        all its stages there, as Ray's object store does). Empty when no stage names a node."""
        if all(s.node is None for s in self.stages):
            return []
        acc: dict[tuple[str | None, str | None], list[Any]] = {}
        for c in self.crossings:
            src = self.stages[c.from_stage].node
            for dst in dict.fromkeys(self.stages[t].node for t in c.to_stages):
                if dst != src:
                    row = acc.setdefault((src, dst), [0, []])
                    row[0] += c.bytes or 0
                    row[1].append(c.name)
        return [{"from_node": a, "to_node": b, "bytes": v[0], "tensors": v[1]} for (a, b), v in acc.items()]

    # -- serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["boundaries"] = self.boundaries()
        d["links"] = self.links()
        for dev, rep in zip(d["devices"], self.devices):
            dev["placed_bytes"] = rep.placed_bytes
            dev["free_bytes"] = rep.free_bytes
        for st, info in zip(d["stages"], self.stages):
            st["bytes"] = info.bytes
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, out_dir: str | os.PathLike) -> Path:
        path = Path(out_dir) / PLAN_FILE
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PartitionPlan":
        if d.get("format") != FORMAT:
            raise PlanError(f"not an ortmem partition plan (format {d.get('format')!r}, expected {FORMAT!r})")

        def pick(tp, row):
            return tp(**{k: v for k, v in row.items() if k in tp.__dataclass_fields__})

        return cls(
            model=d["model"], inputs=list(d["inputs"]), outputs=list(d["outputs"]),
            devices=[pick(DeviceReport, r) for r in d["devices"]],
            stages=[pick(StageInfo, r) for r in d["stages"]],
            crossings=[pick(Crossing, r) for r in d["crossings"]],
            device_map=dict(d["device_map"]), settings=dict(d["settings"]), out_dir=d.get("out_dir"),
            weights_file=d.get("weights_file"), weights_mode=d.get("weights_mode"),
            weight_bytes=int(d.get("weight_bytes", 0)), ort=d.get("ort"), notes=list(d.get("notes", [])),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PartitionPlan":
        """From ``plan.json`` or the folder holding it; ``out_dir`` becomes that folder."""
        p = Path(path)
        if p.is_dir():
            p = p / PLAN_FILE
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"cannot read partition plan {str(p)!r}: {e}") from None
        plan = cls.from_dict(d)
        plan.out_dir = str(p.parent.resolve())
        return plan

    # -- for people
    def report(self) -> str:
        return render_report(self)

    def report_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "devices": [{**asdict(r), "placed_bytes": r.placed_bytes, "free_bytes": r.free_bytes}
                        for r in self.devices],
            "stages": [{"index": s.index, "device": s.device, "node": s.node, "provider": s.provider, "file": s.file,
                        "nodes": len(s.nodes), "first_node": s.nodes[0] if s.nodes else "",
                        "last_node": s.nodes[-1] if s.nodes else "", "weight_bytes": s.weight_bytes,
                        "activation_bytes": s.activation_bytes, "workspace_bytes": s.workspace_bytes,
                        "overhead_bytes": s.overhead_bytes, "estimated_bytes": s.estimated_bytes,
                        "bytes": s.bytes} for s in self.stages],
            "boundaries": self.boundaries(),
            "links": self.links(),
            "notes": self.notes,
        }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f}"


def render_report(plan: PartitionPlan) -> str:
    """Per device: budget, bytes placed (weights / activations / workspace), stages, what did not fit."""
    lines = [f"partition of {plan.model}: {len(plan.stages)} stage(s) on {sum(1 for d in plan.devices if d.stages)} "
             f"device(s); MiB"]
    lines.append(f"{'device':14}{'provider':24}{'budget':>11}{'weights':>10}{'activ.':>9}{'workspace':>10}"
                 f"{'overhead':>9}{'placed':>10}{'free':>10}  stages")
    for d in plan.devices:
        est = "" if d.estimated_bytes is None else " (estimated)"
        lines.append(f"{d.name[:13]:14}{d.provider[:23]:24}{_mib(d.budget_bytes):>11}{_mib(d.weight_bytes):>10}"
                     f"{_mib(d.activation_bytes):>9}{_mib(d.workspace_bytes):>10}{_mib(d.overhead_bytes):>9}"
                     f"{_mib(d.placed_bytes):>10}{_mib(d.free_bytes):>10}  {d.stages}{est}")
    lines.append("")
    lines.append("stages:")
    for s in plan.stages:
        first = s.nodes[0] if s.nodes else ""
        last = s.nodes[-1] if s.nodes else ""
        lines.append(f"  {s.index}: {s.device} ({s.provider}) {len(s.nodes)} nodes, {first} .. {last}; "
                     f"weights {_mib(s.weight_bytes)}, activations {_mib(s.activation_bytes)}, workspace "
                     f"{_mib(s.workspace_bytes)}, estimated {_mib(s.estimated_bytes)}; file {s.file or '-'}")
    for b in plan.boundaries():
        lines.append(f"  cut after stage {b['after_stage']} ({b['from_device']} -> {b['to_device']}, after "
                     f"{b['last_node']}): {len(b['tensors'])} tensor(s), {_mib(b['bytes'])} MiB: "
                     f"{', '.join(b['tensors'][:6])}{' ...' if len(b['tensors']) > 6 else ''}")
    for link in plan.links():
        lines.append(f"  network {link['from_node'] or 'this machine'} -> {link['to_node'] or 'this machine'}: "
                     f"{_mib(link['bytes'])} MiB per request ({len(link['tensors'])} tensor(s))")
    misses = [(d.name, m) for d in plan.devices for m in d.did_not_fit]
    if misses:
        lines.append("")
        lines.append("what did not fit, and why:")
        lines.extend(f"  {name}: {m}" for name, m in misses)
    if plan.ort:
        lines.append("")
        lines.append("ORT's own settings for one session (untested on a GPU):")
        for k, v in {**plan.ort["session_config"], **plan.ort["alternative_session_config"]}.items():
            lines.append(f"  {k} = {v!r}")
    if plan.notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)
