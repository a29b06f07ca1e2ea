"""The checks of ORT's ``DQMatMulToMatMulNBits`` rule, one function each, in the order ORT makes them.

Why one function per check: each rejection keeps its ``code`` and cites the ORT source it replays
(``docs/ort-fusion-rules.md`` section 2 lists them in this order), and the order matters: the matcher
reports the *first* failing check, as ORT's selector stops at it. :func:`ortmem.passes.rules.dq_matmul_match.evaluate`
runs them; a check raises :class:`~ortmem.passes.rules.dq_match.Reject` or returns what the later ones need.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import NodeProto, TensorProto

from ortmem.ort.fusion_graph import (LEVEL_EXTENDED, FusionGraph, Initializer, attribute, format_shape, is_vector_of, tensor_type_name)
from ortmem.ort.matmul_add_fusion import ADD_VERSIONS, FUSED_ADD_VERSIONS, AddFusion, matmul_add_fusion
from ortmem.ort.settings import OrtSettings
from ortmem.ort.value_types import TypeInfo
from ortmem.passes.rules.dq_match import (MIN_BLOCK, SCALE_TYPES, INT2, UINT2, OrtOutcome, Reject, is_onnx_domain, is_pow2)

# bits, signed. qdq_selectors.cc IsNBitsIntType / qdq_actions.cc DQWeightBits + IsDQWeightSigned.
NBITS: dict[int, tuple[int, bool]] = {
    INT2: (2, True),
    UINT2: (2, False),
    TensorProto.INT4: (4, True),
    TensorProto.UINT4: (4, False),
    TensorProto.INT8: (8, True),
    TensorProto.UINT8: (8, False),
}
MAX_BLOCK = 256  # qdq_actions.cc ComputeEffectiveBlockSize (and the rule's bound up to 1.31)

Constant = tuple[FusionGraph, Initializer]


def effective_block_size(session_block_size: int, K: int) -> int:
    """MatMulNBits block size ORT uses for a per-tensor/per-channel DQ (qdq_actions.cc ComputeEffectiveBlockSize).

    ``> 0``: the explicit value, which must be a power of two in [16, 256] (else ORT fails session
    creation, but only when such a DQ is fused); ``-1``: the largest power of two <= min(K, 256) with the
    least padding, ties going to the larger block (``padding <= best_padding``); anything else: 32.
    """
    if session_block_size > 0:
        if not (MIN_BLOCK <= session_block_size <= MAX_BLOCK and is_pow2(session_block_size)):
            raise ValueError(
                f"session.qdq_matmulnbits_block_size={session_block_size}: ORT fails session creation "
                "(Explicit qdq_matmulnbits_block_size must be a power-of-two in [16, 256])")
        return session_block_size
    if session_block_size == -1:
        best_bs = MIN_BLOCK
        best_pad = -(-K // MIN_BLOCK) * MIN_BLOCK - K
        bs = MIN_BLOCK * 2
        while bs <= min(K, MAX_BLOCK):
            pad = -(-K // bs) * bs - K
            if pad <= best_pad:
                best_pad, best_bs = pad, bs
            bs *= 2
        return best_bs
    return 32


# -- 0, 1: where the DQ feeds, and whether the rule runs at all ----------------------------------------

def check_weight_input(g: FusionGraph, cons_idx: int, slot: int) -> None:
    if slot != 1:
        cons = g.nodes[cons_idx]
        where = "input A" if slot == 0 else ("the bias input C" if slot == 2 else f"input {slot}")
        raise Reject("not_weight_input",
                     f"DQ output feeds {where} of {cons.op_type} {g.label(cons_idx)}: ORT's rule looks only for the "
                     "DQ on input B (qdq_selectors.cc DQMatMulNodeGroupSelector::Check, 'weight DQ node - the one "
                     "feeding input 1')" + (" (a bias DQ stays and feeds MatMulNBits input 5)" if slot == 2 else ""))


def check_settings(settings: OrtSettings) -> None:
    if settings.graph_optimization_level < LEVEL_EXTENDED:
        raise Reject("optimization_level",
                     f"graph_optimization_level={settings.graph_optimization_level}: DQMatMulToMatMulNBits is a Level-2 "
                     "rule (QDQSelectorActionTransformer, graph_transformer_utils.cc), it needs ORT_ENABLE_EXTENDED or higher")
    if not settings.qdq_enabled:
        raise Reject("qdq_disabled",
                     "QDQ optimizations are off (session.disable_quant_qdq=1 or QDQSelectorActionTransformer disabled); "
                     "with session.disable_quant_qdq=1 ORT's ConstantFolding also folds this DQ to a float weight")


# -- the node the rule sees after Level 1 ----------------------------------------------------------------

@dataclass
class Target:
    """The node ORT's rule judges: the MatMul, the Gemm that MatMulAddFusion made of MatMul+Add
    (``add``), or a Gemm of the model. ``fusion``: the transformers that made it, in order."""

    is_gemm: bool
    inputs: list[str]
    output: str
    name: str
    gemm_attrs: dict
    add: AddFusion | None
    fusion: list[str] = field(default_factory=list)
    via: str = ""  # for messages about a Gemm that MatMulAddFusion made: how it came to be


def level1_target(g: FusionGraph, cons_idx: int, settings: OrtSettings) -> Target:
    """MatMul, MatMul+Add -> Gemm (Level-1 MatMulAddFusion, :mod:`ortmem.ort.matmul_add_fusion`), or a Gemm."""
    cons = g.nodes[cons_idx]
    if cons.op_type != "MatMul":
        gemm_attrs = {a.name: onnx.helper.get_attribute_value(a) for a in cons.attribute}
        return Target(True, list(cons.input), cons.output[0], cons.name, gemm_attrs, None)
    add = matmul_add_fusion(g, cons_idx, settings)
    if add is None:
        return Target(False, [cons.input[0], cons.input[1]], cons.output[0], cons.name, {}, None)
    via = f" (after MatMulAddFusion turned {g.label(cons_idx)}+{g.label(add.add_idx)} into a Gemm)"
    return Target(True, [cons.input[0], cons.input[1], add.bias], g.nodes[add.add_idx].output[0],
                  cons.name + "/MatMulAddFusion", {}, add, ["MatMulAddFusion"], via)


# -- 2, 3: NodeGroupSelector::GetQDQSelection -------------------------------------------------------------

def check_output_consumers(g: FusionGraph, target: Target) -> None:
    """Redundant Relu/Clip and Q consumers (with need_reshape the Gemm's only consumer is
    MatMulAddFusion's output Reshape)."""
    out_cons = [] if (target.add and target.add.need_reshape) else g.consumers(target.output)
    if out_cons and g.edges(target.output) == 1:
        nxt = out_cons[0][0]
        nxt_node = g.nodes[nxt]
        if (nxt_node.op_type in ("Relu", "Clip") and g.node_edges(nxt) == 1
                and not g.produces_graph_output(nxt)):
            raise Reject("relu_clip_consumer",
                         f"the {('Gemm' if target.is_gemm else 'MatMul')}'s only consumer is {nxt_node.op_type} "
                         f"{g.label(nxt)} with one consumer of its own: GetQDQSelection treats it as a Clip/Relu->Q "
                         "candidate and DQMatMulNodeGroupSelector rejects any group with a redundant clip or none found "
                         "(qdq_selectors.cc NodeGroupSelector::GetQDQSelection)" + target.via)
    q_kids = [i for i, _ in out_cons if g.nodes[i].op_type == "QuantizeLinear"]
    if q_kids:
        raise Reject("q_consumer",
                     f"output is quantized by {g.label(q_kids[0])}: DQMatMulNodeGroupSelector accepts no Q nodes "
                     "(those groups belong to QLinearMatMul/MatMulIntegerToFloat)" + target.via)


# -- 4: the DQ inputs ---------------------------------------------------------------------------------------

def dq_parents(g: FusionGraph, inputs: list[str]) -> list[tuple[int, int]]:
    """graph_utils::FindParentsByType(node, "DequantizeLinear"): (input index, DQ node) per input edge."""
    out = []
    for k, name in enumerate(inputs):
        p = g.computed_by(name)
        if p is not None and g.nodes[p].op_type == "DequantizeLinear":
            out.append((k, p))
    return out


def check_dq_inputs(g: FusionGraph, target: Target) -> None:
    parents = dq_parents(g, target.inputs)
    if target.is_gemm:
        if not 1 <= len(parents) <= 2:
            raise Reject("extra_dq_inputs",
                         f"Gemm has {len(parents)} DequantizeLinear inputs; the rule takes the weight DQ and at most a "
                         "bias DQ" + target.via)
        others = [(k, p) for k, p in parents if k != 1]
        if others and others[0][0] != 2:
            raise Reject("activation_dq",
                         f"input A comes from DequantizeLinear {g.label(others[0][1])}: with two DQ inputs the second "
                         "must feed the bias (input 2), so this is a QDQ activation pattern, not a weight-only one"
                         + target.via)
    elif len(parents) != 1:
        a_dq = [p for k, p in parents if k == 0]
        raise Reject("activation_dq",
                     f"input A also comes from DequantizeLinear {g.label(a_dq[0]) if a_dq else '?'}: for MatMul the "
                     "rule needs exactly one DQ input (qdq_selectors.cc DQMatMulNodeGroupSelector::Check)")


# -- 6, 7: ValidateGemmForDQMatMulNBits ------------------------------------------------------------------

def check_gemm(g: FusionGraph, target: Target, w_name: str, w_const: Constant | None) -> str | None:
    """The Gemm's attributes and bias; returns the bias (None for a MatMul or a Gemm without one)."""
    if not target.is_gemm:
        return None
    attrs = target.gemm_attrs
    alpha = attrs.get("alpha")
    if alpha is not None and abs(float(alpha) - 1.0) > 1e-6:
        raise Reject("gemm_alpha", f"Gemm alpha={alpha}: the rule needs alpha == 1")
    if attrs.get("transA", 0):
        raise Reject("gemm_transA", "Gemm transA=1: the rule needs transA == 0")
    if attrs.get("transB", 0):
        raise Reject("gemm_transB", "Gemm transB=1: the rule needs transB == 0 (B must be [K, N])")
    bias = target.inputs[2] if len(target.inputs) > 2 and target.inputs[2] else None
    if bias:
        beta = attrs.get("beta")
        if beta is not None and abs(float(beta) - 1.0) > 1e-6:
            raise Reject("gemm_beta", f"Gemm beta={beta} with a bias: the rule needs beta == 1")
        n_dim = _static_n(g, w_name, w_const)
        b_const = g.constant_initializer(bias)
        b_t = (TypeInfo(b_const[1].proto.data_type, [("v", int(d)) for d in b_const[1].proto.dims])
               if b_const else g.type_of(bias))
        if not is_vector_of(b_t, int(n_dim)):
            raise Reject("gemm_bias_shape",
                         f"bias {bias} has shape {format_shape(b_t)}; the rule needs a bias of static shape [N]=[{n_dim}]"
                         + target.via)
    return bias


def _static_n(g: FusionGraph, w_name: str, w_const: Constant | None) -> int:
    """N, as the bias check reads it: the constant weight's dims, else its NodeArg shape."""
    if w_const is not None:
        wdims = list(w_const[1].proto.dims)
        if len(wdims) != 2:
            raise Reject("weight_rank", f"weight {w_name} has rank {len(wdims)}; MatMulNBits needs [K, N]")
        return wdims[1]
    wt = g.type_of(w_name)
    n_dim = wt.shape[1][1] if (wt and wt.shape and len(wt.shape) == 2 and wt.shape[1][0] == "v") else None
    if n_dim is None:
        raise Reject("weight_not_constant", f"weight {w_name} is not a constant initializer and has no static N")
    return n_dim


# -- 5, 8: shared DQ output, weight or scale (PR #28326) -------------------------------------------------

def dq_duplicates(g: FusionGraph, dq_idx: int, this: tuple[int, int]) -> tuple[int, list[str]]:
    """How many extra DQ copies EnsureUniqueDQForNodeUnit makes for this DQ, and the other users (not ``this``)."""
    out = g.nodes[dq_idx].output[0]
    explicit = g.consumers(out)
    sub_users = g.implicit_users(out)
    gout = out in g.outputs
    total_edges = len(explicit) + len(sub_users)
    if total_edges == 0 or (total_edges == 1 and not gout):
        return 0, []
    dup = len(explicit) - (0 if (sub_users or gout) else 1)
    why = [f"{g.label(i)} (input {k})" for i, k in explicit if (i, k) != this]
    why += [f"subgraph of {g.label(i)}" for i in sub_users]
    if gout:
        why.append("a graph output")
    return max(dup, 0), why


def check_shared_initializers(g: FusionGraph, dq_idx: int, this: tuple[int, int], sharing: dict[str, set[int]]) -> None:
    """GetConsumerNodes(weight|scale).size() > 1, after Level-1 EnsureUniqueDQ and ConstantSharing."""
    dq = g.nodes[dq_idx]
    w_name, s_name = dq.input[0], dq.input[1]
    dup, dup_why = dq_duplicates(g, dq_idx, this)
    if dup:
        raise Reject("dq_output_shared",
                     f"the DQ output also goes to {', '.join(dup_why)}: "
                     "EnsureUniqueDQForNodeUnit (Level 1) gives each consumer its own DQ copy, so weight "
                     f"{w_name} and scale {s_name} then have several consumers and the shared-initializer guard in "
                     "DQMatMulNodeGroupSelector::Check rejects the fusion")
    w_users = g.readers(w_name)
    if len(w_users) > 1:
        others = [g.label(i) for i in w_users if i != dq_idx]
        raise Reject("weight_shared",
                     f"weight {w_name} is also read by {', '.join(others)}: ORT rejects the fusion when the weight "
                     "initializer has more than one consumer (qdq_selectors.cc, PR #28326; subgraph users count)")
    s_users = set(g.readers(s_name))
    if s_name in sharing:
        merged = sharing[s_name]
        if len(merged) > 1:
            others = sorted(g.label(i) for i in merged if i != dq_idx)
            raise Reject("scale_shared_by_constant_sharing",
                         f"scale {s_name} is a single value equal to another constant used by {', '.join(others)}: "
                         "Level-1 ConstantSharing merges them into one initializer, which then has several consumers, "
                         "and ORT's shared-scale guard rejects the fusion")
    if len(s_users) > 1:
        others = [g.label(i) for i in s_users if i != dq_idx]
        raise Reject("scale_shared",
                     f"scale {s_name} is also read by {', '.join(others)}: ORT rejects the fusion when the scale "
                     "initializer has more than one consumer (qdq_selectors.cc, PR #28326)")


# -- 9 to 11: ValidateDQForMatMulNBits, types and constancy ----------------------------------------------

def check_types(g: FusionGraph, w_name: str, s_name: str) -> tuple[int, int]:
    """(weight type, scale type)."""
    s_t, w_t = g.type_of(s_name), g.type_of(w_name)
    s_type = s_t.elem_type if s_t else 0
    w_type = w_t.elem_type if w_t else 0
    if s_type not in SCALE_TYPES:
        raise Reject("scale_dtype", f"scale {s_name} is {tensor_type_name(s_type)}; the rule needs float or float16")
    if w_type not in NBITS:
        raise Reject("weight_dtype", f"weight {w_name} is {tensor_type_name(w_type)}; the rule needs "
                                     "int2/uint2/int4/uint4/int8/uint8")
    return w_type, s_type


def _not_constant_why(g: FusionGraph, name: str) -> str:
    if name in g.inputs and name in g.inits:
        return "a graph input that may override the initializer (IR >= 4)"
    return "a graph input" if name in g.inputs else "produced by a node"


def check_constants(g: FusionGraph, w_name: str, s_name: str, zp_name: str | None,
                    w_const: Constant | None) -> tuple[Constant, Constant, Constant | None]:
    """Weight, scale and (when the DQ has that input, even empty) zero point are constant initializers."""
    s_const = g.constant_initializer(s_name)
    if w_const is None:
        raise Reject("weight_not_constant", f"weight {w_name} is not a constant initializer ({_not_constant_why(g, w_name)})")
    if s_const is None:
        raise Reject("scale_not_constant", f"scale {s_name} is not a constant initializer ({_not_constant_why(g, s_name)})")
    zp_const = None
    if zp_name is not None:
        zp_const = g.constant_initializer(zp_name)
        if zp_const is None:
            raise Reject("zero_point_not_constant",
                         f"zero point {zp_name or '(empty name)'} is not a constant initializer"
                         + (" (an empty optional input still counts as a zero-point input in ORT)" if not zp_name else ""))
    return w_const, s_const, zp_const


# -- 12 to 15: shapes and granularity -------------------------------------------------------------------

def check_weight_rank(w_name: str, w_const: Constant) -> tuple[int, int]:
    """(K, N)."""
    wdims = [int(d) for d in w_const[1].proto.dims]
    if len(wdims) != 2:
        raise Reject("weight_rank", f"weight {w_name} has rank {len(wdims)}; the rule needs a rank-2 [K, N] weight")
    K, N = wdims
    return K, N


def check_granularity(dq: NodeProto, K: int, N: int, s_const: Constant, zp_const: Constant | None,
                      settings: OrtSettings, block_max: int) -> tuple[str, int]:
    """(kind, MatMulNBits block size): blockwise, per-tensor or per-channel, as ValidateDQForMatMulNBits
    accepts them; the last two expanded to blocks of the session's size (:func:`effective_block_size`)."""
    s_name = dq.input[1]
    sdims = [int(d) for d in s_const[1].proto.dims]
    zdims = [int(d) for d in zp_const[1].proto.dims] if zp_const else None
    block_attr = attribute(dq, "block_size")
    axis_attr = attribute(dq, "axis")
    if block_attr is not None and block_attr > 0:
        if axis_attr is None or axis_attr != 0:
            raise Reject("axis", f"blockwise DQ has axis={axis_attr if axis_attr is not None else '1 (default)'}; "
                                 "the rule needs axis=0 exactly (blocks along K; -2 is not accepted)")
        if block_attr < MIN_BLOCK or block_attr > block_max or not is_pow2(block_attr):
            raise Reject("block_size", f"block_size={block_attr}; the rule of this onnxruntime needs a power of two in "
                                       f"[16, {block_max}] (ortmodel.release: 256 up to 1.31, 512 from 1.32)")
        if len(sdims) != 2 or (zdims is not None and len(zdims) != 2):
            raise Reject("scale_shape", f"blockwise scale {s_name} has shape {sdims}; the rule needs rank 2")
        if -(-K // block_attr) != sdims[0] or N != sdims[1] or (zdims is not None and zdims != sdims):
            raise Reject("scale_shape", f"scale {sdims} / zero point {zdims} do not match [ceil(K/{block_attr}), N]")
        return "blockwise", int(block_attr)
    if len(sdims) == 0:
        kind = "per-tensor"
        if zdims is not None and len(zdims) != 0:
            raise Reject("zero_point_shape", f"per-tensor scale with zero point of shape {zdims}; the rule needs a scalar")
    elif len(sdims) == 1 and sdims[0] == N:
        kind = "per-channel"
        if axis_attr is not None and axis_attr != 1:
            raise Reject("axis", f"per-channel DQ has axis={axis_attr}; the rule needs axis absent or exactly 1 "
                                 "(axis=-1 is rejected although it means the same)")
        if zdims is not None and zdims != [N]:
            raise Reject("zero_point_shape", f"per-channel zero point shape {zdims}; the rule needs [N]=[{N}]")
    else:
        raise Reject("granularity",
                     f"scale {s_name} has shape {sdims}: neither blockwise (block_size attribute), per-tensor "
                     f"(rank-0 scale) nor per-channel over N (shape [{N}] with axis 1); a shape-[1] scale counts "
                     "as neither unless N == 1")
    try:
        return kind, effective_block_size(settings.block_size_option, K)
    except ValueError as e:
        raise Reject("session_block_size", str(e), "session_error") from None


# -- what ORT 1.31.1 then does wrong (measured; docs/ort-fusion-rules.md section 7) ------------------------

def ort_defects(g: FusionGraph, dq: NodeProto, consts: tuple[Constant, Constant, Constant | None],
                bits: int, N: int) -> tuple[OrtOutcome, list[str]]:
    """(outcome, notes): ``converted`` unless ORT's own action fails or computes wrong numbers here."""
    w_name, s_name = dq.input[0], dq.input[1]
    w_const, s_const, zp_const = consts
    notes: list[str] = []
    outcome: OrtOutcome = "converted"
    if w_const[0] is not g or s_const[0] is not g:
        which = w_name if w_const[0] is not g else s_name
        outcome = "session_error"
        notes.append(f"{which} is an outer-scope initializer: ORT's selector accepts it but the action only looks in the "
                     "subgraph (graph.GetInitializedTensor) and session creation fails with 'Missing required "
                     f"{'weight' if which == w_name else 'scale'}' (qdq_actions.cc TransposeDQWeightsForMatMulNBits)")
    elif zp_const is not None and zp_const[0] is not g:
        outcome = "converted_wrong"
        notes.append(f"zero point {dq.input[2]} is an outer-scope initializer: ORT's action does not find it and fuses "
                     "as if there were none (wrong results)")
    if bits == 2 and N % 4 != 0 and outcome == "converted":
        outcome = "converted_wrong"
        notes.append(f"2-bit weight with N={N} not a multiple of 4: ORT 1.31.1's fused MatMulNBits gives wrong results "
                     "(measured against the unfused graph and numpy)")
    return outcome, notes


# -- Level-2 MatMulNBitsFusion: fold a following Add of an [N] bias (matmul_nbits_fusion.cc) --------------

@dataclass
class BiasFold:
    bias: str | None
    fold_add: str | None  # the Add node that disappears
    output: str  # the tensor that finally carries the product


def fold_following_add(g: FusionGraph, target: Target, bias: str | None, N: int, settings: OrtSettings) -> BiasFold:
    """The bias MatMulNBits ends up with: the Gemm's, MatMulAddFusion's, or a following Add's that
    MatMulNBitsFusion folds (appending ``MatMulNBitsFusion`` to ``target.fusion``)."""
    fold_add = g.label(target.add.add_idx) if target.add else None
    if not bias and settings.enabled("MatMulNBitsFusion"):
        oc = g.consumers(target.output)
        if g.edges(target.output) == 1 and target.output not in g.outputs and oc:
            ai, aslot = oc[0]
            add = g.nodes[ai]
            if (add.op_type == "Add" and is_onnx_domain(add)
                    and g.op_since(ADD_VERSIONS) in FUSED_ADD_VERSIONS and aslot in (0, 1)):
                b_name = add.input[1 - aslot]
                if is_vector_of(g.type_of(b_name), N):
                    target.fusion.append("MatMulNBitsFusion")
                    return BiasFold(b_name, g.label(ai), add.output[0])
    return BiasFold(bias, fold_add, target.output)
