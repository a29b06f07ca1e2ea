"""Trade compute for memory on inference graphs: recompute long-lived cheap tensors, and pick a node order
that lowers the activation peak.

ONNX Runtime's memory optimizer (``orttraining/core/optimizer/memory_optimizer``) recomputes cheap
activations, but only in training graphs. Inference graphs have the same problem in another form: a
tensor built once early and read late (the 4-D attention mask and rotary tables exporters build once
and hand to every layer, casts of shared inputs, long skip connections) sits in memory through every
layer's peak. This package finds such tensors on the liveness of ORT's own execution order
(:mod:`ortmem.plan.estimate.liveness`), reports what recomputing them would save, and rewrites the graph.

**Candidates.** For every arena buffer, its readers are split into *groups*: two consecutive readers
share a group unless some step between them holds more than both of them (then keeping the tensor
alive between them costs memory where it matters). The first group keeps the original; every later
group gets a *clone*: the smallest subgraph that produces the values the group reads from tensors
alive anyway at the group's first reader (graph inputs, initializers, ORT-folded constants, tensors
produced earlier and still read later), built only from deterministic ops on the allow-list below. A
clone is one *occurrence*; occurrences are clustered by *pattern* (the clone's op types in order,
``"Range+Greater+Where+...+"``, as ORT's summary names them).

**Cost classes.** ``free`` (shape/alias ops), ``cheap`` (element-wise, comparisons, data movement:
Cast, Expand, Tile, Where, Range, Gelu, Sigmoid, Cos, Slice, Concat, Gather, ...), ``expensive``
(MatMul, Gemm, Softmax, the LayerNorm family, reductions, Conv): used only when asked. Anything else
(random ops, control flow, unknown or contrib ops not listed) is never recomputed.

**Choosing.** Savings are never estimated: each cluster is *applied* and the rewritten graph's peak
recomputed with the same liveness model; a cluster is worth its saving at the peak divided by its
extra FLOPs. The greedy loop applies the best cluster, re-verifies the peak (recomputation can extend
the lives of its inputs, or a clone can land in the new peak), and repeats until the peak is under
the budget or nothing lowers it further. The chosen entries form the plan string
(``pattern:1:count,...``, ORT's memory-optimizer syntax; count ``-1`` = all occurrences, ``N`` = the
``N`` clones nearest the end of the run); applying a plan replays the same steps.

**Order.** ORT decides when a clone runs, not the file: ``DEFAULT`` is a reverse DFS from the graph
outputs (``Graph::ReverseDFSFrom`` in ``onnxruntime/core/graph/graph.cc``, called from
``GraphViewer::GraphViewer`` in ``graph_viewer.cc``) that expands a node's inputs highest index first,
so an input produced by a *low-index* node is emitted last, right before its consumer.
``PRIORITY_BASED`` is Kahn's sort with ``PriorityNodeCompare`` (Shape/Size first, then lower index):
it follows the file order. Both break ties by node index, and nodes ORT's optimizers create at level
>= 1 (fusions) get the highest indices, so both are predictable only on the graph ORT has already
optimized: plan on :func:`ortmem.plan.estimate.liveness.ort_optimized` (the CLI does by default). Two
placements are planned, replayed and scored, and the lower peak wins (DEFAULT on a tie):

* ``DEFAULT``: each clone is placed in the file right after the producers of its inputs (at the front
  when it reads only graph inputs); the reverse DFS then emits it just before its readers;
* ``PRIORITY_BASED`` (always with ``order=True``): the file is written in the order ORT runs now, each
  clone at the step before its readers where its own transient plus its result held until the
  readers costs least.

The chosen kind is recorded in ``metadata_props`` (``ortmem.recompute.execution_order``) together with
``ortmem.recompute.disabled_optimizers = CommonSubexpressionElimination``: ORT's CSE (level 1,
``onnxruntime/core/optimizer/common_subexpression_elimination.cc``) merges nodes with the same op,
attributes and inputs, i.e. exactly our clones, back into one (checked on 1.31.1); the session config
key ``optimization.disable_specified_optimizers`` turns it off.

**The guard.** The live set is what the plan lowers; ORT's arena (power-of-two growth, chunks not
split below half) and memory patterns (one block per run laid out by first fit, kernel scratch beside
it) decide resident memory under ORT's defaults, and a rewrite can lower the first and raise the
second. :func:`verify` measures both models under the defaults in fresh processes; the CLI refuses a
rewrite it finds worse.

**Peak-minimizing order.** Candidates (ORT's two orders; greedy list schedules that prefer the ready
node with the lowest immediate footprint, or the largest release; a beam search over list schedules
keeping the best partial schedule per set of executed nodes) improved by local moves around the
peak (sink the exclusive producer cone of a buffer alive across the peak to just before its first
reader; hoist a reader and its missing ancestors before the peak), each scored exactly with
``PRIORITY_BASED``'s own replay of the rewritten file. :func:`exhaustive_order` enumerates every
topological order of a small graph, for the tests.

Outputs are bit-identical: a clone runs the same kernel on the same inputs as its original (ORT's CPU
kernels are deterministic for a given shape and thread count; the allow-list holds no reduction whose
blocking could depend on position in the run).

**Modules**, in the order the method uses them: ``cost`` (the allow-list, FLOPs), ``state`` (a model
under analysis), ``discovery`` (occurrences and clusters), ``rewrite`` (clones placed, reorders),
``orders`` (peak-minimizing orders), ``plan_settings`` (plan strings; the session settings a rewrite
records live in :mod:`ortmem.ort.recorded_settings`, where the session replays them), ``planner``
(the greedy plan, the rewritten model, the summary), ``guard`` (fresh-process measurement),
``recompute_command`` (``ortmem recompute``, which writes the model any session runs).
"""
from __future__ import annotations

from ortmem.base.lazy import lazy_attributes

_OWNERS = {
    "plan": "ortmem.plan.recompute.planner",
    "materialize": "ortmem.plan.recompute.planner",
    "render": "ortmem.plan.recompute.planner",
    "recorded_settings": "ortmem.ort.recorded_settings",
    "Result": "ortmem.plan.recompute.planner",
    "verify": "ortmem.plan.recompute.guard",
    "Verdict": "ortmem.plan.recompute.guard",
    "probe_default": "ortmem.plan.recompute.guard",
    "probe_live": "ortmem.plan.recompute.guard",
    "PlanEntry": "ortmem.plan.recompute.plan_settings",
    "parse_plan": "ortmem.plan.recompute.plan_settings",
    "format_plan": "ortmem.plan.recompute.plan_settings",
    "apply_session_changes": "ortmem.ort.recorded_settings",
    "merge_config_value": "ortmem.ort.recorded_settings",
    "CSE": "ortmem.plan.recompute.plan_settings",
    "DISABLE_OPTIMIZERS_KEY": "ortmem.ort.recorded_settings",
    "META_PREFIX": "ortmem.plan.recompute.plan_settings",
    "cost_class": "ortmem.plan.recompute.cost",
    "discover": "ortmem.plan.recompute.discovery",
    "clusters": "ortmem.plan.recompute.discovery",
    "initial_state": "ortmem.plan.recompute.state",
    "best_order": "ortmem.plan.recompute.orders",
    "evaluate_order": "ortmem.plan.recompute.orders",
    "exhaustive_order": "ortmem.plan.recompute.orders",
    "add_recompute_arguments": "ortmem.plan.recompute.recompute_command",
    "main_recompute": "ortmem.plan.recompute.recompute_command",
}
__all__ = list(_OWNERS)
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
