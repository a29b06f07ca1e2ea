"""``ortmem.plan.estimate``: how much memory a model will need, before a single weight byte is read.

What is predicted, for plain ONNX Runtime, for ortmem's hook (cold start, or a warm start without
pre-packed weights: ORT loading the converted native twin) and for ortmem's default warm start
(``ortmem_prepacked``: the twin's pre-packed MatMulNBits weights mapped from the cache entry,
:mod:`ortmem.store.finished`), in bytes of resident memory, the process included, as ``ortmem bench``
measures them:

* ``session_peak_bytes``: the high-water mark of session creation;
* ``steady_bytes``: resident memory after the first run;
* both with and without allocator hygiene (``ortmem.base.hygiene``): without it glibc keeps part
  of what ORT frees, with it resident memory is memory in use;
* ``activation_peak_bytes``: what the run itself holds at its worst, and a per-node table.

How (each term is checked against measurements in ``docs/estimator.md``):

1. **What ORT does with each initializer**, decided from the graph and tensor metadata only:
   embedded bytes are parsed into the protobuf and copied once more into an OrtValue (tensor by
   tensor); external data is mapped and costs nothing until read; constant folding (level >= 1)
   materialises Cast/Mul/... chains on constants as new heap tensors; ``DQMatMulToMatMulNBits``
   (level >= 2, exactly the nodes :func:`~ortmem.passes.rules.dq_matmul_match.dq_matmul_match` selects)
   copies weight, scales and zero points out, writes transposed MatMulNBits tensors and drops the
   originals; the NCHWc layout transformer (level 99, x86) writes reordered Conv weights; then kernels
   pre-pack constant inputs (MatMulNBits B: ``B + 8 bytes per (column, block)`` at accuracy level 4,
   ``B`` at 0-3; fp32 MatMul/Gemm B: ``K x roundup(N, 16) x 4``) and ORT drops an initializer once every
   use of it was packed, unless a subgraph reads it from an outer scope.
2. **The order** those allocations and frees happen in is replayed through a model of glibc malloc
   (:mod:`ortmem.plan.estimate.memsim`): resident memory without hygiene, memory in use with it.
3. **Constants** that no graph determines (the interpreter and imports, pages of ORT's own code faulted
   in during creation, run-time thread and arena overhead) come from ``calibration.json``, measured by
   ``bench/estimator/calibrate.py``; so do **ortmem's own fixed costs**, which its sides add to ORT's
   work on the graph it hands over: the session path a first ``ortmem.InferenceSession`` imports (no
   onnx), and on a cold start the conversion's imports (onnx, the loader, the passes),
   the source digest, the weightless copy's type resolution and the entry's writers
   (:func:`cold_start`). The background finisher a cold start leaves is a process of its own and in no
   side. ortmem's DQ -> Gather rewrite (GatherBlockQuantized) is applied on its sides: that DQ never
   runs and its table is read row by row (:func:`~ortmem.plan.estimate.recipe.ortmem_gathers`).
4. **Activations**: :mod:`ortmem.plan.estimate.activations` (shape inference with ``dims``, ORT's execution
   order from :mod:`ortmem.ort.graph_index`, known workspaces).

Everything is computed on the graph ORT *receives*, with GELU/BiasGelu fused as ORT does (level >= 2); its other fusions (attention, layer norm,
MatMul+Add, ...) change the activation picture and are not replayed (see docs/estimator.md for the error).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Union


from ortmem.onnxfile.model import Model
from ortmem.onnxfile.scan import min_helper_bytes, model_files_bytes
from ortmem.ort.release import capabilities
from ortmem.plan.estimate import activations as act
from ortmem.plan.estimate import shapes as shp
from ortmem.plan.estimate.fusions import ort_fusions
from ortmem.ort import graph_index as og
from ortmem.plan.estimate.graph_context import Context, ort_view
from ortmem.plan.estimate.calibration import Calibration
from ortmem.plan.estimate.creation import retention_basis, run_touch, simulate
from ortmem.ort.settings import OrtSettings, session_settings
from ortmem.plan.estimate.recipe import Recipe, nchwc_block, node_attr, ortmem_gathers, plan_model, tensor_bytes
from ortmem.plan.estimate.result import Estimate, NodeRow, Side

ModelLike = Union[str, os.PathLike, Model]


# ------------------------------------------------------------------------------ activations
def workspace_fn(plan: Recipe, st: OrtSettings, nchwc: bool):
    def workspace(node: og.OrtNode, shapes: shp.Shapes) -> int:
        g = node.graph
        if node.op_type == "MatMulNBits" or id(node) in plan.fused:
            if id(node) in plan.fused:
                K, N, _, block, acc = plan.fused[id(node)]
            else:
                p = node.proto
                K, N = int(node_attr(p, "K", 0) or 0), int(node_attr(p, "N", 0) or 0)
                block = int(node_attr(p, "block_size", 32) or 32)
                acc = int(node_attr(p, "accuracy_level", 0) or 0)
            if not plan.packed_nbits_nodes.get(id(node), False):
                return K * N * 4
            if acc == 4:
                a = shapes.get(g, node.inputs[0])
                if a is not None and a.known and K:
                    m = math.prod(a.dims) // K  # type: ignore[arg-type]
                    kb = -(-K // block)
                    return m * kb * (block + 8)
            return 0
        if node.op_type == "Conv" and not nchwc:
            w = shapes.get(g, node.inputs[1]) if len(node.inputs) > 1 else None
            y = shapes.get(g, node.outputs[0])
            if w is not None and y is not None and w.known and y.known and len(w.dims) == 4:
                C, kh, kw = w.dims[1], w.dims[2], w.dims[3]  # type: ignore[misc]
                if kh * kw > 1:
                    return int(C * kh * kw * math.prod(y.dims[2:]) * 4)  # type: ignore[arg-type]
        return 0

    return workspace


def _weight_sources(g: og.OrtGraph, values: list[str], removed: frozenset[int]):
    """Initializers behind ``values``: direct ones, and those feeding nodes ORT turns into constants
    (a fused DQ's weight, scale and zero point belong to the MatMulNBits that replaces the pair)."""
    seen: set[str] = set()
    stack = [v for v in values if v]
    while stack:
        v = stack.pop(0)
        if v in seen:
            continue
        seen.add(v)
        hit = g.find_initializer(v)
        if hit is not None:
            yield v, hit
            continue
        p = g.producer.get(v)
        if p is not None and id(g.nodes[p]) in removed:
            stack.extend(x for x in g.nodes[p].inputs if x)


def _node_rows(root: og.OrtGraph, shapes: shp.Shapes, order: og.ExecutionOrder, workspace,
               unknown: dict, removed: frozenset[int], inplace, merged) -> tuple[int, list[NodeRow]]:
    rows: list[NodeRow] = []
    charged: set[tuple[str, str]] = set()
    top = act.graph_activation(root, shapes, order, workspace, unknown, removed, inplace=inplace, merged=merged)

    def emit(ga: act.GraphActivation) -> int:
        """Rows of one graph; returns the weights charged in it (subgraphs included)."""
        total = 0
        for r in ga.rows:
            node, g = r.node, ga.graph
            names, wbytes = [], 0
            for v, hit in _weight_sources(g, [*node.inputs, *node.implicit_inputs], removed):
                key = (hit[0].path, v)
                if key in charged:
                    continue
                charged.add(key)
                names.append(v if not hit[0].path else f"{hit[0].path}:{v}")
                wbytes += tensor_bytes(hit[1])
            row = NodeRow(len(rows), g.path, node.label, node.op_type if node.domain in ("", "ai.onnx") else
                          f"{node.domain}.{node.op_type}", node.unique_name, wbytes, names, r.inputs_bytes,
                          r.outputs_bytes, r.workspace_bytes, r.live_bytes, unknown=r.unknown)
            rows.append(row)
            total += wbytes
            sub_total = 0
            for _, sg in node.subgraphs:
                sub = act.graph_activation(sg, shapes, order, workspace, unknown, removed, inplace=inplace,
                                           merged=merged)
                sub_total += emit(sub)
            row.subgraph_weights_bytes = sub_total
            total += sub_total
        return total

    emit(top)
    return top.peak_bytes, rows


# ------------------------------------------------------------------------------ ortmem's cold start
def cold_start(warm: Side, cal: Calibration) -> Side:
    """ortmem's cold start on a model it converts, from its cache-hit side: ORT loads the same
    entry, but the start first imports the conversion (onnx, the loader, the passes: resident from
    then on, ``ortmem_convert_import_bytes``, which a warm start never imports), digests the source
    file (an 8 MiB read buffer, ``ortmem.files.digest``), resolves the weightless copy's value types
    (``ortmodel.value_types``) and writes the entry. Those temporaries set a floor under the creation
    peak (measured: they decide it on models below ~20 MiB of weights), and what they leave behind
    (``ortmem_cold_retained_bytes``) stays. A model whose files reach
    :func:`ortmem.onnxfile.scan.min_helper_bytes` converts in a helper process instead
    (:func:`cold_start_in_helper`)."""
    imports = cal.ortmem_import_bytes + cal.ortmem_convert_import_bytes
    floor = cal.baseline_bytes + imports + cal.ortmem_cold_peak_bytes
    kept = cal.ortmem_convert_import_bytes + cal.ortmem_cold_retained_bytes
    return dataclasses.replace(
        warm,
        session_peak_bytes=max(warm.session_peak_bytes + kept, floor),
        steady_bytes=warm.steady_bytes + kept,
        session_peak_bytes_with_hygiene=max(warm.session_peak_bytes_with_hygiene + kept, floor),
        steady_bytes_with_hygiene=warm.steady_bytes_with_hygiene + kept,
        session_peak_bytes_without_hygiene=max(warm.session_peak_bytes_without_hygiene + kept, floor),
        steady_bytes_without_hygiene=warm.steady_bytes_without_hygiene + kept,
        after_create_bytes_without_hygiene=warm.after_create_bytes_without_hygiene + kept,
        after_create_bytes_with_hygiene=warm.after_create_bytes_with_hygiene + kept,
    )


def cold_start_in_helper(warm: Side, cal: Calibration) -> Side:
    """ortmem's cold start on a model large enough to convert in a helper process
    (:mod:`ortmem.session.cold_start_child`): the session's process loads the new entry as a hit
    does, so its side is the hit's, with a floor. While the helper converts, the session's process
    waits at its baseline with its session path imported, beside a second interpreter that holds the
    same plus the conversion's imports and working memory (the in-process cold start's floor): the
    two at once are the start's peak on a model whose session needs less."""
    floor = (cal.baseline_bytes + cal.ortmem_import_bytes
             + cal.baseline_bytes + cal.ortmem_import_bytes + cal.ortmem_convert_import_bytes + cal.ortmem_cold_peak_bytes)
    return dataclasses.replace(
        warm,
        session_peak_bytes=max(warm.session_peak_bytes, floor),
        session_peak_bytes_with_hygiene=max(warm.session_peak_bytes_with_hygiene, floor),
        session_peak_bytes_without_hygiene=max(warm.session_peak_bytes_without_hygiene, floor),
    )


# ------------------------------------------------------------------------------ entry point
def estimate(model_or_path: ModelLike, *, dims: Mapping[str, int] | None = None, accuracy_level: int | None = None,
             session_options=None, hygiene: bool = False, calibration: Calibration | None = None) -> Estimate:
    """Predict session-creation peak, steady-state and activation memory without reading weight bytes.

    ``dims`` binds symbolic input dimensions (``{"batch": 1, "seq": 128}``); whatever stays symbolic is
    listed in ``unknown_shapes`` / ``unresolved_dims`` and counted as 0 bytes, never guessed.
    ``accuracy_level`` overrides ``session.qdq_matmulnbits_accuracy_level`` (ORT's default is 4);
    ``session_options`` (an ``onnxruntime.SessionOptions``) supplies the optimization level, execution
    order and session config. ``hygiene`` picks which of the two predictions fill the headline
    ``session_peak_bytes`` / ``steady_bytes``: resident memory with allocator hygiene around creation
    (True) or without (False, ORT as users run it); both are always in ``*_with_hygiene`` /
    ``*_without_hygiene``.
    """
    from ortmem.onnxfile.loader import load

    cal = calibration or Calibration.load().for_installed_release()
    owned = not isinstance(model_or_path, Model)
    model = load(model_or_path) if owned else model_or_path
    try:
        return _estimate(model, dict(dims or {}), accuracy_level, session_options, hygiene, cal)
    finally:
        if owned:
            model.close()


def _estimate(model: Model, dims: dict[str, int], accuracy_level, session_options, hygiene: bool,
              cal: Calibration) -> Estimate:
    st = session_settings(session_options, accuracy_level=accuracy_level)
    skeleton = model.skeleton
    root = og.build(skeleton.graph)
    shapes = shp.infer_shapes(skeleton, root, dims)
    model_file = Path(model.path).name
    plan = plan_model(root, skeleton, shapes, st, model_file)
    nchwc = st.graph_optimization_level >= 99 and bool(nchwc_block())
    estimator_ws = workspace_fn(plan, st, nchwc)

    def workspace(node: og.OrtNode, sh: shp.Shapes) -> int:
        return estimator_ws(node, sh) + act.kernel_temporaries(node, sh)

    # in-place reuse: the rule measured on ORT 1.31.1 that the planners use too (liveness.Context)
    rules = Context(skeleton, root, shapes, plan.removed, workspace, dims, st.execution_order, ort_view(skeleton))
    merged = ort_fusions(root) if st.graph_optimization_level >= 2 else {}  # Gelu/BiasGelu run as one kernel
    unknown: dict = {}
    act_peak, rows = _node_rows(root, shapes, st.execution_order, workspace, unknown, plan.removed,
                                rules.inplace_slots, merged)
    other = "PRIORITY_BASED" if st.execution_order == "DEFAULT" else "DEFAULT"
    other_peak = act.graph_activation(root, shapes, other, workspace, {}, plan.removed,
                                      inplace=rules.inplace_slots, merged=merged).peak_bytes

    # ortmem's own DQ -> Gather rewrite: on its side the table is never dequantized whole
    gathers = ortmem_gathers(root, skeleton, st)
    act_peak_ortmem = act_peak if not gathers.removed else act.graph_activation(
        root, shapes, st.execution_order, workspace, {}, plan.removed | gathers.removed,
        inplace=rules.inplace_slots, merged=merged).peak_bytes

    def side(all_external: bool, fixed: int, prepacked: bool = False) -> Side:
        tables = gathers.tables if all_external else None
        touch = run_touch(plan, shapes, root, all_external, tables)
        base = cal.baseline_bytes + cal.session_fixed_bytes + fixed
        sim = dict(all_external=all_external, activation_peak=act_peak_ortmem if all_external else act_peak,
                   run_touch=touch, prepacked=prepacked,
                   blobs_read_at_create=prepacked and capabilities().prepacked_validated)
        no = simulate(plan, dynamic=True, **sim)
        yes = simulate(plan, dynamic=False, **sim)
        kept = int(cal.retention_fraction * retention_basis(plan, all_external))
        no.after_create_rss += kept
        no.steady_rss += kept
        peak_no = base + max(no.peak_rss, no.after_create_rss + plan.largest_pack_source)
        peak_yes = base + yes.peak_in_use
        steady_no = base + cal.run_fixed_bytes + no.steady_rss
        steady_yes = base + cal.run_fixed_bytes + yes.steady_rss
        return Side(
            session_peak_bytes=peak_yes if hygiene else peak_no,
            steady_bytes=steady_yes if hygiene else steady_no,
            session_peak_bytes_with_hygiene=peak_yes,
            steady_bytes_with_hygiene=steady_yes,
            session_peak_bytes_without_hygiene=peak_no,
            steady_bytes_without_hygiene=steady_no,
            after_create_bytes_without_hygiene=base + no.after_create_rss,
            after_create_bytes_with_hygiene=base + yes.after_create_rss,
            in_use=yes.in_use,
            peak_at=no.peak_at,
        )

    ort_side = side(False, 0)
    # ortmem's own fixed costs: the session path a first ortmem.InferenceSession imports (no onnx: a
    # cold start's conversion imports are in cold_start), and what the hook holds beyond it on a
    # cache hit (calibration.json)
    hook_fixed = cal.ortmem_import_bytes + cal.ortmem_fixed_bytes
    ortmem_side = side(True, hook_fixed)
    converts = bool(plan.qdq or gathers.tables)
    cold_side = ortmem_side
    if converts:  # a model this large converts in a helper process (the session's process as a hit)
        in_helper = model_files_bytes(Path(model.path)) >= min_helper_bytes()
        cold_side = cold_start_in_helper(ortmem_side, cal) if in_helper else cold_start(ortmem_side, cal)
    # the hook keeps a cache entry (and pre-packs it on the first hit) only for a model it converts;
    # any other model is handed to ORT as it is, on every start
    # a release that saves no pre-packed weights (1.25) warm-starts from the entry itself
    saves = capabilities().prepacked_save
    prepacked_side = side(True, hook_fixed, prepacked=True) if plan.qdq and saves else ortmem_side
    storage: dict[str, int] = {"embedded": 0, "external": 0, "inline": 0}
    for w in plan.weights.values():
        storage[w.storage] += w.nbytes
    weights = {
        "total_bytes": sum(storage.values()),
        **{f"{k}_bytes": v for k, v in storage.items()},
        "qdq_fused_bytes": sum(ws.nbytes for _, _, _, srcs in plan.qdq for ws in [plan.weights[s] for s in srcs]),
        "folded_new_bytes": sum(nw.nbytes for nw in plan.folds if nw.by == "fold"),
        "nchwc_new_bytes": sum(nw.nbytes for nw in plan.nchwc),
        "packed_bytes": ort_side.in_use.get("packed_weights", 0),
        "retention_basis_bytes": retention_basis(plan, False),
    }
    notes = list(plan.notes)
    if cal.release_note():
        notes.insert(0, cal.release_note())
    if st.graph_optimization_level >= 1:
        notes.append("activations are computed on the graph as given; GELU/BiasGelu fused as ORT does; ORT's other fusions (layer norm, "
                     "attention, MatMul+Add) change intermediate tensors")
    return Estimate(
        model=str(model.path),
        settings={"graph_optimization_level": st.graph_optimization_level, "accuracy_level": st.accuracy_level,
                  "execution_order": st.execution_order, "prepacking": st.prepacking, "dims": dims,
                  "hygiene": hygiene, "calibration": cal.source},
        ort=ort_side,
        ortmem=ortmem_side,
        ortmem_prepacked=prepacked_side,
        ortmem_cold=cold_side,
        activation_peak_bytes=act_peak,
        activation_peak_bytes_by_order={st.execution_order: act_peak, other: other_peak},
        unknown_shapes=[asdict(u) for u in unknown.values()],
        unresolved_dims=sorted(shapes.unresolved_symbols),
        weights=weights,
        nodes=rows,
        baseline_bytes=cal.baseline_bytes,
        notes=notes,
        ortmem_import_bytes=cal.ortmem_import_bytes,
    )


