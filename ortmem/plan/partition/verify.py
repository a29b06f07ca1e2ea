"""What a stage's session really holds, from the estimator plus what it misses about repeated runs
(step 7 of :mod:`ortmem.plan.partition`'s docstring).

First-order costs say what a stage's tensors take; an ORT session on the CPU holds more (its arena
after several runs, the outputs twice, a mapped embedding table whole), and the planner re-plans
with budgets corrected by these numbers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import onnx
from onnx import ModelProto, TensorProto

from ortmem.onnxfile.model import Model
from ortmem.onnxfile.weights import WeightStore
from ortmem.plan.partition.graph import tensor_nbytes


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


def estimate_stage(proto: ModelProto, path: Path, dims: Mapping[str, int], output_bytes: int) -> int:
    """Bytes a stage's ``ortmem.InferenceSession`` holds at its worst over creation and repeated runs,
    above the process baseline (taken once ortmem's session path is imported).

    From the estimator (cache hit, allocator hygiene on): its creation peak plus
    :data:`CREATE_MARGIN`, or its resident memory after one run with the activations re-counted the
    way ORT's arena holds them in steady state (:data:`ARENA_STEADY` x the internal activations,
    :data:`OUTPUT_COPIES` x the outputs), whichever is higher; plus a mapped embedding table counted
    whole (the estimator counts the rows one run reads; over runs with other tokens every page of the
    table becomes resident, and on this kernel one random row already maps several MiB of it:
    measured +4.8 MiB RSS for one row of a 31 MiB table).
    """
    from ortmem.plan.estimate import estimate

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
    # a stage's process imports ortmem's session path before its baseline is taken (stage_actor,
    # measure.probe): the estimate's once-per-process import cost is in that baseline, not the stage's
    return worst - e.baseline_bytes - e.ortmem_import_bytes + _gather_tables_extra(proto, e)


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
        table = tensor_nbytes(t)
        rows_n = int(t.dims[0]) if len(t.dims) else 1
        row = -(-(table // max(rows_n, 1)) // 4096) * 4096
        counted = 0
        for u in users:
            r = rows.get(u.name)
            if r is not None:
                counted += (r.inputs_bytes // 8) * row  # int64 indices (int32 would count fewer: safe)
        extra += max(0, table - min(table, counted))
    return extra
