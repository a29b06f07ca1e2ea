"""Which ``DequantizeLinear -> MatMul/Gemm`` pairs ONNX Runtime 1.31.1 turns into ``MatMulNBits``, and why not.

Why this exists
---------------
ortmem rewrites ``DQ(W) -> MatMul`` into ``com.microsoft.MatMulNBits`` itself, ahead of time, so that ORT
never copies and transposes the weights inside session creation. The rewrite must pick exactly the nodes
ORT's own rule picks, otherwise ortmem changes numerics (``accuracy_level``) or kernels where ORT would
not, or leaves a DQ that ORT would have fused. ORT is the authority, so every condition here cites the
ORT source it comes from (paths relative to github.com/microsoft/onnxruntime, ORT 1.31.1); the full
write-up with quotes is ``docs/ort-fusion-rules.md``, and ``tests/passes/rules/test_dq_matmul_match.py`` asks ORT itself,
model by model, whether it fused each node.

What is modelled
----------------
ORT decides in two optimizer levels, so this module replays the parts of both that matter:

* Level 1 (``ORT_ENABLE_BASIC`` and up), ``core/optimizer/graph_transformer_utils.cc``:
  - Constant nodes become initializers (``Graph::Graph``);
  - ``ConstantSharing`` (``core/optimizer/constant_sharing.cc``, main graph only) merges constant
    single-value initializers (rank 0 or shape [1]; float/float16/double/int32/int64) of equal
    type, rank and value into one. Two per-tensor DQs with the same scale value therefore end up
    *sharing* their scale;
  - ``MatMulAddFusion`` (``core/optimizer/matmul_add_fusion.cc``) turns ``MatMul -> Add`` into ``Gemm``
    (with Reshapes around it for N-D inputs of static shape);
  - ``EnsureUniqueDQForNodeUnit`` (``core/optimizer/qdq_transformer/ensure_unique_dq_for_node_unit.cc``)
    gives every consumer of a DQ its own copy of the DQ, which makes the copies share ``W`` and ``scale``.
* Level 2 (``ORT_ENABLE_EXTENDED`` and up):
  - ``QDQSelectorActionTransformer``'s rule ``DQMatMulToMatMulNBits`` on MatMul and Gemm nodes
    (``DQMatMulNodeGroupSelector::Check`` in ``.../selectors_actions/qdq_selectors.cc``, the action
    ``DQMatMulToMatMulNBitsAction`` in ``.../selectors_actions/qdq_actions.cc``);
  - ``MatMulNBitsFusion`` (``core/optimizer/matmul_nbits_fusion.cc``) which folds a following ``Add`` of a
    ``[N]`` bias into MatMulNBits input 5.

Where each part lives: the Level-1 transformers are models of ORT, in ``ortmem.ort``
(:mod:`~ortmem.ort.constant_sharing`, :mod:`~ortmem.ort.matmul_add_fusion` with
:mod:`~ortmem.ort.attention_pattern`), on :class:`~ortmem.ort.fusion_graph.FusionGraph`;
the rule's checks, one function each in ORT's order, are :mod:`.dq_matmul_checks`; this module walks
the graphs and turns each DQ -> MatMul/Gemm pair into a :class:`Candidate` or a
:class:`~ortmem.passes.rules.dq_match.Rejected`.

Subgraphs (If/Loop/Scan bodies) are handled the way ORT does: every one of these transformers recurses
into them except ConstantSharing, and constancy of an initializer is looked up in outer scopes too
(``Graph::GetConstantInitializer(name, check_outer_scope=true)``).

Not modelled (rare for exported QDQ models; documented in docs/ort-fusion-rules.md): other Level-1
rewrites that can create or destroy the pattern (Identity/Cast elimination between DQ and MatMul,
``GemmTransposeFusion``, ``GemmSumFusion``, common-subexpression elimination of MatMuls, constant folding
of a non-DQ weight path), ``session.disable_quant_qdq`` constant folding, execution providers other
than CPU, and the opt-in ``DQMatMulNBitsFusion`` (``session.enable_dq_matmulnbits_fusion``).

The matcher reads only metadata (TensorProto ``data_type`` and ``dims``, attributes, graph structure);
the types and shapes of activations are the ones the installed ORT resolves
(:mod:`ortmem.ort.value_types`), asked only when a rule needs one.
The one exception is ConstantSharing, which compares *values* of single-element initializers: those are
read when embedded; for external ones pass ``scalar_reader`` or accept a note on the affected candidates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Mapping

from onnx import GraphProto, ModelProto

from ortmem.base.records import record
from ortmem.onnxfile.walk import node_label, node_subgraphs, subgraph_path
from ortmem.ort.constant_sharing import ScalarReader, constant_sharing_groups
from ortmem.ort.fusion_graph import LEVEL_BASIC, FusionGraph, fusion_graphs, tensor_type_name
from ortmem.ort.release import capabilities
from ortmem.ort.settings import OrtSettings
from ortmem.passes.rules import dq_matmul_checks as checks
from ortmem.passes.rules.dq_match import OrtOutcome, Reject, Rejected, dequantize_nodes, is_onnx_domain

__all__ = ["Candidate", "MatchResult", "dq_matmul_match"]


@dataclass(frozen=True)
class Candidate:
    """One DQ+MatMul/Gemm that ORT's ``DQMatMulToMatMulNBits`` rule selects.

    ``node``/``node_index`` name the MatMul or Gemm *as it is in the input model*; ``ort_node_name`` is the
    name ORT gives the MatMulNBits (``"<matmul>/MatMulAddFusion"`` when Level-1 MatMulAddFusion turned
    MatMul+Add into a Gemm first). ``block_size`` is the MatMulNBits block size, i.e. after the expansion
    of per-tensor/per-channel scales to blocks of ``session.qdq_matmulnbits_block_size``. ``bias`` is the
    tensor ORT wires to MatMulNBits input 5 (Gemm ``C`` or the folded Add's other input) and ``fold_add``
    the Add node that disappears. ``output`` is the tensor that finally carries the product.
    ``ort_outcome`` is ``"converted"`` unless ORT 1.31.1 gets this case wrong (``"converted_wrong"``:
    it fuses with wrong numbers; ``"session_error"``: its rule selects the node but session creation then
    fails) - ``notes`` says why; ortmem can do these correctly itself.
    """

    graph_path: str
    node: str
    node_index: int
    op: Literal["MatMul", "Gemm"]
    dq_node: str
    dq_index: int
    weight: str
    scale: str
    zero_point: str | None
    weight_dtype: int
    bits: int
    signed: bool
    K: int
    N: int
    block_size: int
    kind: Literal["blockwise", "per-channel", "per-tensor"]
    scale_dtype: int
    has_zp: bool
    input_a: str
    bias: str | None
    fold_add: str | None
    output: str
    fusion: tuple[str, ...]
    ort_node_name: str
    accuracy_level: int
    ort_outcome: OrtOutcome = "converted"
    notes: tuple[str, ...] = ()

    @property
    def node_name(self) -> str:
        """The MatMul/Gemm label (what a listing such as ``ortmem inspect`` shows)."""
        return f"{self.graph_path}:{self.node}" if self.graph_path else self.node

    def describe(self) -> str:
        """One line for people: what ORT makes of this pair."""
        zp = "zp" if self.has_zp else "no zp"
        text = (f"{tensor_type_name(self.weight_dtype)} {self.kind} [{self.K}, {self.N}] ({zp}, {tensor_type_name(self.scale_dtype)} scales) "
                f"-> MatMulNBits bits={self.bits} block_size={self.block_size} accuracy_level={self.accuracy_level}")
        if self.bias:
            text += f", bias {self.bias}" + (f" folded from {self.fold_add}" if self.fold_add else "")
        if self.ort_outcome != "converted":
            text += f" [ORT: {self.ort_outcome}: {'; '.join(self.notes)}]"
        return text



@record
class MatchResult:
    candidates: list[Candidate]
    rejected: list[Rejected]


def evaluate(g: FusionGraph, dq_idx: int, cons_idx: int, slot: int, settings: OrtSettings,
             sharing: dict[str, set[int]], sharing_unknown: set[str], block_max: int = checks.MAX_BLOCK,
             shared_guard: bool = True) -> Candidate:
    """The Candidate, or :class:`~ortmem.passes.rules.dq_match.Reject` from the first check that fails, in
    the order ORT checks (:mod:`.dq_matmul_checks`)."""
    dq, cons = g.nodes[dq_idx], g.nodes[cons_idx]
    checks.check_weight_input(g, cons_idx, slot)
    checks.check_settings(settings)
    target = checks.level1_target(g, cons_idx, settings)
    checks.check_output_consumers(g, target)
    checks.check_dq_inputs(g, target)
    w_name, s_name = dq.input[0], dq.input[1]
    zp_name = dq.input[2] if len(dq.input) > 2 else None
    w_const = g.constant_initializer(w_name)
    bias = checks.check_gemm(g, target, w_name, w_const)
    # Releases before the shared-initializer guard (1.25) fuse these too; ortmem then leaves them to ORT.
    shared_note: str | None = None
    try:
        checks.check_shared_initializers(g, dq_idx, (cons_idx, slot), sharing)
    except Reject as r:
        if shared_guard:
            raise
        shared_note = (f"{r.reason} - not on this onnxruntime, which has no shared-initializer guard and fuses it; "
                       "ortmem's rewrite does not split shared initializers, so ORT fuses it itself")
    w_type, s_type = checks.check_types(g, w_name, s_name)
    consts = checks.check_constants(g, w_name, s_name, zp_name, w_const)
    K, N = checks.check_weight_rank(w_name, consts[0])
    kind, block = checks.check_granularity(dq, K, N, consts[1], consts[2], settings, block_max)
    bits, signed = checks.NBITS[w_type]
    outcome, notes = checks.ort_defects(g, dq, consts, bits, N)
    if g.parent is None and s_name in sharing_unknown:
        notes.append(f"scale {s_name} is a single value stored externally; if it equals another single-value constant "
                     "ConstantSharing would merge them and ORT would reject this fusion (pass scalar_reader to decide)")
    fold = checks.fold_following_add(g, target, bias, N, settings)
    if target.add and target.add.need_reshape:
        notes.append("A is not 2-D: MatMulAddFusion wraps the Gemm in Reshape nodes (A -> [M, K], Y -> original shape)")
    fusion = target.fusion
    fusion.insert(len(fusion) - (1 if "MatMulNBitsFusion" in fusion else 0), "DQMatMulToMatMulNBits")
    return Candidate(
        graph_path=g.path, node=g.label(cons_idx), node_index=cons_idx,
        op="Gemm" if cons.op_type == "Gemm" else "MatMul",
        dq_node=g.label(dq_idx), dq_index=dq_idx,
        weight=w_name, scale=s_name, zero_point=zp_name,
        weight_dtype=w_type, bits=bits, signed=signed, K=K, N=N, block_size=block, kind=kind,
        scale_dtype=s_type, has_zp=zp_name is not None,
        input_a=cons.input[0], bias=fold.bias or None, fold_add=fold.fold_add, output=fold.output,
        fusion=tuple(fusion), ort_node_name=target.name,
        accuracy_level=settings.accuracy_level,
        ort_outcome="fused_by_ort" if shared_note else outcome,
        notes=tuple(notes) + ((shared_note,) if shared_note else ()))


def _as_settings(settings: OrtSettings | None, graph_optimization_level, session_config, disabled_optimizers) -> OrtSettings:
    if settings is not None:
        return settings
    return OrtSettings(int(graph_optimization_level), dict(session_config or {}), frozenset(disabled_optimizers or ()))


def dq_matmul_match(
    model: ModelProto,
    *,
    graph_optimization_level: int = 99,
    session_config: Mapping[str, str] | None = None,
    disabled_optimizers: Iterable[str] = (),
    settings: OrtSettings | None = None,
    scalar_reader: ScalarReader | None = None,
    block_max: int | None = None,
    shared_guard: bool | None = None,
) -> MatchResult:
    """Every DQ -> MatMul/Gemm pair of ``model`` (subgraphs included): what ORT 1.31.1 fuses, and why not.

    ``block_max``: the largest DQ block size the installed ORT's rule fuses; ``shared_guard``: whether it
    rejects DQs whose weight or scale has other consumers (PR #28326). None asks
    :func:`ortmem.ort.release.capabilities` (the one place that knows the release).

    Pure: reads graph structure, attributes and tensor metadata only (never weight bytes; see module
    docstring for the single-value exception). The defaults are ORT's defaults (``ORT_ENABLE_ALL``,
    accuracy level 4, block size 32 for expansion). Raises ValueError for session settings that make ORT
    fail session creation outright (accuracy level outside 0..4).
    """
    st = _as_settings(settings, graph_optimization_level, session_config, disabled_optimizers)
    st.accuracy_level  # validate eagerly: ORT fails in the transformer's constructor  # noqa: B018
    if block_max is None or shared_guard is None:
        caps = capabilities()
        block_max = caps.fusion_block_max if block_max is None else block_max
        shared_guard = caps.shared_initializer_guard if shared_guard is None else shared_guard
    candidates: list[Candidate] = []
    rejected: list[Rejected] = []
    for g in fusion_graphs(model):
        sharing, unknown = (constant_sharing_groups(g, scalar_reader)
                            if st.graph_optimization_level >= LEVEL_BASIC and st.enabled("ConstantSharing")
                            else ({}, set()))
        for dq_idx, dq in dequantize_nodes(g):
            for cons_idx, slot in g.consumers(dq.output[0]):
                cons = g.nodes[cons_idx]
                if cons.op_type not in ("MatMul", "Gemm") or not is_onnx_domain(cons):
                    continue
                try:
                    candidates.append(evaluate(g, dq_idx, cons_idx, slot, st, sharing, unknown, block_max, shared_guard))
                except Reject as r:
                    rejected.append(r.record(g, dq_idx, cons_idx))
            rejected += _outside_subgraph(g, dq_idx)
    return MatchResult(candidates, rejected)


def _outside_subgraph(g: FusionGraph, dq_idx: int) -> list[Rejected]:
    """``dq_outside_subgraph`` for each MatMul/Gemm inside a subgraph that reads the DQ's output: node
    groups never span a subgraph boundary."""
    value = g.nodes[dq_idx].output[0]
    return [Rejected(
        g.path, g.label(dq_idx), dq_idx, f"{where}:{label}", -1, "dq_outside_subgraph",
        f"the DQ is in the enclosing graph and {label} reads its output inside {where}: node groups "
        "never span a subgraph boundary (no edge connects them; ensure_unique_dq_for_node_unit.cc "
        "'QDQ node units are only formed by nodes in the current graph')")
        for user in g.implicit_users(value) for where, label in _subgraph_matmuls(g, user, value)]


def _subgraph_matmuls(g: FusionGraph, user: int, value: str) -> list[tuple[str, str]]:
    """MatMul/Gemm nodes inside the subgraphs of node ``user`` that read outer-scope ``value``."""
    found: list[tuple[str, str]] = []

    def visit(sg: GraphProto, path: str) -> None:
        local = {vi.name for vi in sg.input} | {t.name for t in sg.initializer}
        local |= {o for n in sg.node for o in n.output}
        if value in local:
            return  # shadowed
        for i, n in enumerate(sg.node):
            label = node_label(n, i)
            if n.op_type in ("MatMul", "Gemm") and value in n.input:
                found.append((path, label))
            for attr, inner in node_subgraphs(n):
                visit(inner, subgraph_path(path, label, attr))

    for attr, sg in node_subgraphs(g.nodes[user]):
        visit(sg, subgraph_path(g.path, g.label(user), attr))
    return found
