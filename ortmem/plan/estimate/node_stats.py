"""``ortmem.plan.estimate.node_stats``: run a model for real and record what each node allocated.

Why: the estimator predicts; this measures, per node, in the units ORT itself uses, so the two can be
compared and so ORT's capacity-aware partitioning (``session.resource_cuda_partitioning_settings =
"<limit_kb>,<stats file>"``) can be fed from a CPU machine.

Sources, all from one ORT session (onnxruntime 1.31.1, CPU build):

* **Profiling events** (``SessionOptions.enable_profiling``): every executed node, subgraph nodes
  included, carries ``activation_size`` (its non-constant inputs), ``parameter_size`` (constant inputs
  still held as tensors; 0 for weights a kernel pre-packed and ORT dropped), ``output_size``, and the CPU
  arena's counters after the node: ``mem_bytes_in_use``, ``mem_in_use_delta``, ``mem_in_use_peak``,
  ``mem_arena_held``.
* **Node memory statistics** (``session.collect_node_memory_stats_to_file``): the CPU build writes the
  file too (checked on 1.31.1); ORT keeps the per-node maximum over runs and dumps
  ``#name,input_sizes,initializers_sizes,total_dynamic_sizes,total_temp_allocations`` when the session
  is destroyed (``onnxruntime/core/framework/node_stats_recorder.cc``). Its ``initializers_sizes`` is
  always 0; this module fills it in.
* **The optimized graph** (``optimized_model_filepath``, written by a throw-away session with the same
  options) gives every executed node's inputs, so the initializer column can be computed, with each
  initializer charged once (to its first consumer in execution order), outer-scope initializers charged
  to the node whose subgraph reads them.

Row names are ORT's unique node names (``IResourceAccountant::MakeUniqueNodeName``, see
:mod:`ortmem.ort.graph_index`), so a written file is read back by ORT's partitioner as is.

The measured activation peak is the arena's: the largest ``mem_bytes_in_use`` (or ``mem_in_use_peak``
where it rose during a node, i.e. a transient inside it) during a run, minus what the arena held before
the run's first node (pre-packed weights live in the same arena). A run-by-run maximum is reported.
Without the arena fields (``enable_cpu_mem_arena=False``) the peak falls back to the sum of the
outputs alive at each node, from ``output_size`` and the optimized graph's consumers.
"""
from __future__ import annotations

import csv
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ortmem.ort import graph_index as og

CSV_HEADER = "#name,input_sizes,initializers_sizes,total_dynamic_sizes,total_temp_allocations"
STATS_KEY = "session.collect_node_memory_stats_to_file"


@dataclass
class NodeStats:
    """One row of ORT's node memory statistics (bytes; maxima over runs)."""

    name: str
    input_sizes: int = 0
    initializers_sizes: int = 0
    total_dynamic_sizes: int = 0
    total_temp_allocations: int = 0

    def update(self, other: "NodeStats") -> None:
        self.input_sizes = max(self.input_sizes, other.input_sizes)
        self.initializers_sizes = max(self.initializers_sizes, other.initializers_sizes)
        self.total_dynamic_sizes = max(self.total_dynamic_sizes, other.total_dynamic_sizes)
        self.total_temp_allocations = max(self.total_temp_allocations, other.total_temp_allocations)


@dataclass
class NodeRecord:
    """What was measured for one executed node (maxima over runs)."""

    name: str  # ORT's label (profiling event name)
    unique_name: str
    graph: str
    op: str
    node_index: int
    activation_size: int = 0
    parameter_size: int = 0
    output_size: int = 0
    initializers_sizes: int = 0
    input_sizes: int = 0
    total_dynamic_sizes: int = 0
    total_temp_allocations: int = 0
    mem_bytes_in_use: int | None = None
    mem_in_use_peak: int | None = None
    mem_arena_held: int | None = None
    initializers: list[str] = field(default_factory=list)


@dataclass
class Stats:
    model: str
    runs: int
    onnxruntime: str
    activation_peak_bytes: int | None
    activation_peak_by_run: list[int]
    liveness_peak_bytes: int
    arena_held_bytes: int | None
    node_stats_source: str  # "ort" (ORT wrote the file) or "profiling" (rebuilt from events)
    rows: list[NodeStats]
    nodes: list[NodeRecord]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------- CSV
def write_csv(rows: list[NodeStats], path: str | os.PathLike) -> None:
    """ORT's node memory statistics format, one row per unique node name."""
    with open(path, "w", newline="") as f:
        f.write(CSV_HEADER + "\n")
        for r in rows:
            f.write(f"{r.name},{r.input_sizes},{r.initializers_sizes},{r.total_dynamic_sizes},"
                    f"{r.total_temp_allocations}\n")


def read_csv(path: str | os.PathLike) -> list[NodeStats]:
    """Rows of a node memory statistics file (ORT's or ours); repeated names keep their maxima,
    as ORT's recorder does."""
    rows: dict[str, NodeStats] = {}
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec or rec[0].startswith("#"):
                continue
            r = NodeStats(rec[0], *(int(x) for x in rec[1:5]))
            if r.name in rows:
                rows[r.name].update(r)
            else:
                rows[r.name] = r
    return list(rows.values())


# ------------------------------------------------------------------------------------ helpers
def _session_options(base, *, profile_prefix: str | None = None, stats_file: str | None = None,
                     optimized_path: str | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3  # the optimized-model save warns about NCHWc on every call
    if base is not None:
        so.graph_optimization_level = base.graph_optimization_level
        so.execution_order = base.execution_order
        so.enable_cpu_mem_arena = base.enable_cpu_mem_arena
        so.enable_mem_pattern = base.enable_mem_pattern
        so.intra_op_num_threads = base.intra_op_num_threads
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if stats_file:
        so.add_session_config_entry(STATS_KEY, stats_file)
    if optimized_path:
        so.optimized_model_filepath = optimized_path
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    os.path.basename(optimized_path) + ".data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return so


def _optimized_graph(model_path: str, base, tmp: str):
    """ORT's optimized graph, written by a throw-away session (saving keeps every initializer of
    that session alive, so it must not be the measured one)."""
    import onnx
    import onnxruntime as ort

    path = os.path.join(tmp, "optimized.onnx")
    try:
        sess = ort.InferenceSession(model_path, _session_options(base, optimized_path=path),
                                    providers=["CPUExecutionProvider"])
        del sess
        proto = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - a model ORT cannot save: fall back to the graph as given
        proto = onnx.load(model_path, load_external_data=False)
    return og.build(proto.graph)


def _initializer_charges(root: og.OrtGraph, order: og.ExecutionOrder) -> dict[int, tuple[int, list[str]]]:
    """id(node) -> (bytes, names) of the initializers first used by that node, in execution order,
    subgraphs right after their parent; outer-scope ones charged to the parent node."""
    from ortmem.plan.estimate.recipe import tensor_bytes

    charged: set[tuple[str, str]] = set()
    out: dict[int, tuple[int, list[str]]] = {}

    def visit(g: og.OrtGraph) -> None:
        for i in g.execution_order(order):
            node = g.nodes[i]
            total, names = 0, []
            for v in [*node.inputs, *node.implicit_inputs]:
                hit = g.find_initializer(v) if v else None
                if hit is None or (hit[0].path, v) in charged:
                    continue
                charged.add((hit[0].path, v))
                total += tensor_bytes(hit[1])
                names.append(v)
            out[id(node)] = (total, names)
            for _, sg in node.subgraphs:
                visit(sg)

    visit(root)
    return out


def _int(args: Mapping[str, Any], key: str) -> int | None:
    v = args.get(key)
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _arena_peak(events: list[dict]) -> int | None:
    """Peak arena use during one run's node events (in execution order) above what it held before."""
    if not events or _int(events[0]["args"], "mem_bytes_in_use") is None:
        return None
    first = events[0]["args"]
    before = (_int(first, "mem_bytes_in_use") or 0) - (_int(first, "mem_in_use_delta") or 0)
    prev_peak = before
    peak = before
    running_peak = None
    for e in events:
        a = e["args"]
        in_use = _int(a, "mem_bytes_in_use") or 0
        node_peak = _int(a, "mem_in_use_peak")
        peak = max(peak, in_use)
        if node_peak is not None:
            if running_peak is not None and node_peak > running_peak:
                peak = max(peak, node_peak)  # a transient inside this node set a new high-water mark
            running_peak = node_peak if running_peak is None else max(running_peak, node_peak)
        prev_peak = in_use
    del prev_peak
    return max(0, peak - before)


def _liveness_peak(events: list[dict], by_label: dict[str, og.OrtNode]) -> int:
    """Bytes of tensors alive at each node, from each event's ``output_size`` and the optimized graph's
    consumers: a value lives until its last consumer ran (graph outputs to the end); outputs of
    aliasing kernels (Reshape, Squeeze, Unsqueeze, Flatten, Identity) share their input's bytes.

    Events are taken in completion order (``ts + dur``): a subgraph's nodes finish before their
    parent's event does, once per execution of the subgraph; a new execution starts when a node already seen
    in the current one shows up again. Within an execution a value dies at its last consumer there.
    Subgraph outputs follow ORT 1.31.1's control-flow kernels (``core/providers/cpu/controlflow``):
    an ``If`` branch's outputs *are* the If's outputs (custom fetch allocators), so the If's own
    ``output_size`` adds nothing and they live as the If's outputs; a ``Loop`` body's carried outputs
    are the next iteration's feeds (alive until that execution ends, the last ones until the Loop's
    event, which copies them into the Loop's outputs), its scan outputs are kept until the Loop's
    event. Any other parent: its subgraph outputs live until the parent's event."""
    from ortmem.plan.estimate.activations import ALIAS_OPS

    # completion order: a node with subgraphs starts before, and ends after, its subgraphs' nodes
    events = sorted(events, key=lambda e: (e.get("ts", 0) + e.get("dur", 0)))
    nodes = [by_label.get(e["name"]) for e in events]
    parent_of: dict[int, og.OrtNode] = {}  # id(subgraph) -> the node owning it
    for node in nodes:
        if node is not None:
            for _, sg in node.subgraphs:
                parent_of[id(sg)] = node
    # executions: (graph id) -> current execution's list of event indices
    exec_of: list[int] = [-1] * len(events)
    executions: list[list[int]] = []
    current: dict[int, tuple[int, set[int]]] = {}
    for i, node in enumerate(nodes):
        if node is None:
            continue
        gid = id(node.graph)
        cur = current.get(gid)
        if cur is None or id(node) in cur[1]:
            executions.append([])
            cur = (len(executions) - 1, set())
            current[gid] = cur
        cur[1].add(id(node))
        executions[cur[0]].append(i)
        exec_of[i] = cur[0]
        for _, sg in node.subgraphs:  # the parent finished: its subgraphs' next events start anew
            current.pop(id(sg), None)
    # death (event index after which a value instance is released), per (execution, value)
    n = len(events)

    def parent_event(x: int, node: og.OrtNode) -> int:
        par = parent_of.get(id(node.graph))
        last = executions[x][-1]
        for j in range(last + 1, n):
            if nodes[j] is par:
                return j
        return n

    death: dict[tuple[int, str], int] = {}
    share: dict[tuple[int, str], tuple[int, str]] = {}  # If branch output instance -> the If's output
    for x, evs in enumerate(executions):
        g = nodes[evs[0]].graph  # type: ignore[union-attr]
        for i in evs:
            node = nodes[i]
            for v in [*node.inputs, *node.implicit_inputs]:  # type: ignore[union-attr]
                if v:
                    death[(x, v)] = i
        if g.parent is None:
            for v in g.outputs:
                death[(x, v)] = n
            continue
        par = parent_of.get(id(g))
        pe = parent_event(x, nodes[evs[0]])  # type: ignore[arg-type]
        outs = g.outputs
        if par is not None and par.op_type == "If":
            for k, v in enumerate(outs):
                if k < len(par.outputs) and par.outputs[k] and pe < n:
                    share[(x, v)] = (exec_of[pe], par.outputs[k])
            continue
        if par is not None and par.op_type == "Loop":
            n_carried = max(0, len(par.inputs) - 2)
            nxt = [y for y in range(x + 1, len(executions)) if nodes[executions[y][0]].graph is g
                   and executions[y][0] < pe]
            for k, v in enumerate(outs):
                # carried: fed to the next iteration, released when the one after it overwrites the
                # feeds; the last two are held until the Loop copied them into its outputs
                carried = 1 <= k <= n_carried
                death[(x, v)] = executions[nxt[0]][-1] if carried and len(nxt) >= 2 else pe
            continue
        for v in outs:
            death[(x, v)] = pe
    live, peak = 0, 0
    alive: dict[tuple[int, str], int] = {}  # (execution, value) -> bytes
    shared_into: dict[tuple[int, str], int] = {}  # an If's output instance -> bytes its branch wrote
    pending: dict[int, list[tuple[int, str]]] = {}
    for i, e in enumerate(events):
        node = nodes[i]
        out = _int(e["args"], "output_size") or 0
        if node is None:
            peak = max(peak, live + out)
            continue
        x = exec_of[i]
        outs = [o for o in node.outputs if o]
        if node.op_type in ALIAS_OPS and node.domain in ("", "ai.onnx"):
            out = 0
        per = out // max(len(outs), 1)
        for o in outs:
            key = (x, o)
            if key in shared_into:
                b = shared_into.pop(key)  # already counted when the branch wrote it
            else:
                b = per
                live += per
            if key in share:  # a branch output: it lives on as the If's output
                tgt = share[key]
                shared_into[tgt] = shared_into.get(tgt, 0) + b
                continue
            alive[key] = b
            pending.setdefault(death.get(key, i), []).append(key)
        peak = max(peak, live)
        for key in pending.pop(i, []):
            if key in alive:
                live -= alive.pop(key)
    return peak


# ------------------------------------------------------------------------------------ entry point
def stats(model_path: str | os.PathLike, inputs: Mapping[str, np.ndarray] | None = None, runs: int = 1,
          out_csv: str | os.PathLike | None = None, out_json: str | os.PathLike | None = None, *,
          session_options=None, dims: Mapping[str, int] | None = None) -> Stats:
    """Run ``model_path`` ``runs`` times on CPU and return per-node memory statistics (maxima over runs).

    ``inputs`` default to generated feeds (:func:`ortmem.ort.feeds.make_inputs`, symbolic dims from
    ``dims``). ``out_csv`` gets ORT's node-stats format with the initializer column filled in; ``out_json``
    the full record (profiling fields, arena counters, activation peak).
    """
    import onnxruntime as ort

    from ortmem.ort.feeds import make_inputs

    model_path = os.path.abspath(os.fspath(model_path))
    order: og.ExecutionOrder = "PRIORITY_BASED" if session_options is not None and \
        int(session_options.execution_order) == 1 else "DEFAULT"
    with tempfile.TemporaryDirectory(prefix="ortmem-stats-") as tmp:
        root = _optimized_graph(model_path, session_options, tmp)
        stats_file = os.path.join(tmp, "node_stats.csv")
        so = _session_options(session_options, profile_prefix=os.path.join(tmp, "profile"), stats_file=stats_file)
        sess = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])
        given = dict(inputs or {})
        names = {i.name for i in sess.get_inputs()}
        feeds = given if names <= set(given) else {**make_inputs(sess, {"dims": dict(dims or {})}), **given}
        for _ in range(max(1, runs)):
            sess.run(None, feeds)
        profile = sess.end_profiling()
        del sess  # ORT dumps the node statistics when the session is destroyed
        import gc

        gc.collect()
        with open(profile) as f:
            events = json.load(f)
        ort_rows = read_csv(stats_file) if os.path.exists(stats_file) else None
    result = _assemble(model_path, runs, events, ort_rows, root, order)
    if out_csv is not None:
        write_csv(result.rows, out_csv)
    if out_json is not None:
        with open(out_json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
    return result


def _assemble(model_path: str, runs: int, events: list[dict], ort_rows: list[NodeStats] | None,
              root: og.OrtGraph, order: og.ExecutionOrder) -> Stats:
    import onnxruntime as ort

    nodes_by_label: dict[str, og.OrtNode] = {}
    by_unique: dict[str, og.OrtNode] = {}
    for g in og.walk(root):
        for n in g.nodes:
            nodes_by_label.setdefault(n.label, n)
            by_unique.setdefault(n.unique_name, n)
    charges = _initializer_charges(root, order)

    runs_ev = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    node_ev = sorted((e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")),
                     key=lambda e: e["ts"])
    for e in node_ev:
        e["name"] = e["name"][: -len("_kernel_time")]
    per_run: list[list[dict]] = []
    for r in runs_ev:
        lo, hi = r["ts"], r["ts"] + r.get("dur", 0)
        per_run.append([e for e in node_ev if lo <= e["ts"] <= hi])
    if not per_run:
        per_run = [node_ev]
    peaks = [p for p in (_arena_peak(evs) for evs in per_run) if p is not None]
    liveness = max((_liveness_peak(evs, nodes_by_label) for evs in per_run), default=0)

    records: dict[str, NodeRecord] = {}
    for e in node_ev:
        a = e["args"]
        node = nodes_by_label.get(e["name"])
        uname = node.unique_name if node is not None else e["name"]
        rec = records.get(uname)
        if rec is None:
            init_bytes, init_names = charges.get(id(node), (0, [])) if node is not None else (0, [])
            rec = records[uname] = NodeRecord(e["name"], uname, node.graph.path if node is not None else "",
                                              str(a.get("op_name", "")), _int(a, "node_index") or -1,
                                              initializers_sizes=init_bytes, initializers=init_names)
        for k in ("activation_size", "parameter_size", "output_size"):
            setattr(rec, k, max(getattr(rec, k), _int(a, k) or 0))
        for k in ("mem_bytes_in_use", "mem_in_use_peak", "mem_arena_held"):
            v = _int(a, k)
            if v is not None:
                setattr(rec, k, max(getattr(rec, k) or 0, v))
    source = "ort" if ort_rows is not None else "profiling"
    rows: list[NodeStats] = []
    if ort_rows is not None:
        for r in ort_rows:
            node = by_unique.get(r.name)
            if node is not None:
                r.initializers_sizes = charges.get(id(node), (0, []))[0]
            rec = records.get(r.name)
            if rec is not None:
                rec.input_sizes, rec.total_dynamic_sizes = r.input_sizes, r.total_dynamic_sizes
                rec.total_temp_allocations = r.total_temp_allocations
            rows.append(r)
    else:
        for rec in records.values():
            rows.append(NodeStats(rec.unique_name, rec.activation_size, rec.initializers_sizes, rec.output_size, 0))
    held = [r.mem_arena_held for r in records.values() if r.mem_arena_held is not None]
    return Stats(model_path, runs, ort.__version__, max(peaks) if peaks else None, peaks, liveness,
                 max(held) if held else None, source, rows, list(records.values()))
