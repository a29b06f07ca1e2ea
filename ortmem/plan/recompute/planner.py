"""The planner: clusters applied greedily by saving per FLOP until the budget is met, the rewritten model, the summary.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import onnx
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og
from ortmem.plan.estimate.liveness import Context, ModelLike, analyze, context
from ortmem.plan.recompute.discovery import Cluster, Occurrence, clusters, discover
from ortmem.plan.recompute.orders import best_order
from ortmem.plan.recompute.rewrite import apply, reorder
from ortmem.ort.recorded_settings import DISABLE_OPTIMIZERS_KEY, recorded_settings, session_changes_for  # noqa: F401 - recorded_settings: re-exported
from ortmem.plan.recompute.plan_settings import CSE, META_PREFIX, ORT_OPTIMIZED_KEY, PLAN_VERSION, PlanEntry, format_plan, parse_plan
from ortmem.plan.recompute.state import State, initial_state
from ortmem.base.units import MiB


@dataclass
class ClusterReport:
    """One row of the summary."""

    pattern: str
    cost_class: str
    occurrences: int
    tensors: list[dict[str, Any]]  # name, dims symbolic / resolved, bytes
    saved_bytes: int  # at the peak, applying this cluster alone to the original (exact)
    extra_flops: int
    plan: str
    chosen: bool = False


@dataclass
class Result:
    """What the planner decided, and the rewritten model's node list."""

    model: str
    dims: dict[str, int]
    execution_order: str  # what ORT must be told
    original_peak_bytes: int
    original_peak_bytes_by_order: dict[str, int]
    peak_bytes: int  # predicted, with the plan (and order) applied
    budget_bytes: int | None
    plan: str
    order_applied: bool
    clusters: list[ClusterReport]
    steps: list[dict[str, Any]]  # each greedy choice with the peak re-verified after it
    notes: list[str]
    state: State | None = None
    original: State | None = None
    baseline: str = "DEFAULT"  # what original_peak_bytes counts: ORT's DEFAULT order, or the file's order
    changed: bool = False  # something (nodes, order, or the file itself) is worth shipping

    @property
    def saved_bytes(self) -> int:
        return self.original_peak_bytes - self.peak_bytes

    @property
    def has_clones(self) -> bool:
        entries = self.state.entries if self.state is not None else []
        return self.changed and any(e[0] == "new" and "__rc" in e[1].name for e in entries)

    def session_changes(self) -> dict[str, Any]:
        """How the session must be created for the prediction to hold (empty when nothing changed):
        ``{"execution_order": "DEFAULT" | "PRIORITY_BASED", "session_config": {key: value}}``."""
        if not self.changed:
            return {}
        return session_changes_for(self.execution_order, [CSE] if self.has_clones else [])

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("state", "original")}
        d["saved_bytes"] = self.saved_bytes
        d["clusters"] = [asdict(c) for c in self.clusters]
        d["session_changes"] = self.session_changes()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _dims_pair(ctx: Context, name: str) -> dict[str, Any]:
    return {"name": name, "dims": ctx.symbolic_dims(name), "resolved": ctx.dims_of(name), "bytes": ctx.nbytes(name)}


def _select(cluster: Cluster, count: int) -> list[Occurrence]:
    return list(cluster.occurrences if count == -1 else cluster.occurrences[:count])


def plan(model: ModelLike, dims: Mapping[str, int] | None = None, *, budget: int | None = None,
         plan_text: str | None = None, order: bool = False, expensive: bool = False, max_rounds: int = 32,
         ctx: Context | None = None, session_options=None, baseline: str | None = None,
         min_saved_bytes: int | None = None) -> Result:
    """Decide a recompute plan (and optionally an order) for ``model`` at ``dims``.

    ``plan_text`` applies exactly that plan; otherwise clusters are chosen greedily by savings per
    FLOP until the predicted peak is at most ``budget`` (None: as low as recompute gets it). The peak
    is re-verified after each choice; nothing that does not lower it is applied. ``expensive`` allows
    the expensive class (MatMul, Softmax, LayerNorm, ...). ``order`` adds the peak-minimizing order
    (then the model runs with ``PRIORITY_BASED``); it is kept only if it lowers the peak further.

    ``baseline`` is the order the savings are counted from, what the user runs today: ``"DEFAULT"``
    (ORT's default order of this file) or ``"file"`` (the file's own node order). ORT writes an
    optimized model in exactly the order it executed the model it optimized (``Graph::ToGraphProto``
    walks ``GraphViewer``'s default topological order; checked on 1.31.1: equal node for node), so for
    a graph from :func:`ortmem.plan.estimate.liveness.ort_optimized` the file order *is* the original model's
    run; None picks ``"file"`` when the model carries ``ortmem.ort_optimized`` in its metadata.
    ``min_saved_bytes`` (default: 1% of the baseline peak, at least one arena granule) is the least saving worth
    a rewrite: below it the model is left as is, since ORT's arena can lose more than that to a new
    layout (see :func:`verify`).
    """
    ctx = ctx or context(model, dims, session_options=session_options)
    if baseline is None:
        baseline = "file" if any(p.key == ORT_OPTIMIZED_KEY for p in ctx.model.metadata_props) else "DEFAULT"
    if baseline not in ("DEFAULT", "file"):
        raise ValueError(f"baseline must be 'DEFAULT' or 'file', not {baseline!r}")
    classes = ("free", "cheap", "expensive") if expensive else ("free", "cheap")
    kinds: list[og.ExecutionOrder] = ["DEFAULT", "PRIORITY_BASED"]  # recompute placed for either, then (order) reordered
    results = [_plan_kind(ctx, kind, classes, budget, plan_text, order, max_rounds, baseline, min_saved_bytes)
               for kind in kinds]
    # the lowest predicted peak; on a tie DEFAULT, whose clone placement survives ORT renumbering nodes
    return min(results, key=lambda r: (r.peak_bytes, r.execution_order != "DEFAULT"))


def _replay(state: State, entries: Sequence[PlanEntry], classes: Sequence[str],
            notes: list[str] | None = None, steps: list[dict[str, Any]] | None = None) -> State:
    """``entries`` applied one after the other, each to the clusters discovered on the state before it."""
    for entry in entries:
        if entry.strategy == 0:
            continue
        cl = next((c for c in clusters(discover(state, classes)) if c.pattern == entry.pattern), None)
        if cl is None:
            if notes is not None:
                notes.append(f"plan entry {entry} matches nothing in this model")
            continue
        state, applied = apply(state, _select(cl, entry.count))
        if steps is not None:
            steps.append({"entry": str(entry), "occurrences": len(applied), "peak_bytes": state.peak})
    return state


def _plan_kind(ctx: Context, kind: og.ExecutionOrder, classes: Sequence[str], budget: int | None,
               plan_text: str | None, order: bool, max_rounds: int, baseline: str = "DEFAULT",
               min_saved_bytes: int | None = None) -> Result:
    orig = initial_state(ctx, "DEFAULT")
    by_order = {"DEFAULT": orig.peak, "PRIORITY_BASED": initial_state(ctx, "PRIORITY_BASED").peak}
    if baseline == "file":
        by_order["file"] = analyze(ctx, list(range(len(ctx.root.nodes)))).peak_bytes
    base_peak = by_order["file" if baseline == "file" else "DEFAULT"]
    notes: list[str] = []
    if orig.liveness.unknown:
        notes.append(f"{len(orig.liveness.unknown)} tensors have unknown sizes (counted as 0): pass every "
                     "symbolic dimension with --dim NAME=VALUE")
    start = initial_state(ctx, kind)

    # the summary: every cluster on the original, scored alone (exact)
    reports: list[ClusterReport] = []
    for cl in clusters(discover(start, classes)):
        st2, applied = apply(start, cl.occurrences)
        saved = start.peak - st2.peak if applied else 0
        reports.append(ClusterReport(cl.pattern, cl.cost_class, len(cl.occurrences),
                                     [_dims_pair(ctx, t) for t in cl.tensors], saved, cl.flops,
                                     str(PlanEntry(cl.pattern))))

    state = start
    steps: list[dict[str, Any]] = []
    chosen: list[PlanEntry] = []
    if plan_text is not None:
        chosen = [e for e in parse_plan(plan_text) if e.strategy == 1]
        state = _replay(state, chosen, classes, notes, steps)
    else:
        for _ in range(max_rounds):
            if budget is not None and state.peak <= budget:
                break
            best = None
            for cl in clusters(discover(state, classes)):
                new, applied = apply(state, cl.occurrences)
                saved = state.peak - new.peak
                if not applied or saved <= 0:
                    continue
                score = (saved / (cl.flops + 1), saved)
                if best is None or score > best[0]:
                    best = (score, cl, new, len(applied))
            if best is None:
                break
            _, cl, new, n = best
            steps.append({"entry": str(PlanEntry(cl.pattern)), "occurrences": n, "saved_bytes": state.peak - new.peak,
                          "peak_bytes": new.peak})
            chosen.append(PlanEntry(cl.pattern))
            state = new
        if len(chosen) > 1:  # greedy is path-dependent: drop a choice the final plan does better without
            for entry in list(chosen):
                trial = [e for e in chosen if e != entry]
                alt = _replay(start, trial, classes)
                if alt.peak <= state.peak and (budget is None or alt.peak <= budget or state.peak > budget):
                    steps.append({"entry": f"dropped {entry}", "peak_bytes": alt.peak})
                    chosen, state = trial, alt
        if budget is not None and state.peak > budget:
            notes.append(f"budget {budget} B not reached: recompute gets the peak to {state.peak} B")
    chosen_patterns = {e.pattern for e in chosen}
    for r in reports:
        r.chosen = r.pattern in chosen_patterns

    order_applied = False
    if order:
        res = best_order(state.ctx)
        if res.peak_bytes < state.peak:
            new = reorder(state, res.order)
            if new.peak < state.peak:
                steps.append({"entry": "order", "peak_bytes": new.peak, "saved_bytes": state.peak - new.peak})
                state = new
                order_applied = True
        if not order_applied:
            notes.append("no order found below the current peak")
    final_kind = state.kind
    differs = state.base is not None or final_kind != "DEFAULT" or baseline == "file"
    least = max(shp.ARENA_GRANULE, base_peak // 100) if min_saved_bytes is None else min_saved_bytes
    changed = differs and base_peak - state.peak >= max(least, 1)
    if differs and 0 < base_peak - state.peak < least:
        notes.append(f"the best rewrite saves {(base_peak - state.peak) / MiB:.2f} MiB, under the "
                     f"{least / MiB:.2f} MiB worth a new layout: nothing applied")
    if not changed:
        # never ship a rewrite (or an order switch) that does not lower the peak of what runs today
        if state.base is not None:
            notes.append("the rewrite does not lower the predicted peak: nothing applied")
        state, final_kind, chosen, order_applied = orig, "DEFAULT", [], False
        for r in reports:
            r.chosen = False
    name = ctx.model.graph.name
    return Result(name, dict(ctx.dims), final_kind, base_peak, by_order, state.peak if changed else base_peak, budget,
                  format_plan(chosen), order_applied, reports, steps, notes, state, orig, baseline, changed)


# ------------------------------------------------------------------------------------ materialize
def materialize(result: Result, full: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """The rewritten model: ``full`` (the original model with its weights, or None for the analysed
    skeleton) with the planned node list, and the run settings in ``metadata_props``. Initializers are
    not touched (nor read)."""
    base = full if full is not None else result.original.ctx.model  # type: ignore[union-attr]
    if result.state is None or not result.changed:
        return base
    src = list(base.graph.node)
    nodes = [src[e[1]] if e[0] == "keep" else e[1] for e in result.state.entries]
    out = onnx.ModelProto()
    g = base.graph
    saved = list(g.node)
    del g.node[:]
    try:
        out.CopyFrom(base)
    finally:
        g.node.extend(saved)
    out.graph.node.extend(nodes)
    # value_info of recomputed values: copies of the originals'
    vi = {v.name: v for v in base.graph.value_info}
    for e in result.state.entries:
        if e[0] == "new":
            for o in e[1].output:
                if "__rc" in o:
                    orig = o.split("__rc")[0]
                    if orig in vi:
                        c = out.graph.value_info.add()
                        c.CopyFrom(vi[orig])
                        c.name = o
    meta = {
        "execution_order": result.execution_order,
        "disabled_optimizers": CSE if result.has_clones else "",
        "plan": result.plan,
        "order": "1" if result.order_applied else "0",
        "dims": json.dumps(result.dims, sort_keys=True),
        "original_peak_bytes": str(result.original_peak_bytes),
        "predicted_peak_bytes": str(result.peak_bytes),
        "version": PLAN_VERSION,
    }
    keep = [p for p in out.metadata_props if not p.key.startswith(META_PREFIX)]
    del out.metadata_props[:]
    out.metadata_props.extend(keep)
    for k, v in meta.items():
        p = out.metadata_props.add()
        p.key, p.value = META_PREFIX + k, v
    return out


# ------------------------------------------------------------------------------------ the summary
def render(result: Result) -> str:
    """ORT-style memory-optimizer summary: one row per pattern, with the plan string that enables it."""
    m = lambda b: f"{b / MiB:,.2f} MiB"  # noqa: E731
    lines = [
        "=" * 100,
        f"ortmem recompute summary: {result.model}  dims {result.dims}",
        f"activation peak, as ORT runs the model today: {m(result.original_peak_bytes)} "
        + ("(the file's node order, which is ORT's order for the model it optimized)" if result.baseline == "file"
           else "(ExecutionOrder.DEFAULT)")
        + f"; ORT's orders of this file: DEFAULT {m(result.original_peak_bytes_by_order['DEFAULT'])}, "
        f"PRIORITY_BASED {m(result.original_peak_bytes_by_order['PRIORITY_BASED'])}",
        f"activation peak, with the plan: {m(result.peak_bytes)}  (saves {m(result.saved_bytes)}, "
        f"run with ExecutionOrder.{result.execution_order}"
        + (f", config {DISABLE_OPTIMIZERS_KEY}={CSE}" if result.has_clones else "")
        + ")",
        f"plan: {result.plan or '(none)'}" + ("  + peak-minimizing order" if result.order_applied else ""),
        "-" * 100,
        "|Freq | Recompute opportunities (clustered by pattern; each row is one plan entry)",
        "|_____|" + "_" * 93,
    ]
    if not result.clusters:
        lines.append("|0    | none: no buffer read by two reader groups can be rebuilt from the allow-list")
    floor = result.original_peak_bytes // 100
    shown = [r for r in result.clusters if r.chosen or abs(r.saved_bytes) >= max(floor, 1) or
             max((t["bytes"] for t in r.tensors), default=0) >= floor]
    for r in sorted(shown, key=lambda r: (-r.saved_bytes, r.pattern)):
        lines.append(f"|{r.occurrences:<5}|>>Recompute {r.pattern}")
        status = "Enabled (chosen)" if r.chosen else f"Disabled. Enable with --plan '{r.plan}'"
        lines.append(f"|     |  Status       : {status}")
        for t in r.tensors[:4]:
            lines.append(f"|     |  Tensor       : {t['name']}  {t['dims']} = {t['resolved']}  {m(t['bytes'])}")
        if len(r.tensors) > 4:
            lines.append(f"|     |  ... and {len(r.tensors) - 4} more tensors")
        lines.append(f"|     |  Saved at peak: {m(r.saved_bytes)} (this row alone, verified on the rewritten graph)")
        lines.append(f"|     |  Extra compute: {r.extra_flops / 1e6:,.1f} MFLOP per run ({r.cost_class})")
        lines.append("|_____|" + "_" * 93)
    if len(shown) < len(result.clusters):
        lines.append(f"|     | {len(result.clusters) - len(shown)} more patterns of tensors under 1% of the peak, saving "
                     "nothing at it (in --json)")
    for s in result.steps:
        extra = f", {s['occurrences']} clones" if "occurrences" in s else ""
        saved = f", saves {m(s['saved_bytes'])}" if "saved_bytes" in s else ""
        lines.append(f"step: {s['entry']}{extra} -> peak {m(s['peak_bytes'])}{saved} (re-verified)")
    lines += [f"note: {n}" for n in result.notes]
    lines.append("=" * 100)
    return "\n".join(lines)


