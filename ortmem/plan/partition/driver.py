"""Split an ONNX model into contiguous stages that fit per-device memory budgets, and write them.

``partition(model, {"cuda:0": 6 << 30, "cpu": 32 << 30})`` answers "which part of the graph runs on
which device", writes one sub-model per stage (all reading ONE shared weights file), and returns a
:class:`PartitionPlan` that :class:`ortmem.plan.partition.run.pipeline_session.PipelineSession` runs. docs/partition.md has the
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
3. **Modules.** :func:`ortmem.plan.partition.graph_modules.group_modules` groups the other nodes by name scope
   (``/model/layers.3/...``, or dotted names without slashes) or one by one, each module contiguous in
   execution order (an interrupted scope is split into runs, ``model~2``).
4. **Candidates.** :func:`ortmem.plan.partition.device_map.plan_placement` places the modules' weights with a
   bounded number of device changes (``devices - 1``, exact; a few more, heuristic: each change is
   another stage, session and set of crossing tensors), and :func:`~ortmem.plan.partition.stages._fill` fills the devices in
   preference order with one contiguous run each. Stages are maximal runs of nodes on one device.
5. **Fewer crossing tensors.** :func:`~ortmem.plan.partition.stages._improve_cuts` moves each cut, in whole modules, to the nearby
   boundary with the fewest tensors alive across the cuts (first: the fewest bytes alive across cuts
   between two nodes, ``node:<NODE>/<device>`` names) (or hands a stage to its neighbour) while
   both devices stay in budget and the earlier one gives up at most ``cut_slack`` of its budget; a
   cut inside a module is never made, so a pattern ORT fuses stays in one session.
6. **Choice.** Of the candidates whose stages fit (exact first-order costs: weights once per stage,
   a weight shared by two stages of one device credited back once, the stage's activation peak with
   crossing tensors on both sides, workspace, per-session overhead), the one with the most weight
   bytes on the earlier devices; one with fewer stages when within ``cut_slack`` of it everywhere.
7. **Verification** (CPU devices, ``verify=True``). Each stage's sub-model goes through the estimator,
   with what it misses about runs added (:func:`~ortmem.plan.partition.verify._estimate_stage`); devices over budget get a smaller
   planning budget, devices with room a larger one, and the plan is made again (up to
   :data:`MAX_ROUNDS`; the best plan that fits is kept).

What is written (``out_dir``)
-----------------------------
``weights.bin`` (a hard link to the source's external data file when every weight already lives in
one such file: no byte copied; otherwise every weight written once, page-aligned), ``stage<k>_<device>.onnx``
per stage (initializers referencing ``weights.bin``; graph inputs and outputs typed; subgraphs kept
whole with their node), ``plan.json`` and ``report.txt`` / ``report.json``. For a single CUDA device
beside CPU devices, also ``model_annotated.onnx`` and ORT's own settings (see :func:`ort_settings`).

Where the code lives
--------------------
This module is the driver (:func:`partition`: the rounds of step 7, the result, the output folder).
The steps live in ``ortmem/plan/partition_*.py``: ``partition_graph`` (steps 1-3: the graph, node
costs, modules), ``partition_stages`` (steps 4-6: stage costs, candidates, cuts), ``partition_verify``
(step 7: what the estimator says a stage holds), ``partition_submodels`` (a model per stage, crossing
tensors), ``partition_weights`` (the shared ``weights.bin``), ``partition_ort`` (ORT's one-session
settings), ``partition_plan`` (:class:`PartitionPlan`, ``plan.json``, the report) and
``partition_devices`` (device names to providers, per-session overhead).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

from ortmem.onnxfile.loader import load
from ortmem.onnxfile.model import Model
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og
from ortmem.errors import PlanError
from ortmem.plan.partition.graph_modules import ModuleTree, group_modules
from ortmem.plan.partition.devices import default_overhead, default_provider, is_cpu, resolve_provider, split_node
from ortmem.plan.partition.graph import PartitionGraph, module_names, node_costs
from ortmem.plan.partition.ort_session import ANNOTATED_FILE, annotated_model, ort_settings
from ortmem.plan.partition.partition_plan import PLAN_FILE, Crossing, DeviceReport, PartitionPlan, StageInfo
from ortmem.plan.partition.stages import CUT_WINDOW, choose_stages, StageCosts, module_boundaries
from ortmem.plan.partition.submodels import find_crossings, build_stage_models, StageGraph
from ortmem.plan.partition.verify import ARENA_STEADY, estimate_stage
from ortmem.files.layout import WEIGHTS_FILE  # the name of every weights file ortmem writes
from ortmem.plan.partition.stage_weights import WeightsLayout, plan_layout, write_stage_weights


log = logging.getLogger(__name__)

__all__ = [
    "CUT_WINDOW", "PLAN_FILE", "WEIGHTS_FILE", "Crossing", "DeviceReport", "PartitionPlan", "PlanError",
    "StageInfo", "default_provider", "ort_settings", "partition",
]

#: Rounds of "plan, verify with the estimator, shrink what was over / grow where room was left".
MAX_ROUNDS = 6


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
        overhead = [default_overhead(p, d) for (p, _), d in zip(providers, names)]
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
    G = PartitionGraph(model)
    if not G.order:
        raise PlanError("the model has no node to place")
    act_b, ws_b, notes = node_costs(G, model, dims, stats_csv)
    costs_list = G.set_costs(act_b, ws_b)
    tree = group_modules(G.planned_graph, costs_list, by=module_names(G.labels, by))
    if list(tree.order) != G.labels:
        raise PlanError("internal: module order and node order disagree")
    root = og.build(model.skeleton.graph)
    shapes_sym = shp.infer_shapes(model.skeleton, root, {})
    shapes_dims = shp.infer_shapes(model.skeleton, root, dims) if dims else shapes_sym
    layout = plan_layout(model, weights_mode)
    boundaries = module_boundaries(G, tree)
    n = len(names)
    # What the planner places: weights (additive but for shared ones). Activations are transient:
    # each device keeps ``reserve`` bytes for them (at first a typical module's, then what its stages
    # needed in the last round; a stage that needs more than its device's reserve is caught by the
    # first-order check in choose_stages, which shrinks that device's weight budget and plans again). On
    # verified CPU devices activations count ARENA_STEADY times (what ORT's arena holds in steady
    # state), and ``ratio`` is what the estimator says a first-order byte costs there (pre-packed
    # MatMulNBits hold 1.2-1.5x their codes...): the device's first-order costs are held to
    # budget / ratio. Both are re-measured on every round's plan (a device that was over shrinks, one
    # that had room grows); the best plan that fits is kept.
    stage_dir = Path(out_dir) if out_dir is not None else model.path.parent
    verify_dev = [verify and is_cpu(p) for p, _ in providers]
    act_mult = [float(ARENA_STEADY) if v else 1.0 for v in verify_dev]
    nodes = [split_node(d)[0] for d in names]
    costs = StageCosts(G, overhead, act_mult, nodes)
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
            placement, leaf_dev, stages = choose_stages(tree, sizes, G, costs, boundaries, names, caps, limits, budgets,
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
        models = build_stage_models(G, stages, shapes_sym, layout, WEIGHTS_FILE)
        est: list[int | None] = [None] * len(stages)
        for k, s in enumerate(stages):
            if verify_dev[s.device]:
                out_b = sum((shapes_dims.types.get("", {}).get(o) or shp.TensorShape(0, None)).nbytes() or 0
                            for o in models[k].outputs)
                est[k] = estimate_stage(models[k].proto, stage_dir / _stage_file(k, names[s.device]), dims, out_b)
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
            index=k, device=names[s.device], node=nodes[s.device], provider=prov, provider_options=dict(opts),
            file=_stage_file(k, names[s.device]) if out_dir is not None else "",
            nodes=sg.nodes, replicated=sg.replicated, modules=mods, inputs=sg.inputs, outputs=sg.outputs,
            weight_bytes=c.weight_bytes, activation_bytes=c.activation_bytes, workspace_bytes=c.workspace_bytes,
            overhead_bytes=overhead[s.device], estimated_bytes=est[k]))
    reports = []
    for j, d in enumerate(names):
        mine = [s for s in stage_infos if s.device == d]
        reports.append(DeviceReport(
            name=d, node=nodes[j], provider=providers[j][0], budget_bytes=budgets[j], planning_budget_bytes=caps[j],
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
        crossings=find_crossings(G, stages, shapes_dims), device_map=device_map,
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


def _write(plan: PartitionPlan, G: PartitionGraph, models: Sequence[StageGraph], layout: WeightsLayout, out: Path,
           stats_csv, stats_name: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _remove_previous(out)
    write_stage_weights(layout, out / WEIGHTS_FILE)
    for st, sg in zip(plan.stages, models):
        (out / st.file).write_bytes(sg.proto.SerializeToString())
    if plan.ort is not None:
        (out / ANNOTATED_FILE).write_bytes(annotated_model(G, models, plan, layout, WEIGHTS_FILE).SerializeToString())
        if stats_name is not None:
            shutil.copyfile(stats_csv, out / stats_name)
    plan.out_dir = str(out.resolve())
    plan.weights_file = WEIGHTS_FILE
    plan.save(out)
    (out / "report.txt").write_text(plan.report() + "\n")
    (out / "report.json").write_text(json.dumps(plan.report_dict(), indent=2) + "\n")
