"""Split an ONNX model into contiguous stages that fit per-device memory budgets, and write them.

``partition(model, {"cuda:0": 6 << 30, "cpu": 32 << 30})`` answers "which part of the graph runs on
which device", writes one sub-model per stage (all reading ONE shared weights file), and returns a
:class:`PartitionPlan` that :class:`ortmem.pipeline.PipelineSession` runs. docs/partition.md has the
measurements behind the constants below.

How a plan is made
------------------
1. **Node costs.** Activations (bytes a node's outputs take) and workspace come from
   :func:`ortmem.plan.estimate.estimate` (shape inference with ``dims``), or, for the nodes it names,
   from a measured stats CSV (``total_dynamic_sizes``, ``total_temp_allocations``). Weights are
   charged to *every* node that reads them (bytes from tensor metadata; no weight byte is read).
2. **Constant chains are not planned.** Nodes computable from initializers alone (a DequantizeLinear
   on a weight, Constant, Shape of a constant) are copied into every stage that reads them, their
   weights charged to the reader: cutting a DequantizeLinear from its MatMul would ship a dequantized
   fp32 matrix across the cut and stop ORT fusing the pair.
3. **Modules.** :func:`ortmem.plan.graph_modules.group_modules` groups the other nodes by name scope
   (``/model/layers.3/...``, or dotted names without slashes) or one by one, each module contiguous in
   execution order (an interrupted scope is split into runs, ``model~2``).
4. **Candidates.** :func:`ortmem.plan.device_map.plan_placement` places the modules' weights with a
   bounded number of device changes (``devices - 1``, exact; a few more, heuristic: each change is
   another stage, session and set of crossing tensors), and :func:`_fill` fills the devices in
   preference order with one contiguous run each. Stages are maximal runs of nodes on one device.
5. **Fewer crossing tensors.** :func:`_improve_cuts` moves each cut, in whole modules, to the nearby
   boundary with the fewest tensors alive across the cuts (or hands a stage to its neighbour) while
   both devices stay in budget and the earlier one gives up at most ``cut_slack`` of its budget; a
   cut inside a module is never made, so a pattern ORT fuses stays in one session.
6. **Choice.** Of the candidates whose stages fit (exact first-order costs: weights once per stage,
   a weight shared by two stages of one device credited back once, the stage's activation peak with
   crossing tensors on both sides, workspace, per-session overhead), the one with the most weight
   bytes on the earlier devices; one with fewer stages when within ``cut_slack`` of it everywhere.
7. **Verification** (CPU devices, ``verify=True``). Each stage's sub-model goes through the estimator,
   with what it misses about runs added (:func:`_estimate_stage`); devices over budget get a smaller
   planning budget, devices with room a larger one, and the plan is made again (up to
   :data:`MAX_ROUNDS`; the best plan that fits is kept).

What is written (``out_dir``)
-----------------------------
``weights.bin`` (a hard link to the source's external data file when every weight already lives in
one such file: no byte copied; otherwise every weight written once, page-aligned), ``stage<k>_<device>.onnx``
per stage (initializers referencing ``weights.bin``; graph inputs and outputs typed; subgraphs kept
whole with their node), ``plan.json`` and ``report.txt`` / ``report.json``. For a single CUDA device
beside CPU devices, also ``model_annotated.onnx`` and ORT's own settings (see :func:`ort_settings`).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import onnx
from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, helper

from ..dtypes import byte_size
from ..loader import load
from ..model import Model
from ..onnx_walk import external_data_dict, iter_graphs, node_label
from ..weights import WeightStore
from . import activations as act
from . import ort_graph as og
from .device_map import PlanError, Placement, plan_placement
from .graph_modules import (ModuleTree, NodeCost, activation_peak, execution_order, group_modules, leaf_modules,
                            node_inputs)

log = logging.getLogger(__name__)

__all__ = [
    "CUT_WINDOW", "PLAN_FILE", "WEIGHTS_FILE", "Crossing", "DeviceReport", "PartitionPlan", "PlanError",
    "StageInfo", "default_provider", "ort_settings", "partition",
]

FORMAT = "ortmem.partition/1"
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.bin"
ANNOTATED_FILE = "model_annotated.onnx"
LAYER_ANN = "layer_ann"  # ORT's node metadata key for session.layer_assignment_settings
ALIGN = 4096
#: How many module boundaries either side of a cut the post-pass looks at.
CUT_WINDOW = 32
#: Rounds of "plan, verify with the estimator, shrink what was over / grow where room was left".
MAX_ROUNDS = 6
#: Ops whose output differs from run to run: never treated as constants (never replicated).
_RANDOM_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


# ------------------------------------------------------------------------------------------- devices
def default_provider(device: str) -> tuple[str, dict[str, Any], bool]:
    """(execution provider, provider options, known) for a device name.

    ``cpu``/``cpu:N``/``disk`` run on the CPU EP; ``cuda``, ``cuda:N``, ``gpu:N`` and bare integers
    (accelerate's GPU names, ``"0"``) on the CUDA EP with that ``device_id``; ``dml:N`` on DirectML.
    Anything else is unknown: CPU, and ``known`` is False so the caller can warn.
    """
    name = str(device).strip()
    low = name.lower()
    kind, _, idx = low.partition(":")
    if low.isdigit():
        return "CUDAExecutionProvider", {"device_id": int(low)}, True
    if kind in ("cpu", "disk"):
        return "CPUExecutionProvider", {}, True
    if kind in ("cuda", "gpu") and (not idx or idx.isdigit()):
        return "CUDAExecutionProvider", {"device_id": int(idx or 0)}, True
    if kind == "dml" and (not idx or idx.isdigit()):
        return "DmlExecutionProvider", {"device_id": int(idx or 0)}, True
    return "CPUExecutionProvider", {}, False


def resolve_provider(device: str, providers_per_device: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The provider a device's stages run with: ``providers_per_device[device]`` (a provider name or a
    ``(name, options)`` pair) when given, else :func:`default_provider` (warning on unknown names)."""
    given = (providers_per_device or {}).get(device)
    if given is not None:
        if isinstance(given, str):
            return given, {}
        name, opts = given
        return str(name), dict(opts or {})
    name, opts, known = default_provider(device)
    if not known:
        warnings.warn(f"device {device!r} is not a known device name; its stages run on the CPU "
                      "(say otherwise with providers_per_device)", stacklevel=3)
    return name, opts


def is_cpu(provider: str) -> bool:
    return provider == "CPUExecutionProvider"


# ------------------------------------------------------------------------------------------- results
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

    @property
    def placed_bytes(self) -> int:
        return self.estimated_bytes if self.estimated_bytes is not None else self.first_order_bytes

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.placed_bytes


@dataclass
class PartitionPlan:
    """The result of :func:`partition`; ``save``/``load`` round-trip it through ``plan.json``."""

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

    # -- serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["boundaries"] = self.boundaries()
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
            "stages": [{"index": s.index, "device": s.device, "provider": s.provider, "file": s.file,
                        "nodes": len(s.nodes), "first_node": s.nodes[0] if s.nodes else "",
                        "last_node": s.nodes[-1] if s.nodes else "", "weight_bytes": s.weight_bytes,
                        "activation_bytes": s.activation_bytes, "workspace_bytes": s.workspace_bytes,
                        "overhead_bytes": s.overhead_bytes, "estimated_bytes": s.estimated_bytes,
                        "bytes": s.bytes} for s in self.stages],
            "boundaries": self.boundaries(),
            "notes": self.notes,
        }


# ------------------------------------------------------------------------------------------- graph
def _tensor_nbytes(t: TensorProto) -> int:
    if t.data_location == TensorProto.EXTERNAL:
        info = external_data_dict(t)
        if "length" in info:
            return int(info["length"])
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    try:
        return byte_size(t.data_type, tuple(int(d) for d in t.dims))
    except Exception:  # unknown dtype: what the proto holds
        return len(t.raw_data)


def _subgraphs(node: onnx.NodeProto) -> list[tuple[str, GraphProto]]:
    out = []
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            out.append((attr.name, attr.g))
        elif attr.type == AttributeProto.GRAPHS:
            out.extend((f"{attr.name}[{j}]", g) for j, g in enumerate(attr.graphs))
    return out


def _attribute_tensor_bytes(node: onnx.NodeProto) -> int:
    total = 0
    for attr in node.attribute:
        if attr.type == AttributeProto.TENSOR:
            total += _tensor_nbytes(attr.t)
        elif attr.type == AttributeProto.TENSORS:
            total += sum(_tensor_nbytes(t) for t in attr.tensors)
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            total += _tensor_nbytes(attr.sparse_tensor.values) + _tensor_nbytes(attr.sparse_tensor.indices)
    return total


def _module_names(labels: Sequence[str], by: str) -> dict[str, str]:
    """Each node's leaf module (labels in execution order), every module contiguous.

    ``by="scope"`` uses name scopes (``/model/layers.3/...``); for exporters that write dotted names
    without slashes (``model.layers.3.mlp.gate_proj.matmul``) the dots before the last component are
    the scope. The planner reads modules in tree order as if that were execution order, so a scope
    whose nodes another scope's interrupt (a mask computed between the embedding and the first layer,
    both under ``model``) is split into runs, the later ones renamed ``model~2``...
    """
    if by not in ("scope", "node"):
        raise PlanError(f"by must be 'scope' or 'node', got {by!r}")
    if by == "scope" and not any("/" in label for label in labels):
        named = []
        for label in labels:
            scope, dot, op = label.rpartition(".")
            named.append(f"/{scope}/{op}" if dot and scope else label)
        leaves = leaf_modules(named, "scope")
    else:
        leaves = leaf_modules(labels, by)
    return dict(zip(labels, _contiguous(leaves)))


def _contiguous(leaves: Sequence[str]) -> list[str]:
    """Rename module runs so that every module (every prefix) covers one contiguous run of leaves."""
    alias: dict[str, str] = {"": ""}
    used: set[str] = {""}
    open_path: list[str] = []
    out = []
    for leaf in leaves:
        parts = leaf.split(".") if leaf else []
        prefixes = [".".join(parts[:i + 1]) for i in range(len(parts))]
        d = 0
        while d < len(open_path) and d < len(prefixes) and open_path[d] == prefixes[d]:
            d += 1
        del open_path[d:]
        for i in range(d, len(prefixes)):
            parent = alias[prefixes[i - 1]] if i else ""
            base = f"{parent}.{parts[i]}" if parent else parts[i]
            name, k = base, 1
            while name in used:
                k += 1
                name = f"{base}~{k}"
            used.add(name)
            alias[prefixes[i]] = name
            open_path.append(prefixes[i])
        out.append(alias[prefixes[-1]] if prefixes else leaf)
    return out


class _Graph:
    """The main graph as the partitioner sees it: planned nodes in execution order (constant chains
    left out), the values between them, and every node's costs."""

    def __init__(self, model: Model):
        g = model.skeleton.graph
        self.model = model
        self.g = g
        self.labels_all = [node_label(n, i) for i, n in enumerate(g.node)]
        seen: set[str] = set()
        for label in self.labels_all:
            if label in seen:
                raise PlanError(f"two nodes are named {label!r}: stages and costs are matched by node name")
            seen.add(label)
        self.index_of = {label: i for i, label in enumerate(self.labels_all)}
        self.init = {t.name: t for t in g.initializer}
        self.sparse = {s.values.name: s for s in g.sparse_initializer}
        self.input_vi = {vi.name: vi for vi in g.input}
        self.inputs = [vi.name for vi in g.input if vi.name not in self.init and vi.name not in self.sparse]
        self.outputs = [o.name for o in g.output]
        self.output_vi = {o.name: o for o in g.output}
        self.value_info = {vi.name: vi for vi in g.value_info}
        self.raw_inputs = node_inputs(g)
        self.producer: dict[str, int] = {}
        for i, node in enumerate(g.node):
            for o in node.output:
                if o:
                    self.producer[o] = i
        self.const_nodes = self._constant_nodes()
        self._const_weights: dict[int, dict[str, int]] = {}

        planned = GraphProto()  # named by label: an unnamed node's "op#index" must survive the filtering
        for i, node in enumerate(g.node):
            if i not in self.const_nodes:
                copy = planned.node.add()
                copy.CopyFrom(node)
                copy.name = self.labels_all[i]
        planned.output.extend(g.output)
        self.planned_graph = planned
        # positions in execution order (the same order group_modules uses)
        sub_order = execution_order(planned)
        kept = [i for i in range(len(g.node)) if i not in self.const_nodes]
        self.order = [kept[j] for j in sub_order]
        self.labels = [self.labels_all[i] for i in self.order]
        self.pos = {i: p for p, i in enumerate(self.order)}
        n = len(self.order)
        self.inputs_pos: list[list[int]] = []
        self.consumers_pos: list[list[int]] = [[] for _ in range(n)]
        for p, i in enumerate(self.order):
            prods = sorted({self.pos[self.producer[x]] for x in self.raw_inputs[i]
                            if x in self.producer and self.producer[x] in self.pos and self.pos[self.producer[x]] != p})
            self.inputs_pos.append(prods)
            for q in prods:
                self.consumers_pos[q].append(p)
        outs = set(self.outputs)
        self.escapes = [any(o in outs for o in g.node[i].output) for i in self.order]
        self.weights = [self._node_weights(i) for i in self.order]
        # value -> positions of the planned nodes reading it
        self.readers: dict[str, list[int]] = {}
        for p, i in enumerate(self.order):
            for x in dict.fromkeys(self.raw_inputs[i]):
                self.readers.setdefault(x, []).append(p)
        self.act = [0] * n
        self.ws = [0] * n

    # constant chains ------------------------------------------------------------------------
    def _constant_nodes(self) -> set[int]:
        g = self.g
        const_vals = (set(self.init) | set(self.sparse)) - set(self.input_vi)  # overridable ones are inputs
        out: set[int] = set()
        for i in execution_order(g):
            node = g.node[i]
            if node.op_type in _RANDOM_OPS or _subgraphs(node):
                continue
            if all(x in const_vals for x in self.raw_inputs[i]):
                out.add(i)
                const_vals.update(o for o in node.output if o)
        # a constant chain that is itself a graph output is planned like any node (it must run somewhere)
        outs = set(o.name for o in g.output)
        return {i for i in out if not any(o in outs for o in g.node[i].output)}

    def const_closure(self, values: Iterable[str]) -> list[int]:
        """Constant nodes (node indices, file order) that produce ``values``, transitively."""
        need: set[int] = set()
        stack = [v for v in values]
        while stack:
            v = stack.pop()
            i = self.producer.get(v)
            if i is None or i not in self.const_nodes or i in need:
                continue
            need.add(i)
            stack.extend(self.raw_inputs[i])
        return sorted(need)

    # weights ------------------------------------------------------------------------------
    def _value_weights(self, x: str, out: dict[str, int]) -> None:
        t = self.init.get(x)
        if t is not None:
            out[x] = _tensor_nbytes(t)
            return
        s = self.sparse.get(x)
        if s is not None:
            out[x] = _tensor_nbytes(s.values) + _tensor_nbytes(s.indices)
            return
        c = self.producer.get(x)
        if c is not None and c in self.const_nodes:
            out.update(self._const_node_weights(c))

    def _const_node_weights(self, c: int) -> dict[str, int]:
        hit = self._const_weights.get(c)
        if hit is None:
            hit = {}
            for x in self.raw_inputs[c]:
                self._value_weights(x, hit)
            b = _attribute_tensor_bytes(self.g.node[c])
            if b:
                hit[f"{self.labels_all[c]}:attribute"] = b
            self._const_weights[c] = hit
        return hit

    def _node_weights(self, i: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for x in self.raw_inputs[i]:
            self._value_weights(x, out)
        node = self.g.node[i]
        label = self.labels_all[i]
        for attr_name, sg in _subgraphs(node):
            for path, graph in iter_graphs(sg, f"{label}/{attr_name}"):
                for t in graph.initializer:
                    out[f"{path}:{t.name}"] = _tensor_nbytes(t)
                for k, sub in enumerate(graph.node):
                    b = _attribute_tensor_bytes(sub)
                    if b:
                        out[f"{path}:{node_label(sub, k)}:attribute"] = b
        b = _attribute_tensor_bytes(node)
        if b:
            out[f"{label}:attribute"] = b
        return out

    # costs -----------------------------------------------------------------------------------
    def set_costs(self, act_bytes: Mapping[str, int], ws_bytes: Mapping[str, int]) -> list[NodeCost]:
        costs = []
        for p, label in enumerate(self.labels):
            self.act[p] = int(act_bytes.get(label, 0))
            self.ws[p] = int(ws_bytes.get(label, 0))
            costs.append(NodeCost(label, dict(self.weights[p]), self.act[p], self.ws[p]))
        return costs

    def unique_name(self, i: int) -> str:
        node = self.g.node[i]
        return og.unique_node_name(node.name, node.op_type, list(node.input), list(node.output))


# ------------------------------------------------------------------------------------------- costs
def _node_costs(G: _Graph, model: Model, dims: Mapping[str, int], stats_csv: str | os.PathLike | None
                ) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Activation and workspace bytes per planned node label; notes on where they came from."""
    from .estimate import estimate

    notes: list[str] = []
    est = estimate(model, dims=dict(dims))
    rows = {r.unique_name: r for r in est.nodes if r.graph == ""}
    act_b: dict[str, int] = {}
    ws_b: dict[str, int] = {}
    for i, label in zip(G.order, G.labels):
        r = rows.get(G.unique_name(i))
        if r is not None:
            act_b[label] = r.outputs_bytes
            ws_b[label] = r.workspace_bytes
    if est.unresolved_dims:
        notes.append(f"symbolic dims without a value (counted as 0 bytes): {', '.join(est.unresolved_dims)}; "
                     "give them with dims=")
    if stats_csv is not None:
        from .stats import read_csv

        measured = {r.name: r for r in read_csv(stats_csv)}
        hit = 0
        for i, label in zip(G.order, G.labels):
            r = measured.get(G.unique_name(i))
            if r is not None:
                act_b[label] = r.total_dynamic_sizes
                ws_b[label] = r.total_temp_allocations
                hit += 1
        notes.append(f"activations and workspace measured (stats CSV) for {hit} of {len(G.order)} nodes; "
                     "estimated for the rest (nodes ORT fused or renamed have no row)")
    return act_b, ws_b, notes


# ------------------------------------------------------------------------------------------- stages
@dataclass
class _Stage:
    lo: int  # first position (execution order)
    hi: int  # one past the last
    device: int


@dataclass
class _Cost:
    weights: dict[str, int]
    weight_bytes: int
    activation_bytes: int
    workspace_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.workspace_bytes


class _Costs:
    """First-order stage costs, memoised by span (the cut post-pass asks for many spans).

    A device's stages cost their weights, ``act_mult[device]`` times their activation peak (workspace
    included; :data:`ARENA_STEADY` on verified CPU devices, where ORT's arena holds that much in steady
    state) and ``overhead[device]`` each.
    """

    def __init__(self, G: _Graph, overhead: Sequence[int], act_mult: Sequence[float] | None = None):
        self.G = G
        self.overhead = list(overhead)
        self.act_mult = list(act_mult) if act_mult is not None else [1.0] * len(self.overhead)
        self._memo: dict[tuple[int, int], _Cost] = {}
        self._zeros = [0] * len(G.order)

    def span(self, lo: int, hi: int) -> _Cost:
        key = (lo, hi)
        hit = self._memo.get(key)
        if hit is None:
            G = self.G
            w: dict[str, int] = {}
            for p in range(lo, hi):
                w.update(G.weights[p])
            members = list(range(lo, hi))
            with_ws = activation_peak(members, G.inputs_pos, G.consumers_pos, G.escapes, G.act, G.ws)
            without = activation_peak(members, G.inputs_pos, G.consumers_pos, G.escapes, G.act, self._zeros)
            hit = _Cost(w, sum(w.values()), without, max(0, with_ws - without))
            self._memo[key] = hit
        return hit

    def activations(self, stages: Sequence[_Stage], n_devices: int) -> list[int]:
        """First-order activation bytes per device (with ``act_mult``)."""
        out = [0] * n_devices
        for s in stages:
            c = self.span(s.lo, s.hi)
            out[s.device] += int(self.act_mult[s.device] * (c.activation_bytes + c.workspace_bytes))
        return out

    def device_totals(self, stages: Sequence[_Stage], n_devices: int) -> tuple[list[int], list[int]]:
        """(first-order bytes per device, shared-weight credit per device)."""
        totals = [0] * n_devices
        credit = [0] * n_devices
        seen: list[dict[str, int]] = [dict() for _ in range(n_devices)]
        for s in stages:
            c = self.span(s.lo, s.hi)
            totals[s.device] += (c.weight_bytes + int(self.act_mult[s.device] * (c.activation_bytes + c.workspace_bytes))
                                 + self.overhead[s.device])
            for k, b in c.weights.items():
                if k in seen[s.device]:
                    credit[s.device] += b
                else:
                    seen[s.device][k] = b
        return [t - c for t, c in zip(totals, credit)], credit


def _runs(devs: Sequence[int]) -> list[_Stage]:
    out: list[_Stage] = []
    for p, d in enumerate(devs):
        if out and out[-1].device == d:
            out[-1].hi = p + 1
        else:
            out.append(_Stage(p, p + 1, d))
    return out


def _leaf_devices(tree: ModuleTree, placement: Placement) -> dict[str, int]:
    entry = {m: d for m, d in placement.entries}
    out: dict[str, int] = {}
    for leaf in tree.nodes:
        m = leaf
        while m not in entry:
            if not m:
                raise PlanError(f"internal: module {leaf!r} has no device in the placement")
            m = m.rpartition(".")[0]
        out[leaf] = entry[m]
    return out


def _live_across(G: _Graph) -> tuple[list[int], list[int]]:
    """For each cut position c (between positions c-1 and c): how many planned tensors, and how many
    bytes, are made before c and read at or after c."""
    n = len(G.order)
    count = [0] * (n + 2)
    nbytes = [0] * (n + 2)
    for p in range(n):
        if not G.consumers_pos[p]:
            continue
        last = max(G.consumers_pos[p])
        # one entry per node (its outputs together), as the costs are per node
        count[p + 1] += 1
        count[last + 1] -= 1
        nbytes[p + 1] += G.act[p]
        nbytes[last + 1] -= G.act[p]
    for c in range(1, n + 1):
        count[c] += count[c - 1]
        nbytes[c] += nbytes[c - 1]
    return count, nbytes


def _module_boundaries(G: _Graph, tree: ModuleTree) -> list[int]:
    mods = [tree.module_of[label] for label in G.labels]
    return [c for c in range(1, len(mods)) if mods[c] != mods[c - 1]]


def _normalise(stages: Sequence[_Stage]) -> list[_Stage]:
    """Drop empty stages and merge neighbours on one device."""
    out: list[_Stage] = []
    for s in stages:
        if s.hi <= s.lo:
            continue
        if out and out[-1].device == s.device:
            out[-1] = _Stage(out[-1].lo, s.hi, s.device)
        else:
            out.append(_Stage(s.lo, s.hi, s.device))
    return out


def _improve_cuts(stages: list[_Stage], G: _Graph, costs: _Costs, boundaries: list[int], caps: Sequence[int],
                  budgets: Sequence[int], slack: float) -> list[_Stage]:
    """Move each cut to the nearby module boundary that leaves the fewest tensors alive across all
    cuts (then the fewest bytes); moving a cut onto its neighbour removes a stage (see the module
    docstring, step 6)."""
    import bisect

    count, nbytes = _live_across(G)
    n_dev = len(caps)

    def score(st: Sequence[_Stage]) -> tuple[int, int]:
        return sum(count[s.lo] for s in st[1:]), sum(nbytes[s.lo] for s in st[1:])

    stages = _normalise(stages)
    start_totals, _ = costs.device_totals(stages, n_dev)
    k = 0
    while k < len(stages) - 1:
        left, right = stages[k], stages[k + 1]
        a, b, c = left.lo, left.hi, right.hi
        early = min(left.device, right.device)
        j = bisect.bisect_left(boundaries, b)
        cands = [x for x in boundaries[max(0, j - CUT_WINDOW): j + CUT_WINDOW + 1] if a < x < c and x != b]
        cands += [a, c]  # a stage handed whole to its neighbour's device
        best_key = (*score(stages), 0, 0)
        best = stages
        for x in cands:
            trial = _normalise([*stages[:k], _Stage(a, x, left.device), _Stage(x, c, right.device), *stages[k + 2:]])
            new, _ = costs.device_totals(trial, n_dev)
            if new[left.device] > caps[left.device] or new[right.device] > caps[right.device]:
                continue
            lost = max(0, start_totals[early] - new[early])  # against the planner's: slack is not spent twice
            if lost > slack * budgets[early]:
                continue
            key = (*score(trial), lost, abs(x - b))
            if key < best_key:
                best_key, best = key, trial
        if best is not stages:
            stages = best
            k = max(0, k - 1)  # a removed stage changes the previous cut's neighbourhood
            continue
        k += 1
    return stages


#: Device changes ``_choose`` allows beyond one stage per device (each extra one is another session).
EXTRA_SWITCHES = 2


def _choose(tree: ModuleTree, sizes: Mapping[str, int], G: _Graph, costs: _Costs, boundaries: list[int],
            names: Sequence[str], caps: Sequence[int], limits: Sequence[int], budgets: Sequence[int], slack: float
            ) -> tuple[Placement, dict[str, int], list[_Stage]]:
    """The placement to use, its leaf devices and its stages (after the cut post-pass).

    The planner alone would scatter small modules over every device that has a few bytes left (dozens
    of device changes): each change is another stage, another session with its fixed cost, more
    crossing tensors. So the number of changes is bounded: ``devices - 1`` (one stage per device, the
    exact search where it runs), then up to :data:`EXTRA_SWITCHES` more (the heuristic), e.g. an
    embedding too large for the fast devices on the CPU, the layers on the fast devices, the rest back
    on the CPU. Of the plans whose stages fit (first-order costs, per-stage overhead included), the one
    with the most bytes on the earlier devices wins; a plan with fewer changes wins when it keeps,
    device by device, all but ``slack`` of that plan's bytes on the earlier devices. When no plan fits
    (a device's stages need more than the planner's sizes said), the weight budgets of the devices
    that were over shrink by the excess and the plans are made again (a few times).
    """
    caps = list(caps)
    for _ in range(_REPAIRS):
        got = _choose_once(tree, sizes, G, costs, boundaries, names, caps, limits, budgets, slack)
        if got[3] is None:
            return got[0], got[1], got[2]
        over = got[3]
        caps = [max(0, c - o) for c, o in zip(caps, over)]
    got = _choose_once(tree, sizes, G, costs, boundaries, names, caps, limits, budgets, slack)
    return got[0], got[1], got[2]


#: Rounds of "shrink the weight budget of what was over" inside ``_choose``.
_REPAIRS = 3


def _choose_once(tree: ModuleTree, sizes: Mapping[str, int], G: _Graph, costs: _Costs, boundaries: list[int],
                 names: Sequence[str], caps: Sequence[int], limits: Sequence[int], budgets: Sequence[int],
                 slack: float) -> tuple[Placement, dict[str, int], list[_Stage], list[int] | None]:
    """One pass of :func:`_choose`; the last value is None when the plan fits, else the bytes each
    device is over in the plan with the most bytes on the earlier devices.

    Candidates: the planner with ``devices - 1`` .. ``devices - 1 + EXTRA_SWITCHES`` device changes,
    and a contiguous fill (:func:`_fill`: each device but the last takes one run of modules, as
    large as its budget allows, in preference order; what fits none goes to the last device). They
    are compared on the weight bytes their final stages put on the earlier devices.
    """
    n = len(names)
    max_memory = dict(zip(names, caps))

    def finish(stages: list[_Stage]) -> tuple[list[_Stage], bool, list[int], tuple[int, ...]]:
        st = _improve_cuts(stages, G, costs, boundaries, limits, budgets, slack)
        totals, _ = costs.device_totals(st, n)
        over = [max(0, t - lim) for t, lim in zip(totals, limits)]
        w = [0] * n
        for x in st:
            w[x.device] += costs.span(x.lo, x.hi).weight_bytes
        cum, acc = [], 0
        for x in w[:-1]:
            acc += x
            cum.append(acc)
        return st, not any(over), over, tuple(cum)

    def from_placement(p: Placement):
        leaf_dev = _leaf_devices(tree, p)
        devs = [leaf_dev[tree.module_of[label]] for label in G.labels]
        return (p, leaf_dev, *finish(_runs(devs)))

    def attempt(k: int, method: str):
        try:
            p = plan_placement(sizes, max_memory, max_switches=k, method=method)
        except PlanError:
            return None
        return from_placement(p)

    tried = [attempt(n - 1, "auto")] + [attempt(k, "heuristic") for k in range(n, n + EXTRA_SWITCHES)]
    if all(t is None for t in tried):  # the weights alone fit nowhere: the planner's error says what each
        plan_placement(sizes, max_memory)  # device would need (it raises)
    filled = _fill(G, costs, boundaries, limits)
    if filled is not None:
        leaf_dev: dict[str, int] = {}
        for x in filled:
            for q in range(x.lo, x.hi):
                leaf_dev.setdefault(tree.module_of[G.labels[q]], x.device)
        loads = [0] * n
        for m, d in leaf_dev.items():
            loads[d] += sizes[m]
        p = Placement(tuple(leaf_dev.items()), tuple(loads), max(0, len(filled) - 1))
        tried.append((p, leaf_dev, *finish(filled)))
    fitting = [t for t in tried if t is not None and t[3]]
    if not fitting:
        for k in range(n - 2, -1, -1):  # fewer stages, fewer sessions to pay for
            t = attempt(k, "auto")
            if t is not None and t[3]:
                fitting = [t]
                break
    if not fitting:
        last = max((t for t in tried if t is not None), key=lambda t: t[5])
        return last[0], last[1], last[2], last[4]
    best = max(fitting, key=lambda t: t[5])
    want = best[5]
    for t in sorted(fitting, key=lambda t: len(t[2])):
        if all(g >= w - slack * budgets[j] for j, (g, w) in enumerate(zip(t[5], want))):
            return t[0], t[1], t[2], None
    return best[0], best[1], best[2], None


def _fill(G: _Graph, costs: _Costs, boundaries: list[int], limits: Sequence[int]) -> list[_Stage] | None:
    """Contiguous fill in device preference order: each device but the last takes the longest run of
    whole modules from where the previous one stopped that fits its first-order limit; a module no
    remaining device can hold alone goes to the last device, and the last takes the rest."""
    n = len(limits)
    total = len(G.order)
    cuts = [0, *boundaries, total]
    last = n - 1
    out: list[_Stage] = []

    def fits(j: int, lo: int, hi: int) -> bool:
        return costs.device_totals([_Stage(lo, hi, j)], n)[0][j] <= limits[j]

    i, j = 0, 0
    while cuts[i] < total:
        if j >= last:
            out.append(_Stage(cuts[i], total, last))
            break
        lo = cuts[i]
        if not fits(j, lo, cuts[i + 1]):
            if any(fits(k, lo, cuts[i + 1]) for k in range(j + 1, last)):
                j += 1  # a later fast device can hold it: this one is done
            else:
                out.append(_Stage(lo, cuts[i + 1], last))
                i += 1
            continue
        good, step = i + 1, 1  # gallop, then bisect (costs grow with the run, near enough)
        while good + step < len(cuts) and fits(j, lo, cuts[good + step]):
            good += step
            step *= 2
        hi_bad = min(good + step, len(cuts))
        while hi_bad - good > 1:
            mid = (good + hi_bad) // 2
            if fits(j, lo, cuts[mid]):
                good = mid
            else:
                hi_bad = mid
        out.append(_Stage(lo, cuts[good], j))
        i, j = good, j + 1
    return _normalise(out) if out else None


# ------------------------------------------------------------------------------------------- weights
@dataclass
class _Layout:
    """Where each source span lands in the shared weights file."""

    mode: str  # "link" | "copy"
    source: Path | None  # link: the file linked
    spans: dict[tuple[str, int, int], int]  # (resolved source path, offset, length) -> new offset
    size: int  # file size
    weight_bytes: int  # distinct bytes


def _layout(model: Model, mode: str) -> _Layout:
    refs = list(model.store)
    files = {r.file.resolve() for r in refs}
    embedded = any(r.embedded for r in refs)
    if mode not in ("auto", "link", "copy"):
        raise PlanError(f"weights must be 'auto', 'link' or 'copy', got {mode!r}")
    distinct: dict[tuple[str, int, int], int] = {}
    for r in refs:
        distinct.setdefault((str(r.file.resolve()), r.offset, r.length), r.length)
    total = sum(distinct.values())
    can_link = len(files) == 1 and not embedded
    if mode == "link" and not can_link:
        raise PlanError("weights='link' needs every weight in one external data file (this model has "
                        f"{len(files)} file(s){', some embedded' if embedded else ''})")
    if (mode in ("auto", "link")) and can_link:
        src = next(iter(files))
        return _Layout("link", src, {k: k[1] for k in distinct}, src.stat().st_size, total)
    spans: dict[tuple[str, int, int], int] = {}
    pos = 0
    for key in sorted(distinct):
        pos = -(-pos // ALIGN) * ALIGN
        spans[key] = pos
        pos += key[2]
    return _Layout("copy", None, spans, pos, total)


def _write_weights(layout: _Layout, out: Path) -> None:
    """Write (or link) the shared weights file; a copy streams each span once, never holding more
    than a chunk in memory."""
    if out.exists() or out.is_symlink():
        out.unlink()
    if layout.mode == "link":
        assert layout.source is not None
        try:
            os.link(layout.source, out)
            return
        except OSError as e:  # another filesystem: a copy keeps the folder self-contained
            log.warning("cannot hard-link %s (%s); copying it", layout.source, e)
            shutil.copyfile(layout.source, out)
            return
    chunk = 16 << 20
    with open(out, "wb") as dst:
        dst.truncate(layout.size)
        by_file: dict[str, list[tuple[int, int, int]]] = {}
        for (path, off, length), new in layout.spans.items():
            by_file.setdefault(path, []).append((off, length, new))
        for path, spans in by_file.items():
            with open(path, "rb") as src:
                for off, length, new in sorted(spans):
                    done = 0
                    while done < length:
                        n = min(chunk, length - done)
                        copied = 0
                        if hasattr(os, "copy_file_range"):
                            try:
                                copied = os.copy_file_range(src.fileno(), dst.fileno(), n, off + done, new + done)
                            except OSError:
                                copied = 0
                        if copied <= 0:
                            data = os.pread(src.fileno(), n, off + done)
                            if len(data) != n:
                                raise PlanError(f"short read from {path} at {off + done}")
                            os.pwrite(dst.fileno(), data, new + done)
                            copied = n
                        done += copied


def _relocate_tensor(t: TensorProto, base: Path, layout: _Layout, location: str) -> None:
    if t.data_location != TensorProto.EXTERNAL:
        return
    info = external_data_dict(t)
    src = (base / info.get("location", "")).resolve()
    off = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else _tensor_nbytes(t)
    new = layout.spans.get((str(src), off, length))
    if new is None:
        raise PlanError(f"internal: tensor {t.name!r} ({src}, {off}, {length}) is not in the weights layout")
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(new)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v


def _relocate_node(node: onnx.NodeProto, base: Path, layout: _Layout, location: str) -> None:
    for attr in node.attribute:
        if attr.type == AttributeProto.TENSOR:
            _relocate_tensor(attr.t, base, layout, location)
        elif attr.type == AttributeProto.TENSORS:
            for t in attr.tensors:
                _relocate_tensor(t, base, layout, location)
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            _relocate_tensor(attr.sparse_tensor.values, base, layout, location)
            _relocate_tensor(attr.sparse_tensor.indices, base, layout, location)
        elif attr.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
            for g in ([attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)):
                _relocate_graph(g, base, layout, location)


def _relocate_graph(g: GraphProto, base: Path, layout: _Layout, location: str) -> None:
    for t in g.initializer:
        _relocate_tensor(t, base, layout, location)
    for s in g.sparse_initializer:
        _relocate_tensor(s.values, base, layout, location)
        _relocate_tensor(s.indices, base, layout, location)
    for node in g.node:
        _relocate_node(node, base, layout, location)


# ------------------------------------------------------------------------------------------- sub-models
def _value_type(name: str, G: _Graph, shapes: act.Shapes) -> onnx.ValueInfoProto:
    """A typed ValueInfo for a tensor crossing a cut: the graph's own declaration, else inferred
    (symbolic dims kept, so a stage accepts what the whole model accepts)."""
    for table in (G.output_vi, G.input_vi, G.value_info):
        vi = table.get(name)
        if vi is not None and vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            return vi
    t = shapes.types.get("", {}).get(name)
    if t is None or not t.elem_type:
        raise PlanError(f"the type of tensor {name!r}, which crosses a stage boundary, cannot be inferred; "
                        "declare it in the model's value_info")
    dims = None if t.dims is None else [d if isinstance(d, int) else (None if d == "?" else str(d)) for d in t.dims]
    return helper.make_tensor_value_info(name, t.elem_type, dims)


@dataclass
class _StageGraph:
    proto: ModelProto
    inputs: list[str]
    outputs: list[str]
    nodes: list[str]
    replicated: list[str]


def _stage_models(G: _Graph, stages: Sequence[_Stage], shapes_sym: act.Shapes, layout: _Layout | None,
                  location: str) -> list[_StageGraph]:
    """One ModelProto per stage (weights relocated into ``location`` when ``layout`` is given)."""
    g = G.g
    skeleton = G.model.skeleton
    base = G.model.path.parent.resolve()
    stage_of = {}
    for k, s in enumerate(stages):
        for p in range(s.lo, s.hi):
            stage_of[p] = k
    # later readers of each value, by stage
    read_by: dict[str, set[int]] = {}
    for x, ps in G.readers.items():
        read_by[x] = {stage_of[p] for p in ps}
    graph_outputs = set(G.outputs)
    out: list[_StageGraph] = []
    for k, s in enumerate(stages):
        idx = [G.order[p] for p in range(s.lo, s.hi)]
        produced: set[str] = set()
        for i in idx:
            produced.update(o for o in g.node[i].output if o)
        needed: list[str] = []
        for i in idx:
            for x in G.raw_inputs[i]:
                if x not in produced and x not in needed:
                    needed.append(x)
        consts = G.const_closure(needed)
        const_out = {o for c in consts for o in g.node[c].output if o}
        for c in consts:
            for x in G.raw_inputs[c]:
                if x not in produced and x not in const_out and x not in needed:
                    needed.append(x)
        inits, sparse, inputs = [], [], []
        for x in needed:
            if x in const_out:
                continue
            if x in G.init:
                inits.append(x)
                if x in G.input_vi:
                    inputs.append(x)  # an overridable initializer stays overridable
            elif x in G.sparse:
                sparse.append(x)
            else:
                inputs.append(x)
        if k == 0:  # unused graph inputs: the first stage declares them, as the model does
            for x in G.inputs:
                if x not in G.readers and x not in inputs:
                    inputs.append(x)
        outputs = [o for o in G.outputs if o in produced]
        for i in idx:
            for o in g.node[i].output:
                if o and o not in graph_outputs and any(j > k for j in read_by.get(o, ())) and o not in outputs:
                    outputs.append(o)
        graph = GraphProto()
        graph.name = f"{g.name or 'graph'}_stage{k}"
        graph.node.extend(g.node[c] for c in consts)
        graph.node.extend(g.node[i] for i in idx)
        graph.initializer.extend(G.init[x] for x in inits)
        graph.sparse_initializer.extend(G.sparse[x] for x in sparse)
        graph.input.extend(_value_type(x, G, shapes_sym) for x in inputs)
        graph.output.extend(_value_type(o, G, shapes_sym) for o in outputs)
        inside = produced | const_out
        graph.value_info.extend(vi for name, vi in G.value_info.items()
                                if name in inside and name not in outputs)
        m = ModelProto()
        m.ir_version = skeleton.ir_version
        m.opset_import.extend(skeleton.opset_import)
        m.producer_name = skeleton.producer_name
        m.producer_version = skeleton.producer_version
        m.domain = skeleton.domain
        m.model_version = skeleton.model_version
        m.doc_string = skeleton.doc_string
        m.functions.extend(skeleton.functions)
        m.metadata_props.extend(skeleton.metadata_props)
        m.graph.CopyFrom(graph)
        e = m.metadata_props.add()
        e.key, e.value = "ortmem.partition.stage", str(k)
        if layout is not None:
            _relocate_graph(m.graph, base, layout, location)
        out.append(_StageGraph(m, inputs, outputs, [G.labels_all[i] for i in idx],
                               [G.labels_all[c] for c in consts]))
    return out


def _crossings(G: _Graph, stages: Sequence[_Stage], shapes_dims: act.Shapes) -> list[Crossing]:
    stage_of = {}
    for k, s in enumerate(stages):
        for p in range(s.lo, s.hi):
            stage_of[p] = k
    out = []
    for p, i in enumerate(G.order):
        k = stage_of[p]
        for o in G.g.node[i].output:
            if not o:
                continue
            later = sorted({stage_of[q] for q in G.readers.get(o, ()) if stage_of[q] > k})
            if not later:
                continue
            t = shapes_dims.types.get("", {}).get(o)
            out.append(Crossing(o, t.nbytes() if t else None, t.elem_type if t else 0,
                                list(t.dims) if t and t.dims is not None else None, k, later))
    return out


# ------------------------------------------------------------------------------------------- verify
#: Steady-state arena bytes per byte of a stage's internal activations (the estimator's liveness,
#: less the stage outputs made so far, at its highest). Measured (docs/partition.md, "What a stage
#: holds after its runs"): after its first run ORT's CPU arena holds 1.5-2.7x that, and on the second
#: run the memory-pattern planner allocates its block beside the first run's chunks, doubling it
#: (2.9-5.2x over three runs on the stages measured); 6 covers it.
ARENA_STEADY = 6
#: The stage's outputs are held twice after a run: ORT's arena copy and the numpy copy ``run`` returns.
OUTPUT_COPIES = 2
#: Creation peaks measured up to 0.75 MiB above the estimate on these stages.
CREATE_MARGIN = 1 << 20


def _estimate_stage(proto: ModelProto, path: Path, dims: Mapping[str, int], output_bytes: int) -> int:
    """Bytes a stage's ``ortmem.InferenceSession`` holds at its worst over creation and repeated runs,
    above the process baseline.

    From the estimator (cache hit, allocator hygiene on): its creation peak plus
    :data:`CREATE_MARGIN`, or its resident memory after one run with the activations re-counted the
    way ORT's arena holds them in steady state (:data:`ARENA_STEADY` x the internal activations,
    :data:`OUTPUT_COPIES` x the outputs), whichever is higher; plus a mapped embedding table counted
    whole (the estimator counts the rows one run reads; over runs with other tokens every page of the
    table becomes resident, and on this kernel one random row already maps several MiB of it:
    measured +4.8 MiB RSS for one row of a 31 MiB table).
    """
    from .estimate import estimate

    m = Model(path=path, skeleton=proto, store=WeightStore())
    e = estimate(m, dims=dict(dims), hygiene=True)
    o = e.ortmem
    outputs = {x.name for x in proto.graph.output}
    makes_output = {n.name or "" for n in proto.graph.node if any(x in outputs for x in n.output)}
    alive = internal = 0
    for r in e.nodes:  # liveness per node, less the stage outputs made so far (they stay to the end)
        if r.graph:
            continue
        if r.node in makes_output:
            alive += r.outputs_bytes
        internal = max(internal, r.live_bytes - alive)
    run = (o.steady_bytes_with_hygiene - e.activation_peak_bytes + OUTPUT_COPIES * output_bytes
           + ARENA_STEADY * internal)
    worst = max(o.session_peak_bytes_with_hygiene + CREATE_MARGIN, run)
    return worst - e.baseline_bytes + _gather_tables_extra(proto, e)


def _gather_tables_extra(proto: ModelProto, e) -> int:
    """For each external-data table only Gather nodes read: its bytes less what the estimate counted
    (the gathered rows, page-rounded)."""
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for x in node.input:
            if x in inits:
                readers.setdefault(x, []).append(node)
    rows = {r.node: r for r in e.nodes if r.graph == "" and r.op == "Gather"}
    extra = 0
    for name, users in readers.items():
        t = inits[name]
        if t.data_location != TensorProto.EXTERNAL or not all(u.op_type == "Gather" and u.input[0] == name
                                                                 for u in users):
            continue
        table = _tensor_nbytes(t)
        rows_n = int(t.dims[0]) if len(t.dims) else 1
        row = -(-(table // max(rows_n, 1)) // 4096) * 4096
        counted = 0
        for u in users:
            r = rows.get(u.name)
            if r is not None:
                counted += (r.inputs_bytes // 8) * row  # int64 indices (int32 would count fewer: safe)
        extra += max(0, table - min(table, counted))
    return extra


def default_overhead(provider: str) -> int:
    """Per-session fixed bytes assumed for a stage: on the CPU, what the estimator's calibration
    measured for a session (creation + first run + ortmem's hook); elsewhere 0 (a device budget is
    taken to exclude the runtime's own context)."""
    if not is_cpu(provider):
        return 0
    from .estimate import Calibration

    cal = Calibration.load()
    return cal.session_fixed_bytes + cal.run_fixed_bytes + cal.ortmem_fixed_bytes


# ------------------------------------------------------------------------------------------- ORT settings
def _designator(device: str, provider: str, options: Mapping[str, Any]) -> str:
    """The device designator ``session.layer_assignment_settings`` uses for this device."""
    if is_cpu(provider):
        return "cpu"
    if provider == "CUDAExecutionProvider":
        return f"gpu:{int(options.get('device_id', 0))}" if ":" in device or device.isdigit() else "cuda"
    if provider == "DmlExecutionProvider":
        return "dml"
    return provider


def _annotation(device: str) -> str:
    return "ortmem_" + "".join(ch if ch.isalnum() else "_" for ch in device)


def ort_settings(plan: PartitionPlan, *, stats_file: str | None = None) -> dict[str, Any] | None:
    """ORT's own way of running the plan in ONE session, when one suffices: at most one device with a
    non-CPU provider (ORT registers one instance of an EP per session) and the rest on the CPU.

    Returns ``{"providers", "session_config", "alternative_session_config", "annotations", "status"}``:
    ``session.layer_assignment_settings`` = ``"gpu:0(=ortmem_cuda_0); cpu(=ortmem_cpu)"`` for a model
    whose nodes carry ``layer_ann`` metadata (written as ``model_annotated.onnx``; grammar from
    onnxruntime/core/framework/layering_annotations.cc: ``device(ann, ...); ...``, ``=`` for an exact
    match), and, as ORT's greedy alternative, ``session.resource_cuda_partitioning_settings`` =
    ``"<budget KiB>,<stats file>"`` (``"<KiB>,"`` without one). Not run on a GPU here.
    """
    gpu = [d for d in plan.devices if not is_cpu(d.provider) and d.stages]
    if len(gpu) != 1 or gpu[0].provider != "CUDAExecutionProvider":
        return None
    dev = gpu[0]
    stage0 = next(s for s in plan.stages if s.device == dev.name)
    groups: dict[str, list[str]] = {}
    annotations: dict[str, str] = {}
    for d in plan.devices:
        if not d.stages:
            continue
        opts = next(s.provider_options for s in plan.stages if s.device == d.name)
        desig = _designator(d.name, d.provider, opts)
        ann = _annotation(d.name)
        annotations[d.name] = ann
        groups.setdefault(desig, []).append("=" + ann)
    layer = "; ".join(f"{desig}({', '.join(anns)})" for desig, anns in groups.items())
    kib = dev.budget_bytes // 1024
    resource = f"{kib},{stats_file}" if stats_file else f"{kib},"
    return {
        "model": ANNOTATED_FILE,
        "providers": [["CUDAExecutionProvider", dict(stage0.provider_options)], ["CPUExecutionProvider", {}]],
        "session_config": {"session.layer_assignment_settings": layer},
        "alternative_session_config": {"session.resource_cuda_partitioning_settings": resource},
        "annotations": annotations,
        "status": ("format accepted by ORT 1.31.1's parser (CPU build); placement not run on a GPU: untested. "
                   "The alternative is ORT's own greedy walk, which stops at the first node over budget."),
    }


def _annotated_model(G: _Graph, stage_models: Sequence[_StageGraph], plan: PartitionPlan, layout: _Layout,
                     location: str) -> ModelProto:
    m = ModelProto()
    m.CopyFrom(G.model.skeleton)
    ann_of: dict[str, str] = {}
    for sg, st in zip(stage_models, plan.stages):
        for label in sg.nodes:
            ann_of[label] = _annotation(st.device)
        for label in sg.replicated:
            ann_of.setdefault(label, _annotation(st.device))
    for i, node in enumerate(m.graph.node):
        ann = ann_of.get(G.labels_all[i])
        if ann is None:
            continue
        for prop in list(node.metadata_props):
            if prop.key == LAYER_ANN:
                node.metadata_props.remove(prop)
        e = node.metadata_props.add()
        e.key, e.value = LAYER_ANN, ann
    _relocate_graph(m.graph, G.model.path.parent.resolve(), layout, location)
    return m


# ------------------------------------------------------------------------------------------- report
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


def _did_not_fit(tree: ModuleTree, leaf_dev: Mapping[str, int], names: Sequence[str], reports: Sequence[DeviceReport],
                 reserve: Sequence[int], loads: Sequence[int]) -> None:
    """For each device but the last: the smallest module (by weights) that went to a later device, and why."""
    for j in range(len(names) - 1):
        later = [(tree.weight_bytes[m], m) for m, d in leaf_dev.items() if d > j and tree.weight_bytes[m] >= 4096]
        if not later:
            continue
        size, m = min(later)
        rep = reports[j]
        free = rep.free_bytes
        head = f"{len(later)} module(s) with weights (4 KiB or more) went to later devices; the smallest, {m}, has {size:,} B of weights"
        if size > free:
            rep.did_not_fit.append(f"{head}, more than the {max(free, 0):,} B left here")
        elif loads[j] + size > rep.planning_budget_bytes:
            rep.did_not_fit.append(
                f"{head}: it would fit in the {free:,} B left by the final costs, but not in the planner's weight "
                f"budget of {rep.planning_budget_bytes:,} B (budget less {reserve[j]:,} B kept for activations and the "
                f"per-session overhead, over the estimated cost per weight byte), of which it had placed {loads[j]:,} B")
        else:
            rep.did_not_fit.append(f"{head}: it fits here, but was kept off to keep the stages and the cut few "
                                   "(cut_slack), or to keep neighbouring modules together")


# ------------------------------------------------------------------------------------------- entry point
def partition(model_path: str | os.PathLike, devices: Mapping[str, int], *, stats_csv: str | os.PathLike | None = None,
              dims: Mapping[str, int] | None = None, by: str = "scope", out_dir: str | os.PathLike | None = None,
              providers_per_device: Mapping[str, Any] | None = None, cut_slack: float = 0.02,
              stage_overhead: int | Mapping[str, int] | None = None, verify: bool = True,
              weights: str = "auto") -> PartitionPlan:
    """Split ``model_path`` into contiguous stages within ``devices``' budgets (bytes, preference
    order: fastest first) and, with ``out_dir``, write the stages, ``weights.bin`` and ``plan.json``.

    ``stats_csv``: measured per-node memory (``ortmem stats`` / ORT's node stats) instead of the
    estimator's activations where it names a node. ``dims``: symbolic input dims (``{"batch": 1,
    "seq": 512}``). ``by``: ``"scope"`` (modules from name scopes) or ``"node"``. ``cut_slack``: the
    share of a device's budget the stage-count and cut choices may give up (0 keeps exactly the
    planner's bytes). ``stage_overhead``: fixed bytes per stage (one int, or per device), default
    :func:`default_overhead`. ``verify``: check CPU stages with the estimator and re-plan when over.
    ``weights``: ``"auto"`` (hard-link the source data file when possible), ``"link"`` or ``"copy"``.

    Raises :class:`PlanError` (``needed``: the smallest budget each device alone would need) when
    nothing fits.
    """
    if not devices:
        raise PlanError("devices names no device")
    names = [str(d) for d in devices]
    budgets = []
    for d in names:
        b = devices[d]
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise PlanError(f"device {d!r}: budget must be a non-negative int of bytes, got {b!r}")
        budgets.append(b)
    if not 0 <= cut_slack <= 1:
        raise PlanError(f"cut_slack must be in [0, 1], got {cut_slack!r}")
    providers = [resolve_provider(d, providers_per_device) for d in names]
    if stage_overhead is None:
        overhead = [default_overhead(p) for p, _ in providers]
    elif isinstance(stage_overhead, Mapping):
        overhead = [int(stage_overhead.get(d, 0)) for d in names]
    else:
        overhead = [int(stage_overhead)] * len(names)
    dims = dict(dims or {})
    model = load(model_path)
    try:
        return _partition(model, names, budgets, providers, overhead, stats_csv, dims, by, out_dir, cut_slack,
                          verify, weights)
    finally:
        model.close()


def _partition(model: Model, names: list[str], budgets: list[int], providers: list[tuple[str, dict]],
               overhead: list[int], stats_csv, dims: dict[str, int], by: str, out_dir, cut_slack: float,
               verify: bool, weights_mode: str) -> PartitionPlan:
    G = _Graph(model)
    if not G.order:
        raise PlanError("the model has no node to place")
    act_b, ws_b, notes = _node_costs(G, model, dims, stats_csv)
    costs_list = G.set_costs(act_b, ws_b)
    tree = group_modules(G.planned_graph, costs_list, by=_module_names(G.labels, by))
    if list(tree.order) != G.labels:
        raise PlanError("internal: module order and node order disagree")
    root = og.build(model.skeleton.graph)
    shapes_sym = act.infer_shapes(model.skeleton, root, {})
    shapes_dims = act.infer_shapes(model.skeleton, root, dims) if dims else shapes_sym
    layout = _layout(model, weights_mode)
    boundaries = _module_boundaries(G, tree)
    n = len(names)
    # What the planner places: weights (additive but for shared ones). Activations are transient:
    # each device keeps ``reserve`` bytes for them (at first a typical module's, then what its stages
    # needed in the last round; a stage that needs more than its device's reserve is caught by the
    # first-order check in _choose, which shrinks that device's weight budget and plans again). On
    # verified CPU devices activations count ARENA_STEADY times (what ORT's arena holds in steady
    # state), and ``ratio`` is what the estimator says a first-order byte costs there (pre-packed
    # MatMulNBits hold 1.2-1.5x their codes...): the device's first-order costs are held to
    # budget / ratio. Both are re-measured on every round's plan (a device that was over shrinks, one
    # that had room grows); the best plan that fits is kept.
    stage_dir = Path(out_dir) if out_dir is not None else model.path.parent
    verify_dev = [verify and is_cpu(p) for p, _ in providers]
    act_mult = [float(ARENA_STEADY) if v else 1.0 for v in verify_dev]
    costs = _Costs(G, overhead, act_mult)
    module_act = sorted(tree.activation_bytes[m] for m in tree.nodes)
    typical_act = module_act[(3 * len(module_act)) // 4] if module_act else 0
    sizes = tree.weight_bytes
    reserve = [int(mult * typical_act) for mult in act_mult]
    ratio = [1.0] * n
    best: tuple | None = None
    seen_caps: set[tuple[int, ...]] = set()
    rounds = 0
    while rounds < MAX_ROUNDS:
        rounds += 1
        limits = [int(b / r) for b, r in zip(budgets, ratio)]
        caps = [max(0, lim - o - res) for lim, o, res in zip(limits, overhead, reserve)]
        seen_caps.add(tuple(caps))
        try:
            placement, leaf_dev, stages = _choose(tree, sizes, G, costs, boundaries, names, caps, limits, budgets,
                                                  cut_slack)
        except PlanError as e:
            if best is not None:
                break
            needed = {d: (None if v is None else int((v + reserve[j] + overhead[j]) * ratio[j]))
                      for j, (d, v) in enumerate(e.needed.items())}
            extra = "" if rounds == 1 else f" after {rounds - 1} round(s) of corrections"
            raise PlanError(f"{e}{extra}. These are weight budgets: each device's budget less the per-stage overhead "
                            f"and room for activations ({', '.join(f'{x:,}' for x in reserve)} B){', over the estimator ratio' if rounds > 1 else ''};"
                            f" in the caller's terms each device alone would need "
                            + "{" + ", ".join(f"{d}: {'-' if v is None else f'{v:,}'}" for d, v in needed.items()) + "}",
                            needed=needed) from None
        models = _stage_models(G, stages, shapes_sym, layout, WEIGHTS_FILE)
        est: list[int | None] = [None] * len(stages)
        for k, s in enumerate(stages):
            if verify_dev[s.device]:
                out_b = sum((shapes_dims.types.get("", {}).get(o) or act.TensorShape(0, None)).nbytes() or 0
                            for o in models[k].outputs)
                est[k] = _estimate_stage(models[k].proto, stage_dir / _stage_file(k, names[s.device]), dims, out_b)
        first, credit = costs.device_totals(stages, n)
        device_cost = list(first)
        for j in range(n):
            if verify_dev[j]:
                device_cost[j] = sum(e for e, s in zip(est, stages) if s.device == j and e is not None)
        over = [max(0, c - b) for c, b in zip(device_cost, budgets)]
        used = [any(s.device == j for s in stages) for j in range(n)]
        if not any(over):
            wbytes = [0] * n
            for s in stages:
                wbytes[s.device] += costs.span(s.lo, s.hi).weight_bytes
            acc, key = 0, []
            for j in range(n - 1):
                acc += wbytes[j]
                key.append(-acc)
            state = (tuple(key), rounds, placement, leaf_dev, stages, models, est, first, credit, list(caps))
            if best is None or state[0] < best[0]:
                best = state
        act_now = costs.activations(stages, n)
        measured = {j: device_cost[j] / first[j] for j in range(n) if verify_dev[j] and used[j] and first[j] > 0}
        typical = sorted(measured.values())[len(measured) // 2] if measured else 1.0
        old_caps = list(caps)
        for j in range(n):
            if used[j]:
                reserve[j] = max(reserve[j], act_now[j]) if over[j] else act_now[j]
            if j in measured:
                ratio[j] = max(measured[j], ratio[j]) * 1.005 if over[j] else measured[j]
            elif verify_dev[j] and not used[j]:
                ratio[j] = typical
            elif over[j]:
                ratio[j] *= 1 + over[j] / max(budgets[j], 1) + 0.005
        new_caps = [max(0, int(b / r) - o - res) for b, r, o, res in zip(budgets, ratio, overhead, reserve)]
        changed = [j for j in range(n) if (over[j] or (verify_dev[j] and any(used[j + 1:])))
                   and abs(new_caps[j] - old_caps[j]) > 0.01 * max(budgets[j], 1)]
        if not changed or tuple(new_caps) in seen_caps:  # settled, or going round in circles
            break
        seen_caps.add(tuple(new_caps))
        note = f"round {rounds}: " + ("over budget by the estimator on " + ", ".join(
            f"{names[j]} (+{over[j]:,} B)" for j in range(n) if over[j]) if any(over) else "fits") + \
            "; planner budget now " + ", ".join(f"{names[j]} {new_caps[j]:,} B (estimated / first-order cost "
                                               f"x{ratio[j]:.2f}, {reserve[j]:,} B kept for activations)"
                                               for j in changed)
        notes.append(note)
        log.info(note)
    if best is None:
        needed = {names[j]: device_cost[j] if over[j] else budgets[j] for j in range(n)}
        raise PlanError(
            f"no plan fits: after {rounds} round(s) the closest one is still over budget on "
            + ", ".join(f"{names[j]} ({device_cost[j]:,} B > {budgets[j]:,} B)" for j in range(n) if over[j])
            + "; with the others unchanged each device would need "
            + "{" + ", ".join(f"{d}: {v:,}" for d, v in needed.items()) + "}", needed=needed)
    _, used_round, placement, leaf_dev, stages, models, est, first, credit, caps = best
    notes.append(f"plan of round {used_round} of {rounds} used")

    # ---- the result
    stage_infos: list[StageInfo] = []
    for k, (s, sg) in enumerate(zip(stages, models)):
        c = costs.span(s.lo, s.hi)
        prov, opts = providers[s.device]
        mods = list(dict.fromkeys(tree.module_of[G.labels[p]] for p in range(s.lo, s.hi)))
        stage_infos.append(StageInfo(
            index=k, device=names[s.device], provider=prov, provider_options=dict(opts),
            file=_stage_file(k, names[s.device]) if out_dir is not None else "",
            nodes=sg.nodes, replicated=sg.replicated, modules=mods, inputs=sg.inputs, outputs=sg.outputs,
            weight_bytes=c.weight_bytes, activation_bytes=c.activation_bytes, workspace_bytes=c.workspace_bytes,
            overhead_bytes=overhead[s.device], estimated_bytes=est[k]))
    reports = []
    for j, d in enumerate(names):
        mine = [s for s in stage_infos if s.device == d]
        reports.append(DeviceReport(
            name=d, provider=providers[j][0], budget_bytes=budgets[j], planning_budget_bytes=caps[j],
            stages=[s.index for s in mine],
            weight_bytes=sum(s.weight_bytes for s in mine) - credit[j],
            activation_bytes=sum(s.activation_bytes for s in mine),
            workspace_bytes=sum(s.workspace_bytes for s in mine),
            overhead_bytes=sum(s.overhead_bytes for s in mine), shared_credit_bytes=credit[j],
            first_order_bytes=first[j],
            estimated_bytes=(sum(s.estimated_bytes or 0 for s in mine) if verify_dev[j] and mine else None)))
    _did_not_fit(tree, leaf_dev, names, reports, reserve, placement.loads)
    device_map = {}
    for m, d in placement.entries:
        device_map[m] = names[d]
    plan = PartitionPlan(
        model=str(model.path), inputs=list(G.inputs), outputs=list(G.outputs), devices=reports, stages=stage_infos,
        crossings=_crossings(G, stages, shapes_dims), device_map=device_map,
        settings={"by": by, "dims": dims, "cut_slack": cut_slack, "verify": verify, "rounds": rounds,
                  "costs": "stats" if stats_csv is not None else "estimate", "exact": placement.exact,
                  "modules": len(tree.nodes), "nodes": len(G.order), "replicated_constant_nodes": len(G.const_nodes)},
        weights_mode=layout.mode, weight_bytes=layout.weight_bytes, notes=notes)
    stats_name = None
    if stats_csv is not None and out_dir is not None:
        stats_name = "node_stats.csv"
    plan.ort = ort_settings(plan, stats_file=stats_name)
    if out_dir is not None:
        _write(plan, G, models, layout, Path(out_dir), stats_csv, stats_name)
    return plan


def _remove_previous(out: Path) -> None:
    """Delete the files an earlier plan wrote into ``out`` (only those its plan.json names), so stage
    files of a different split do not linger beside the new ones."""
    try:
        old = PartitionPlan.load(out)
    except PlanError:
        return
    names = [s.file for s in old.stages if s.file] + [PLAN_FILE, "report.txt", "report.json", ANNOTATED_FILE,
                                                     "node_stats.csv"]
    for name in names:
        p = out / name
        if p.parent == out and p.is_file():
            p.unlink()


def _stage_file(k: int, device: str) -> str:
    return f"stage{k}_{''.join(ch if ch.isalnum() else '_' for ch in device)}.onnx"


def _write(plan: PartitionPlan, G: _Graph, models: Sequence[_StageGraph], layout: _Layout, out: Path,
           stats_csv, stats_name: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _remove_previous(out)
    _write_weights(layout, out / WEIGHTS_FILE)
    for st, sg in zip(plan.stages, models):
        (out / st.file).write_bytes(sg.proto.SerializeToString())
    if plan.ort is not None:
        (out / ANNOTATED_FILE).write_bytes(_annotated_model(G, models, plan, layout, WEIGHTS_FILE).SerializeToString())
        if stats_name is not None:
            shutil.copyfile(stats_csv, out / stats_name)
    plan.out_dir = str(out.resolve())
    plan.weights_file = WEIGHTS_FILE
    plan.save(out)
    (out / "report.txt").write_text(plan.report() + "\n")
    (out / "report.json").write_text(json.dumps(plan.report_dict(), indent=2) + "\n")
