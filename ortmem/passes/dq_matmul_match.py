"""Which ``DequantizeLinear -> MatMul/Gemm`` pairs ONNX Runtime 1.31.1 turns into ``MatMulNBits``, and why not.

Why this exists
---------------
ortmem rewrites ``DQ(W) -> MatMul`` into ``com.microsoft.MatMulNBits`` itself, ahead of time, so that ORT
never copies and transposes the weights inside session creation. The rewrite must pick exactly the nodes
ORT's own rule picks, otherwise ortmem changes numerics (``accuracy_level``) or kernels where ORT would
not, or leaves a DQ that ORT would have fused. ORT is the authority, so every condition here cites the
ORT source it comes from (paths relative to github.com/microsoft/onnxruntime, ORT 1.31.1); the full
write-up with quotes is ``docs/ort-fusion-rules.md``, and ``tests/test_dq_matmul_match.py`` asks ORT itself,
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
(:mod:`ortmem.ortmodel.value_types`), asked only when a rule needs one.
The one exception is ConstantSharing, which compares *values* of single-element initializers: those are
read when embedded; for external ones pass ``scalar_reader`` or accept a note on the affected candidates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Mapping, NamedTuple, Sequence

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, numpy_helper

from ..onnx_walk import node_label, node_subgraphs, subgraph_path
from ..ortmodel.graph_index import index_graph
from ..ortmodel.release import capabilities
from ..ortmodel.value_types import Dim, TypeInfo, ValueTypes
from ..ortmodel.settings import OrtSettings

__all__ = [
    "Candidate",
    "Rejected",
    "MatchResult",
    "GatherCandidate",
    "GatherMatchResult",
    "OrtSettings",
    "dq_matmul_match",
    "dq_gather_match",
    "effective_block_size",
    "match",
]

#: ``fused_by_ort``: the installed release fuses it but ortmem's rewrite does not reproduce that case
#: (shared initializers on releases without PR #28326's guard): ortmem leaves the node for ORT to fuse.
OrtOutcome = Literal["converted", "converted_wrong", "session_error", "kept", "fused_by_ort"]

# ORT's GraphOptimizationLevel values (onnxruntime_c_api.h): 0 disable, 1 basic, 2 extended, 3 layout, 99 all.
LEVEL_BASIC = 1
LEVEL_EXTENDED = 2

_INT2 = getattr(TensorProto, "INT2", 26)
_UINT2 = getattr(TensorProto, "UINT2", 25)
# bits, signed. qdq_selectors.cc IsNBitsIntType / qdq_actions.cc DQWeightBits + IsDQWeightSigned.
_NBITS: dict[int, tuple[int, bool]] = {
    _INT2: (2, True),
    _UINT2: (2, False),
    TensorProto.INT4: (4, True),
    TensorProto.UINT4: (4, False),
    TensorProto.INT8: (8, True),
    TensorProto.UINT8: (8, False),
}
_SCALE_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
# constant_sharing.cc supported_data_types
_SHARING_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT32, TensorProto.INT64)
_MIN_BLOCK, _MAX_BLOCK = 16, 256  # qdq_selectors.cc ValidateDQForMatMulNBits, qdq_actions.cc ComputeEffectiveBlockSize


def _tname(code: int) -> str:
    try:
        return TensorProto.DataType.Name(code).lower()
    except ValueError:
        return f"type {code}"


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


# --------------------------------------------------------------------------------------------------
# Public records
# --------------------------------------------------------------------------------------------------


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
        text = (f"{_tname(self.weight_dtype)} {self.kind} [{self.K}, {self.N}] ({zp}, {_tname(self.scale_dtype)} scales) "
                f"-> MatMulNBits bits={self.bits} block_size={self.block_size} accuracy_level={self.accuracy_level}")
        if self.bias:
            text += f", bias {self.bias}" + (f" folded from {self.fold_add}" if self.fold_add else "")
        if self.ort_outcome != "converted":
            text += f" [ORT: {self.ort_outcome}: {'; '.join(self.notes)}]"
        return text


@dataclass(frozen=True)
class Rejected:
    """A DQ node feeding a MatMul/Gemm (or, from :func:`dq_gather_match`, a Gather) that stays as it
    is (``ort_outcome="kept"``), and why.

    ``code`` is a stable identifier (see ``docs/ort-fusion-rules.md``); ``reason`` is for people.
    One record per (DQ, consumer) pair: a DQ feeding two MatMuls is reported twice.
    """

    graph_path: str
    node: str
    node_index: int
    consumer: str
    consumer_index: int
    code: str
    reason: str
    ort_outcome: OrtOutcome = "kept"

    @property
    def node_name(self) -> str:
        """The consumer (MatMul/Gemm) label, like :attr:`Candidate.node_name`."""
        return f"{self.graph_path}:{self.consumer}" if self.graph_path else self.consumer


class MatchResult(NamedTuple):
    candidates: list[Candidate]
    rejected: list[Rejected]


def effective_block_size(session_block_size: int, K: int) -> int:
    """MatMulNBits block size ORT uses for a per-tensor/per-channel DQ (qdq_actions.cc ComputeEffectiveBlockSize).

    ``> 0``: the explicit value, which must be a power of two in [16, 256] (else ORT fails session
    creation, but only when such a DQ is fused); ``-1``: the largest power of two <= min(K, 256) with the
    least padding, ties going to the larger block (``padding <= best_padding``); anything else: 32.
    """
    if session_block_size > 0:
        if not (_MIN_BLOCK <= session_block_size <= _MAX_BLOCK and _is_pow2(session_block_size)):
            raise ValueError(
                f"session.qdq_matmulnbits_block_size={session_block_size}: ORT fails session creation "
                "(Explicit qdq_matmulnbits_block_size must be a power-of-two in [16, 256])")
        return session_block_size
    if session_block_size == -1:
        best_bs = _MIN_BLOCK
        best_pad = -(-K // _MIN_BLOCK) * _MIN_BLOCK - K
        bs = _MIN_BLOCK * 2
        while bs <= min(K, _MAX_BLOCK):
            pad = -(-K // bs) * bs - K
            if pad <= best_pad:
                best_pad, best_bs = pad, bs
            bs *= 2
        return best_bs
    return 32


# --------------------------------------------------------------------------------------------------
# Graph model: what ORT's Graph knows (consumers, edges, constancy, shapes) without weight bytes
# --------------------------------------------------------------------------------------------------

@dataclass
class _Init:
    proto: TensorProto  # for Constant nodes: the attribute tensor (or a metadata stand-in)
    from_constant_node: bool = False


class _Graph:
    """One graph as ORT's ``Graph`` answers the fusion rules' questions, in file order, on the shared
    index (:class:`ortmem.ortmodel.graph_index.GraphIndex`) plus what only the rules ask: types,
    opset, initializers as ``_Init`` (sparse ones as metadata stand-ins)."""

    def __init__(self, proto: GraphProto, path: str, parent: "_Graph | None", ir_version: int,
                 opset: int, types: ValueTypes):
        index = index_graph(proto)
        self.index = index
        self.proto = proto
        self.path = path
        self.parent = parent
        self.ir_version = ir_version
        self.opset = opset
        self.nodes: list[NodeProto] = index.nodes
        self.inputs = {vi.name for vi in proto.input}
        self.outputs = {vi.name for vi in proto.output}
        self.inits: dict[str, _Init] = {t.name: _Init(t) for t in proto.initializer}
        for sp in proto.sparse_initializer:
            meta = TensorProto(name=sp.values.name, data_type=sp.values.data_type, dims=list(sp.dims))
            self.inits[sp.values.name] = _Init(meta)
        self.constant_nodes: set[int] = set(index.constants)
        for i, value in index.constants.items():
            self.inits[self.nodes[i].output[0]] = _Init(value, from_constant_node=True)
        self.producer: dict[str, int] = index.computed_by
        # consumers (Graph::GetConsumerNodes counts explicit and implicit users) and explicit slots
        self.consumers: dict[str, list[int]] = index.readers
        self.slots: dict[str, list[tuple[int, int]]] = index.consumers  # explicit (node, input index)
        self.types = types
        self.attn_adds: set[int] | None = None  # AttentionPatternCache's attn_add_nodes, computed on demand
        self._topo: dict[int, int] | None = None

    # -- naming -------------------------------------------------------------------------------------
    def label(self, i: int) -> str:
        return node_label(self.nodes[i], i)

    # -- ORT Graph queries --------------------------------------------------------------------------
    def edges(self, value: str) -> int:
        """Node::GetOutputEdgesCount contribution of one value: explicit input slots plus implicit users."""
        if not value:
            return 0
        return len(self.slots.get(value, ())) + len(self.index.implicit_users.get(value, ()))

    def explicit_consumers(self, value: str) -> list[tuple[int, int]]:
        return list(self.slots.get(value, ()))

    def implicit_users(self, value: str) -> list[int]:
        return list(self.index.implicit_users.get(value, ()))

    def produces_graph_output(self, i: int) -> bool:
        return any(o in self.outputs for o in self.nodes[i].output if o)

    def node_edges(self, i: int) -> int:
        return sum(self.edges(o) for o in self.nodes[i].output if o)

    def topo_position(self, i: int) -> int:
        """Position in GraphViewer::GetNodesInTopologicalOrder (core/graph/graph_viewer.cc).

        ORT walks Graph::ReverseDFSFrom(leaf nodes, leave = append) with NodeCompare (lower index first):
        the leaves are pushed in index order and the stack pops the last one first; a node's input nodes
        are pushed in ascending index order, so its highest-index producer is finished first.
        """
        if self._topo is None:
            self._topo = {k: pos for pos, k in enumerate(self.index.ort_order("DEFAULT"))}
        return self._topo.get(i, -1)

    def is_local_value(self, name: str) -> bool:
        return name in self.inputs or name in self.producer or name in self.inits

    def constant_initializer(self, name: str) -> "tuple[_Graph, _Init] | None":
        """Graph::GetConstantInitializer(name, check_outer_scope=true) (core/graph/graph.cc)."""
        if not name:
            return None
        if name in self.inits:
            # CanOverrideInitializer(): IR >= 4 lets a graph input of the same name override it
            if self.ir_version >= 4 and name in self.inputs:
                return None
            return self, self.inits[name]
        if name in self.inputs or name in self.producer:
            return None  # a local value shadows any outer-scope initializer
        if self.parent is not None:
            return self.parent.constant_initializer(name)
        return None

    def type_of(self, name: str) -> TypeInfo | None:
        if name in self.inits:
            t = self.inits[name].proto
            return TypeInfo(t.data_type, [("v", int(d)) for d in t.dims])
        known = self.types.get(self.path, name)
        if known is not None:
            return known
        if not self.is_local_value(name) and self.parent is not None:
            return self.parent.type_of(name)
        return None

    def op_since(self, node: NodeProto, versions: Sequence[int]) -> int | None:
        """since_version of an ONNX-domain op at this model's opset (the schema version ORT resolves)."""
        cands = [v for v in versions if v <= self.opset]
        return max(cands) if cands else None


# -- shapes ---------------------------------------------------------------------------------------

def _dim_eq(a: Dim, b: Dim) -> bool:
    """ORT's operator== on TensorShapeProto_Dimension: values equal, or identical non-empty params."""
    if a[0] == "v":
        return b[0] == "v" and a[1] == b[1]
    if a[0] == "p":
        return b[0] == "p" and a[1] == b[1]
    return False


def _is_vector_of(ti: TypeInfo | None, n: int) -> bool:
    return ti is not None and ti.shape is not None and len(ti.shape) == 1 and ti.shape[0] == ("v", n)


def _fmt_shape(ti: TypeInfo | None) -> str:
    if ti is None or ti.shape is None:
        return "unknown"
    return "[" + ", ".join(str(v) if k != "?" else "?" for k, v in ti.shape) + "]"


# -- attributes -----------------------------------------------------------------------------------

def _attr(node: NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


# --------------------------------------------------------------------------------------------------
# Level 1 effects
# --------------------------------------------------------------------------------------------------


def _scalar_value(g: _Graph, t: TensorProto, reader: Callable[[str, TensorProto], object] | None):
    """Value of a single-element tensor, or None when it cannot be known without reading a file."""
    if t.data_location == TensorProto.EXTERNAL:
        if reader is None:
            return None
        v = reader(g.path, t)
        return None if v is None else float(np.asarray(v).reshape(-1)[0])
    try:
        arr = numpy_helper.to_array(t)
    except Exception:  # noqa: BLE001 - malformed tiny tensor: treat as unknown
        return None
    if arr.size != 1:
        return None
    return float(arr.reshape(-1)[0].astype(np.float64))


def _constant_sharing_groups(g: _Graph, reader) -> tuple[dict[str, set[int]], set[str]]:
    """ConstantSharing (constant_sharing.cc): name -> consumers after merging, and names with unknown value.

    Only the main graph (the transformer does not Recurse). An initializer takes part when it is a
    constant initializer, its shape is rank 0 or [1], its type is one of float/float16/double/int32/int64,
    it has consumers and none of them uses it from a subgraph. Equal (type, rank, value) -> one tensor.
    """
    merged: dict[str, set[int]] = {}
    unknown: set[str] = set()
    if g.parent is not None:
        return merged, unknown
    groups: dict[tuple, list[str]] = {}
    for name, init in g.inits.items():
        t = init.proto
        if g.constant_initializer(name) is None or t.data_type not in _SHARING_TYPES:
            continue
        dims = list(t.dims)
        if not (len(dims) == 0 or (len(dims) == 1 and dims[0] == 1)):
            continue
        cons = g.consumers.get(name, [])
        if not cons or g.implicit_users(name):
            continue
        value = _scalar_value(g, t, reader)
        if value is None:
            unknown.add(name)
            continue
        if math.isnan(value):
            continue
        groups.setdefault((t.data_type, len(dims), value), []).append(name)
    for names in groups.values():
        if len(names) > 1:
            union: set[int] = set()
            for nm in names:
                union.update(g.consumers.get(nm, []))
            for nm in names:
                merged[nm] = union
    return merged, unknown


def _dq_duplicates(g: _Graph, dq_idx: int, this: tuple[int, int]) -> tuple[int, list[str]]:
    """How many extra DQ copies EnsureUniqueDQForNodeUnit makes for this DQ, and the other users (not ``this``)."""
    out = g.nodes[dq_idx].output[0]
    explicit = g.explicit_consumers(out)
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


@dataclass
class _AddFusion:
    add_idx: int
    bias: str
    need_reshape: bool


def _matmul_add_fusion(g: _Graph, mm_idx: int, settings: OrtSettings) -> _AddFusion | None:
    """Would Level-1 MatMulAddFusion (core/optimizer/matmul_add_fusion.cc) turn this MatMul+Add into Gemm?

    The transformer walks the graph in ORT's topological order, so when an Add sums two MatMuls that both
    qualify, the one ORT visits first becomes the Gemm and the other one stays a MatMul feeding its bias.
    """
    if settings.graph_optimization_level < LEVEL_BASIC or not settings.enabled("MatMulAddFusion"):
        return None
    mine = _matmul_add_fusion_one(g, mm_idx)
    if mine is None:
        return None
    rival = g.producer.get(mine.bias)
    if rival is not None and rival != mm_idx and g.nodes[rival].op_type == "MatMul":
        theirs = _matmul_add_fusion_one(g, rival)
        if theirs is not None and theirs.add_idx == mine.add_idx and g.topo_position(rival) < g.topo_position(mm_idx):
            return None
    return mine


def _matmul_add_fusion_one(g: _Graph, mm_idx: int) -> _AddFusion | None:
    node = g.nodes[mm_idx]
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    out = node.output[0]
    # node.GetOutputEdgesCount() != 1 || graph.NodeProducesGraphOutput(node) -> skip
    if g.edges(out) != 1 or out in g.outputs:
        return None
    cons = g.explicit_consumers(out)
    if len(cons) != 1:
        return None
    add_idx, slot = cons[0]
    add = g.nodes[add_idx]
    # IsSupportedOptypeVersionAndDomain(next_node, "Add", {7, 13, 14})
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or g.op_since(add, (1, 6, 7, 13, 14)) not in (7, 13, 14):
        return None
    a_t, add0_t = g.type_of(node.input[0]), g.type_of(add.input[0])
    if a_t is None or add0_t is None or a_t.elem_type != add0_t.elem_type:
        return None
    if a_t.elem_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
        return None
    b_t = g.type_of(node.input[1])
    if a_t.shape is None or b_t is None or b_t.shape is None or len(b_t.shape) != 2:
        return None
    need_reshape = len(a_t.shape) != 2
    dim_n = b_t.shape[1]
    if need_reshape:
        if _attention_pattern(g, mm_idx, add_idx):
            return None
        if any(k != "v" for k, _ in a_t.shape):  # a_shape.Size() == -1: dynamic
            return None
        if b_t.shape[0][0] != "v" or dim_n[0] != "v":
            return None
    bias = add.input[1 - slot] if slot in (0, 1) else None
    if not bias:
        return None
    bias_t = g.type_of(bias)
    if bias_t is None or bias_t.shape is None:
        return None
    bs = bias_t.shape

    def one(d: Dim) -> bool:
        return d == ("v", 1)

    valid = ((len(bs) == 1 and _dim_eq(bs[0], dim_n))
             or (not need_reshape and len(bs) == 2 and one(bs[0]) and _dim_eq(bs[1], dim_n))
             or (not need_reshape and len(bs) == 2 and _dim_eq(bs[0], a_t.shape[0])
                 and (one(bs[1]) or _dim_eq(bs[1], dim_n))))
    if not valid:
        return None
    return _AddFusion(add_idx, bias, need_reshape)


def _attention_ln(g: _Graph, ln_idx: int) -> int | None:
    """AttentionPatternCache::IsAttentionPattern's test on a LayerNormalization: it feeds exactly 3 MatMuls and
    1 Add (all other edges go to Shape nodes), and that Add's other input comes from an Add. Returns that
    other Add (``attn_add_node``) or None."""
    ln = g.nodes[ln_idx]
    if ln.op_type != "LayerNormalization" or not ln.output:
        return None
    ln_out = ln.output[0]
    cons = g.explicit_consumers(ln_out)
    kinds = [g.nodes[i].op_type for i, _ in cons]
    if kinds.count("Add") != 1 or kinds.count("MatMul") != 3 or kinds.count("Shape") != g.node_edges(ln_idx) - 4:
        return None
    ln_add = next(i for i, _ in cons if g.nodes[i].op_type == "Add")
    ins = g.nodes[ln_add].input
    other = ins[1] if ins[0] == ln_out else ins[0]
    prod = g.producer.get(other)
    return prod if prod is not None and g.nodes[prod].op_type == "Add" else None


def _attention_pattern(g: _Graph, mm_idx: int, add_idx: int) -> bool:
    """MatMulAddFusion keeps an N-D MatMul+Add of an attention block for AttentionFusion (AttentionPatternCache in
    matmul_add_fusion.cc): the Q/K/V MatMuls reading such a LayerNormalization, and the MatMul whose Add is the
    ``attn_add_node`` of one (the output projection). Only consulted when A is not 2-D."""
    parent = g.producer.get(g.nodes[mm_idx].input[0])
    if parent is not None and _attention_ln(g, parent) is not None:
        return True
    if g.attn_adds is None:
        g.attn_adds = {a for i, n in enumerate(g.nodes) if n.op_type == "LayerNormalization"
                       for a in [_attention_ln(g, i)] if a is not None}
    return add_idx in g.attn_adds


# --------------------------------------------------------------------------------------------------
# The DQ -> MatMul/Gemm decision
# --------------------------------------------------------------------------------------------------


class _Reject(Exception):
    def __init__(self, code: str, reason: str, outcome: OrtOutcome = "kept"):
        super().__init__(reason)
        self.code, self.reason, self.outcome = code, reason, outcome


def _dq_parents(g: _Graph, inputs: Sequence[str]) -> list[tuple[int, int]]:
    """graph_utils::FindParentsByType(node, "DequantizeLinear"): (input index, DQ node) per input edge."""
    out = []
    for k, name in enumerate(inputs):
        p = g.producer.get(name) if name else None
        if p is not None and g.nodes[p].op_type == "DequantizeLinear":
            out.append((k, p))
    return out


def _evaluate(g: _Graph, dq_idx: int, cons_idx: int, slot: int, settings: OrtSettings,
              sharing: dict[str, set[int]], sharing_unknown: set[str], block_max: int = _MAX_BLOCK,
              shared_guard: bool = True) -> Candidate:
    """Raise _Reject or return the Candidate, checking in the order ORT does."""
    dq = g.nodes[dq_idx]
    cons = g.nodes[cons_idx]

    if slot != 1:
        where = "input A" if slot == 0 else ("the bias input C" if slot == 2 else f"input {slot}")
        raise _Reject("not_weight_input",
                      f"DQ output feeds {where} of {cons.op_type} {g.label(cons_idx)}: ORT's rule looks only for the "
                      "DQ on input B (qdq_selectors.cc DQMatMulNodeGroupSelector::Check, 'weight DQ node - the one "
                      "feeding input 1')" + (" (a bias DQ stays and feeds MatMulNBits input 5)" if slot == 2 else ""))
    if settings.graph_optimization_level < LEVEL_EXTENDED:
        raise _Reject("optimization_level",
                      f"graph_optimization_level={settings.graph_optimization_level}: DQMatMulToMatMulNBits is a Level-2 "
                      "rule (QDQSelectorActionTransformer, graph_transformer_utils.cc), it needs ORT_ENABLE_EXTENDED or higher")
    if not settings.qdq_enabled:
        raise _Reject("qdq_disabled",
                      "QDQ optimizations are off (session.disable_quant_qdq=1 or QDQSelectorActionTransformer disabled); "
                      "with session.disable_quant_qdq=1 ORT's ConstantFolding also folds this DQ to a float weight")

    # ---- the target after Level 1: MatMul, MatMul+Add -> Gemm (MatMulAddFusion), or a Gemm ----------
    fusion: list[str] = []
    add_f = _matmul_add_fusion(g, cons_idx, settings) if cons.op_type == "MatMul" else None
    if cons.op_type == "MatMul":
        is_gemm = add_f is not None
        target_inputs = [cons.input[0], cons.input[1]] + ([add_f.bias] if add_f else [])
        target_out = g.nodes[add_f.add_idx].output[0] if add_f else cons.output[0]
        target_name = (cons.name + "/MatMulAddFusion") if add_f else cons.name
        if add_f:
            fusion.append("MatMulAddFusion")
        gemm_attrs: dict = {}
    else:
        is_gemm = True
        target_inputs = list(cons.input)
        target_out = cons.output[0]
        target_name = cons.name
        gemm_attrs = {a.name: onnx.helper.get_attribute_value(a) for a in cons.attribute}
    via = f" (after MatMulAddFusion turned {g.label(cons_idx)}+{g.label(add_f.add_idx)} into a Gemm)" if add_f else ""

    # ---- NodeGroupSelector::GetQDQSelection: redundant Relu/Clip and Q consumers --------------------
    # (with need_reshape the Gemm's only consumer is MatMulAddFusion's output Reshape)
    out_cons = [] if (add_f and add_f.need_reshape) else g.explicit_consumers(target_out)
    if out_cons and g.edges(target_out) == 1:
        nxt = out_cons[0][0]
        nxt_node = g.nodes[nxt]
        if (nxt_node.op_type in ("Relu", "Clip") and g.node_edges(nxt) == 1
                and not g.produces_graph_output(nxt)):
            raise _Reject("relu_clip_consumer",
                          f"the {('Gemm' if is_gemm else 'MatMul')}'s only consumer is {nxt_node.op_type} "
                          f"{g.label(nxt)} with one consumer of its own: GetQDQSelection treats it as a Clip/Relu->Q "
                          "candidate and DQMatMulNodeGroupSelector rejects any group with a redundant clip or none found "
                          "(qdq_selectors.cc NodeGroupSelector::GetQDQSelection)" + via)
    q_kids = [i for i, _ in out_cons if g.nodes[i].op_type == "QuantizeLinear"]
    if q_kids:
        raise _Reject("q_consumer",
                      f"output is quantized by {g.label(q_kids[0])}: DQMatMulNodeGroupSelector accepts no Q nodes "
                      "(those groups belong to QLinearMatMul/MatMulIntegerToFloat)" + via)

    # ---- DQ parents -----------------------------------------------------------------------------
    parents = _dq_parents(g, target_inputs)
    if is_gemm:
        if not 1 <= len(parents) <= 2:
            raise _Reject("extra_dq_inputs",
                          f"Gemm has {len(parents)} DequantizeLinear inputs; the rule takes the weight DQ and at most a "
                          "bias DQ" + via)
        others = [(k, p) for k, p in parents if k != 1]
        if others and others[0][0] != 2:
            raise _Reject("activation_dq",
                          f"input A comes from DequantizeLinear {g.label(others[0][1])}: with two DQ inputs the second "
                          "must feed the bias (input 2), so this is a QDQ activation pattern, not a weight-only one" + via)
    else:
        if len(parents) != 1:
            a_dq = [p for k, p in parents if k == 0]
            raise _Reject("activation_dq",
                          f"input A also comes from DequantizeLinear {g.label(a_dq[0]) if a_dq else '?'}: for MatMul the "
                          "rule needs exactly one DQ input (qdq_selectors.cc DQMatMulNodeGroupSelector::Check)")

    # ---- Gemm attributes (ValidateGemmForDQMatMulNBits) ----------------------------------------------
    w_name, s_name = dq.input[0], dq.input[1]
    zp_name = dq.input[2] if len(dq.input) > 2 else None
    w_const = g.constant_initializer(w_name)
    if is_gemm:
        alpha = gemm_attrs.get("alpha")
        if alpha is not None and abs(float(alpha) - 1.0) > 1e-6:
            raise _Reject("gemm_alpha", f"Gemm alpha={alpha}: the rule needs alpha == 1")
        if gemm_attrs.get("transA", 0):
            raise _Reject("gemm_transA", "Gemm transA=1: the rule needs transA == 0")
        if gemm_attrs.get("transB", 0):
            raise _Reject("gemm_transB", "Gemm transB=1: the rule needs transB == 0 (B must be [K, N])")
        bias = target_inputs[2] if len(target_inputs) > 2 and target_inputs[2] else None
        if bias:
            beta = gemm_attrs.get("beta")
            if beta is not None and abs(float(beta) - 1.0) > 1e-6:
                raise _Reject("gemm_beta", f"Gemm beta={beta} with a bias: the rule needs beta == 1")
            if w_const is not None:
                wdims = list(w_const[1].proto.dims)
                if len(wdims) != 2:
                    raise _Reject("weight_rank", f"weight {w_name} has rank {len(wdims)}; MatMulNBits needs [K, N]")
                n_dim: int | None = wdims[1]
            else:
                wt = g.type_of(w_name)
                n_dim = wt.shape[1][1] if (wt and wt.shape and len(wt.shape) == 2 and wt.shape[1][0] == "v") else None
                if n_dim is None:
                    raise _Reject("weight_not_constant", f"weight {w_name} is not a constant initializer and has no static N")
            b_const = g.constant_initializer(bias)
            b_t = (TypeInfo(b_const[1].proto.data_type, [("v", int(d)) for d in b_const[1].proto.dims])
                   if b_const else g.type_of(bias))
            if not _is_vector_of(b_t, int(n_dim)):
                raise _Reject("gemm_bias_shape",
                              f"bias {bias} has shape {_fmt_shape(b_t)}; the rule needs a bias of static shape [N]=[{n_dim}]"
                              + via)
    else:
        bias = None

    # ---- shared weight / scale (PR #28326: GetConsumerNodes(weight|scale).size() > 1) -------------
    # Releases before the guard (1.25) fuse these too; ortmem then leaves them to ORT (fused_by_ort).
    shared_note: str | None = None
    try:
        dup, dup_why = _dq_duplicates(g, dq_idx, (cons_idx, slot))
        if dup:
            raise _Reject("dq_output_shared",
                          f"the DQ output also goes to {', '.join(dup_why)}: "
                          "EnsureUniqueDQForNodeUnit (Level 1) gives each consumer its own DQ copy, so weight "
                          f"{w_name} and scale {s_name} then have several consumers and the shared-initializer guard in "
                          "DQMatMulNodeGroupSelector::Check rejects the fusion")
        w_users = g.consumers.get(w_name, [])
        if len(w_users) > 1:
            others = [g.label(i) for i in w_users if i != dq_idx]
            raise _Reject("weight_shared",
                          f"weight {w_name} is also read by {', '.join(others)}: ORT rejects the fusion when the weight "
                          "initializer has more than one consumer (qdq_selectors.cc, PR #28326; subgraph users count)")
        s_users = set(g.consumers.get(s_name, []))
        if s_name in sharing:
            merged = sharing[s_name]
            if len(merged) > 1:
                others = sorted(g.label(i) for i in merged if i != dq_idx)
                raise _Reject("scale_shared_by_constant_sharing",
                              f"scale {s_name} is a single value equal to another constant used by {', '.join(others)}: "
                              "Level-1 ConstantSharing merges them into one initializer, which then has several consumers, "
                              "and ORT's shared-scale guard rejects the fusion")
        if len(s_users) > 1:
            others = [g.label(i) for i in s_users if i != dq_idx]
            raise _Reject("scale_shared",
                          f"scale {s_name} is also read by {', '.join(others)}: ORT rejects the fusion when the scale "
                          "initializer has more than one consumer (qdq_selectors.cc, PR #28326)")
    except _Reject as r:
        if shared_guard:
            raise
        shared_note = (f"{r.reason} - not on this onnxruntime, which has no shared-initializer guard and fuses it; "
                       "ortmem's rewrite does not split shared initializers, so ORT fuses it itself")

    # ---- ValidateDQForMatMulNBits ------------------------------------------------------------------
    s_t = g.type_of(s_name)
    w_t = g.type_of(w_name)
    s_type = s_t.elem_type if s_t else 0
    w_type = w_t.elem_type if w_t else 0
    if s_type not in _SCALE_TYPES:
        raise _Reject("scale_dtype", f"scale {s_name} is {_tname(s_type)}; the rule needs float or float16")
    if w_type not in _NBITS:
        raise _Reject("weight_dtype", f"weight {w_name} is {_tname(w_type)}; the rule needs int2/uint2/int4/uint4/int8/uint8")
    s_const = g.constant_initializer(s_name)
    if w_const is None:
        why = "a graph input that may override the initializer (IR >= 4)" if (w_name in g.inputs and w_name in g.inits) \
            else ("a graph input" if w_name in g.inputs else "produced by a node")
        raise _Reject("weight_not_constant", f"weight {w_name} is not a constant initializer ({why})")
    if s_const is None:
        why = "a graph input that may override the initializer (IR >= 4)" if (s_name in g.inputs and s_name in g.inits) \
            else ("a graph input" if s_name in g.inputs else "produced by a node")
        raise _Reject("scale_not_constant", f"scale {s_name} is not a constant initializer ({why})")
    zp_const = None
    if zp_name is not None:
        zp_const = g.constant_initializer(zp_name)
        if zp_const is None:
            raise _Reject("zero_point_not_constant",
                          f"zero point {zp_name or '(empty name)'} is not a constant initializer"
                          + (" (an empty optional input still counts as a zero-point input in ORT)" if not zp_name else ""))
    wdims = [int(d) for d in w_const[1].proto.dims]
    if len(wdims) != 2:
        raise _Reject("weight_rank", f"weight {w_name} has rank {len(wdims)}; the rule needs a rank-2 [K, N] weight")
    K, N = wdims
    sdims = [int(d) for d in s_const[1].proto.dims]
    zdims = [int(d) for d in zp_const[1].proto.dims] if zp_const else None
    block_attr = _attr(dq, "block_size")
    axis_attr = _attr(dq, "axis")
    if block_attr is not None and block_attr > 0:
        kind = "blockwise"
        if axis_attr is None or axis_attr != 0:
            raise _Reject("axis", f"blockwise DQ has axis={axis_attr if axis_attr is not None else '1 (default)'}; "
                                  "the rule needs axis=0 exactly (blocks along K; -2 is not accepted)")
        if block_attr < _MIN_BLOCK or block_attr > block_max or not _is_pow2(block_attr):
            raise _Reject("block_size", f"block_size={block_attr}; the rule of this onnxruntime needs a power of two in "
                                        f"[16, {block_max}] (ortmodel.release: 256 up to 1.31, 512 from 1.32)")
        if len(sdims) != 2 or (zdims is not None and len(zdims) != 2):
            raise _Reject("scale_shape", f"blockwise scale {s_name} has shape {sdims}; the rule needs rank 2")
        if -(-K // block_attr) != sdims[0] or N != sdims[1] or (zdims is not None and zdims != sdims):
            raise _Reject("scale_shape", f"scale {sdims} / zero point {zdims} do not match [ceil(K/{block_attr}), N]")
        block = int(block_attr)
    else:
        if len(sdims) == 0:
            kind = "per-tensor"
            if zdims is not None and len(zdims) != 0:
                raise _Reject("zero_point_shape", f"per-tensor scale with zero point of shape {zdims}; the rule needs a scalar")
        elif len(sdims) == 1 and sdims[0] == N:
            kind = "per-channel"
            if axis_attr is not None and axis_attr != 1:
                raise _Reject("axis", f"per-channel DQ has axis={axis_attr}; the rule needs axis absent or exactly 1 "
                                      "(axis=-1 is rejected although it means the same)")
            if zdims is not None and zdims != [N]:
                raise _Reject("zero_point_shape", f"per-channel zero point shape {zdims}; the rule needs [N]=[{N}]")
        else:
            raise _Reject("granularity",
                          f"scale {s_name} has shape {sdims}: neither blockwise (block_size attribute), per-tensor "
                          f"(rank-0 scale) nor per-channel over N (shape [{N}] with axis 1); a shape-[1] scale counts "
                          "as neither unless N == 1")
        try:
            block = effective_block_size(settings.block_size_option, K)
        except ValueError as e:
            raise _Reject("session_block_size", str(e), "session_error") from None

    bits, signed = _NBITS[w_type]
    notes: list[str] = []
    outcome: OrtOutcome = "converted"
    # ---- ORT 1.31.1 action defects (measured; see docs/ort-fusion-rules.md) -----------------------------
    if w_const[0] is not g or s_const[0] is not g:
        which = w_name if w_const[0] is not g else s_name
        outcome = "session_error"
        notes.append(f"{which} is an outer-scope initializer: ORT's selector accepts it but the action only looks in the "
                     "subgraph (graph.GetInitializedTensor) and session creation fails with 'Missing required "
                     f"{'weight' if which == w_name else 'scale'}' (qdq_actions.cc TransposeDQWeightsForMatMulNBits)")
    elif zp_const is not None and zp_const[0] is not g:
        outcome = "converted_wrong"
        notes.append(f"zero point {zp_name} is an outer-scope initializer: ORT's action does not find it and fuses as if "
                     "there were none (wrong results)")
    if bits == 2 and N % 4 != 0 and outcome == "converted":
        outcome = "converted_wrong"
        notes.append(f"2-bit weight with N={N} not a multiple of 4: ORT 1.31.1's fused MatMulNBits gives wrong results "
                     "(measured against the unfused graph and numpy)")
    if g.parent is None and s_name in sharing_unknown:
        notes.append(f"scale {s_name} is a single value stored externally; if it equals another single-value constant "
                     "ConstantSharing would merge them and ORT would reject this fusion (pass scalar_reader to decide)")

    # ---- Level-2 MatMulNBitsFusion: fold a following Add of a [N] bias ---------------------------------
    fold_add = g.label(add_f.add_idx) if add_f else None
    final_out = target_out
    if not bias and settings.enabled("MatMulNBitsFusion"):
        oc = g.explicit_consumers(target_out)
        if g.edges(target_out) == 1 and target_out not in g.outputs and oc:
            ai, aslot = oc[0]
            add = g.nodes[ai]
            if (add.op_type == "Add" and add.domain in ("", "ai.onnx")
                    and g.op_since(add, (1, 6, 7, 13, 14)) in (7, 13, 14) and aslot in (0, 1)):
                b_name = add.input[1 - aslot]
                if _is_vector_of(g.type_of(b_name), N):
                    bias, fold_add, final_out = b_name, g.label(ai), add.output[0]
                    fusion.append("MatMulNBitsFusion")
    elif add_f:
        final_out = g.nodes[add_f.add_idx].output[0]
    if add_f and add_f.need_reshape:
        notes.append("A is not 2-D: MatMulAddFusion wraps the Gemm in Reshape nodes (A -> [M, K], Y -> original shape)")
    fusion.insert(len(fusion) - (1 if "MatMulNBitsFusion" in fusion else 0), "DQMatMulToMatMulNBits")

    return Candidate(
        graph_path=g.path, node=g.label(cons_idx), node_index=cons_idx,
        op="Gemm" if cons.op_type == "Gemm" else "MatMul",
        dq_node=g.label(dq_idx), dq_index=dq_idx,
        weight=w_name, scale=s_name, zero_point=zp_name,
        weight_dtype=w_type, bits=bits, signed=signed, K=K, N=N, block_size=block, kind=kind,
        scale_dtype=s_type, has_zp=zp_name is not None,
        input_a=cons.input[0], bias=bias or None, fold_add=fold_add, output=final_out,
        fusion=tuple(fusion), ort_node_name=target_name,
        accuracy_level=settings.accuracy_level,
        ort_outcome="fused_by_ort" if shared_note else outcome,
        notes=tuple(notes) + ((shared_note,) if shared_note else ()))


def _walk(model: ModelProto) -> list[_Graph]:
    types = ValueTypes(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graphs: list[_Graph] = []

    def visit(proto: GraphProto, path: str, parent: _Graph | None) -> None:
        g = _Graph(proto, path, parent, model.ir_version, opset, types)
        graphs.append(g)
        for i, subs in enumerate(g.index.subgraphs):
            for attr, sg in subs:
                visit(sg, subgraph_path(path, g.label(i), attr), g)

    visit(model.graph, "", None)
    return graphs


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
    scalar_reader: Callable[[str, TensorProto], object] | None = None,
    block_max: int | None = None,
    shared_guard: bool | None = None,
) -> MatchResult:
    """Every DQ -> MatMul/Gemm pair of ``model`` (subgraphs included): what ORT 1.31.1 fuses, and why not.

    ``block_max``: the largest DQ block size the installed ORT's rule fuses; ``shared_guard``: whether it
    rejects DQs whose weight or scale has other consumers (PR #28326). None asks
    :func:`ortmem.ortmodel.release.capabilities` (the one place that knows the release).

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
    for g in _walk(model):
        sharing, unknown = (_constant_sharing_groups(g, scalar_reader)
                            if st.graph_optimization_level >= LEVEL_BASIC and st.enabled("ConstantSharing")
                            else ({}, set()))
        for dq_idx, dq in enumerate(g.nodes):
            if dq.op_type != "DequantizeLinear" or not dq.output or not dq.output[0] or len(dq.input) < 2:
                continue
            for cons_idx, slot in g.explicit_consumers(dq.output[0]):
                cons = g.nodes[cons_idx]
                if cons.op_type not in ("MatMul", "Gemm") or cons.domain not in ("", "ai.onnx"):
                    continue
                try:
                    candidates.append(_evaluate(g, dq_idx, cons_idx, slot, st, sharing, unknown, block_max, shared_guard))
                except _Reject as r:
                    rejected.append(Rejected(g.path, g.label(dq_idx), dq_idx, g.label(cons_idx), cons_idx,
                                             r.code, r.reason, r.outcome))
            for user in g.implicit_users(dq.output[0]):
                for where, label in _subgraph_matmuls(g, user, dq.output[0]):
                    rejected.append(Rejected(
                        g.path, g.label(dq_idx), dq_idx, f"{where}:{label}", -1, "dq_outside_subgraph",
                        f"the DQ is in the enclosing graph and {label} reads its output inside {where}: node groups "
                        "never span a subgraph boundary (no edge connects them; ensure_unique_dq_for_node_unit.cc "
                        "'QDQ node units are only formed by nodes in the current graph')"))
    return MatchResult(candidates, rejected)


match = dq_matmul_match  # short name used by ortmem/inspection.py


def _subgraph_matmuls(g: _Graph, user: int, value: str) -> list[tuple[str, str]]:
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


# ==================================================================================================
# DQ -> Gather  =>  com.microsoft GatherBlockQuantized  (ortmem's own rewrite; ORT has no such fusion)
# ==================================================================================================


@dataclass(frozen=True)
class GatherCandidate:
    """A DQ -> Gather that ortmem can express as one ``com.microsoft.GatherBlockQuantized``.

    The CPU kernel (contrib_ops/cpu/quantization/gather_block_quantized.cc) reads ``data`` in the DQ
    weight's own layout, so ``weight`` is reused byte for byte. ``data_dtype``/``bits`` are the GBQ
    ``T1`` type and ``bits`` attribute (uint2 weights travel as uint8 with bits=2, same bytes).
    ``scale_action`` / ``zp_action`` say what ortmem must do to scales / zero points:
    ``cast``/``cast_to``: the pattern was ``DQ -> Cast(to) -> Gather`` (fp16 tables read as float); the GBQ
    then produces the scale dtype and the Cast moves behind it, onto the gathered rows only.
    ``"as-is"`` (same tensor), ``"reshape"`` (same bytes, new dims ``scales_shape``), ``"expand"``
    (materialize ``scales_shape`` by broadcasting; small), ``"zeros"`` (add an explicit all-zero zero
    point, because GBQ's uint8 default is 2**(bits-1) while DQ's is 0), ``"repack"`` (pack 2-bit
    zero points along the last axis), ``"none"``. ``dq_kept``: the DQ has other consumers (e.g. a tied
    lm_head) or is a graph output, so it stays for them.
    """

    graph_path: str
    node: str
    node_index: int
    dq_node: str
    dq_index: int
    weight: str
    scale: str
    zero_point: str | None
    weight_dtype: int
    data_dtype: int
    bits: int
    signed: bool
    gather_axis: int
    quantize_axis: int
    block_size: int
    kind: Literal["blockwise", "per-row", "per-column", "per-tensor"]
    scale_dtype: int
    has_zp: bool
    scales_shape: tuple[int, ...]
    scale_action: Literal["as-is", "reshape", "expand"]
    zp_action: Literal["as-is", "reshape", "expand", "zeros", "repack", "none"]
    indices: str
    output: str
    dq_kept: bool
    cast: str | None = None
    cast_to: int | None = None
    notes: tuple[str, ...] = ()


class GatherMatchResult(NamedTuple):
    candidates: list[GatherCandidate]
    rejected: list[Rejected]


def _next_pow2_block(n: int) -> int:
    """Smallest power of two >= n and >= 16: one block spans the whole axis (GBQ has no upper bound)."""
    b = _MIN_BLOCK
    while b < n:
        b *= 2
    return b


def _gather_evaluate(g: _Graph, dq_idx: int, ga_idx: int, slot: int, cast_idx: int | None = None) -> GatherCandidate:
    dq, ga = g.nodes[dq_idx], g.nodes[ga_idx]
    if slot != 0:
        raise _Reject("not_data_input", f"DQ output feeds input {slot} (indices) of {g.label(ga_idx)}, not the table")
    w_name, s_name = dq.input[0], dq.input[1]
    zp_name = dq.input[2] if len(dq.input) > 2 and dq.input[2] else None
    w_t, s_t = g.type_of(w_name), g.type_of(s_name)
    w_type = w_t.elem_type if w_t else 0
    s_type = s_t.elem_type if s_t else 0
    # GBQ T1 (schema): int4, uint4, uint8 (+ float8/float4, which DQ weights rarely are)
    if w_type in (TensorProto.INT4, TensorProto.UINT4):
        data_type, bits = w_type, 4
    elif w_type == TensorProto.UINT8:
        data_type, bits = TensorProto.UINT8, 8
    elif w_type == _UINT2:
        data_type, bits = TensorProto.UINT8, 2
    elif w_type == TensorProto.INT8:
        raise _Reject("weight_dtype", "int8 table: GatherBlockQuantized has no int8 data type (T1 is int4/uint4/uint8/"
                                      "float8/float4); it would need a repack to uint8 (flip the sign bit, zp + 128)")
    elif w_type == _INT2:
        raise _Reject("weight_dtype", "int2 table: GatherBlockQuantized reads 2-bit codes only as unsigned (uint8, bits=2)")
    else:
        raise _Reject("weight_dtype", f"table {w_name} is {_tname(w_type)}; GatherBlockQuantized takes int4/uint4/uint8 "
                                      "(uint2 as uint8 bits=2)")
    if s_type not in _SCALE_TYPES:
        raise _Reject("scale_dtype", f"scale {s_name} is {_tname(s_type)}; the CPU kernel takes float or float16 "
                                     "(bfloat16 throws 'DequantizeLinear into BFLOAT16 is not implemented yet')")
    w_const, s_const = g.constant_initializer(w_name), g.constant_initializer(s_name)
    if w_const is None:
        raise _Reject("weight_not_constant", f"table {w_name} is not a constant initializer")
    if s_const is None:
        raise _Reject("scale_not_constant", f"scale {s_name} is not a constant initializer")
    zp_const = g.constant_initializer(zp_name) if zp_name else None
    if zp_name and zp_const is None:
        raise _Reject("zero_point_not_constant", f"zero point {zp_name} is not a constant initializer")
    wdims = [int(d) for d in w_const[1].proto.dims]
    if len(wdims) != 2:
        raise _Reject("weight_rank", f"table {w_name} has rank {len(wdims)}; ortmem rewrites rank-2 tables only "
                                     "(the kernel itself takes any rank)")
    V, D = wdims
    gaxis = _attr(ga, "axis") or 0
    gaxis = gaxis + 2 if gaxis < 0 else gaxis
    is_u8 = data_type == TensorProto.UINT8
    if is_u8 and gaxis != 0:
        raise _Reject("gather_axis", f"Gather axis={gaxis}: for uint8 data the kernel needs gather_axis 0")
    if bits == 2 and D % 4 != 0:
        raise _Reject("unaligned_2bit", f"uint2 table with D={D} not a multiple of 4: rows are not byte-aligned, "
                                        "the uint8 bits=2 layout would need a repack of the table")
    sdims = [int(d) for d in s_const[1].proto.dims]
    zdims = [int(d) for d in zp_const[1].proto.dims] if zp_const else None
    block_attr = _attr(dq, "block_size")
    axis_attr = _attr(dq, "axis")
    axis = 1 if axis_attr is None else int(axis_attr)
    notes: list[str] = []
    if block_attr is not None and block_attr > 0:
        kind = "blockwise"
        qaxis = axis + 2 if axis < 0 else axis
        if block_attr < _MIN_BLOCK or not _is_pow2(block_attr):
            raise _Reject("block_size", f"block_size={block_attr}: the kernel needs a power of two >= 16 "
                                        "('block_size' must be a power of 2 and not less than 16)")
        if is_u8 and qaxis != 1:
            raise _Reject("quantize_axis", f"blockwise over axis {qaxis}: for uint8 data the kernel needs "
                                           "quantize_axis = last dimension")
        if is_u8 and qaxis == gaxis:
            raise _Reject("quantize_axis", "gather_axis == quantize_axis is refused for uint8 data")
        block = int(block_attr)
        scales_shape = tuple(sdims)
        scale_action = "as-is"
        zp_action = "as-is" if zdims is not None else ("zeros" if is_u8 else "none")
        if bits == 2 and zdims is not None:
            zp_action = "repack"
    else:
        if len(sdims) == 0:
            kind, qaxis = "per-tensor", 1
            block = _next_pow2_block(D)
            scales_shape, scale_action = (V, 1), "expand"
            zp_action = "expand" if zdims is not None else ("zeros" if is_u8 else "none")
            if zdims is not None and len(zdims) != 0:
                raise _Reject("zero_point_shape", f"per-tensor scale with zero point shape {zdims}")
        elif len(sdims) == 1:
            a = axis + 2 if axis < 0 else axis
            if a == 0 and sdims[0] == V:
                kind, qaxis = "per-row", 1
                block = _next_pow2_block(D)
                scales_shape = (V, 1)
            elif a == 1 and sdims[0] == D:
                if is_u8:
                    raise _Reject("quantize_axis", "per-column scales (DQ axis=1) need quantize_axis 0, which the "
                                                   "kernel refuses for uint8 data")
                kind, qaxis = "per-column", 0
                block = _next_pow2_block(V)
                scales_shape = (1, D)
            else:
                raise _Reject("granularity", f"scale shape {sdims} does not match axis {a} of table [{V}, {D}]")
            scale_action = "reshape"
            zp_action = "reshape" if zdims is not None else ("zeros" if is_u8 else "none")
            if bits == 2 and zdims is not None:
                zp_action = "repack"
        else:
            raise _Reject("granularity", f"scale {s_name} of shape {sdims} is neither blockwise, per-axis nor per-tensor")
        notes.append(f"block_size {block} >= the quantized axis: one block per row/column, so the {kind} scales "
                     "map onto GBQ without changing values")
    dq_out = dq.output[0]
    others = [i for i, _ in g.explicit_consumers(dq_out) if i not in (ga_idx, cast_idx)] + g.implicit_users(dq_out)
    dq_kept = bool(others) or dq_out in g.outputs
    cast_to = None
    if cast_idx is not None:
        cast_out = g.nodes[cast_idx].output[0]
        cast_to = int(_attr(g.nodes[cast_idx], "to"))
        cast_others = [i for i, _ in g.explicit_consumers(cast_out) if i != ga_idx] + g.implicit_users(cast_out)
        if cast_others or cast_out in g.outputs:
            others += cast_others
            dq_kept = True
    if dq_kept:
        notes.append("the DQ keeps other consumers (" + ", ".join(g.label(i) for i in others)
                     + (", graph output" if dq_out in g.outputs else "") + "): it stays for them")
    if w_const[0] is not g:
        notes.append(f"{w_name} is an outer-scope initializer: GBQ reads it as an implicit input")
    notes.append("GBQ answers zeros for out-of-range indices where Gather fails: the rewrite checks them with a "
                 "Gather over arange first (ortmem.passes.dq_gather)")
    return GatherCandidate(
        graph_path=g.path, node=g.label(ga_idx), node_index=ga_idx, dq_node=g.label(dq_idx), dq_index=dq_idx,
        weight=w_name, scale=s_name, zero_point=zp_name, weight_dtype=w_type, data_dtype=data_type, bits=bits,
        signed=w_type == TensorProto.INT4, gather_axis=gaxis, quantize_axis=qaxis, block_size=block, kind=kind,
        scale_dtype=s_type, has_zp=zp_name is not None, scales_shape=tuple(scales_shape),
        scale_action=scale_action, zp_action=zp_action, indices=ga.input[1], output=ga.output[0],
        dq_kept=dq_kept, cast=g.label(cast_idx) if cast_idx is not None else None, cast_to=cast_to, notes=tuple(notes))


def dq_gather_match(model: ModelProto) -> GatherMatchResult:
    """Every DQ -> Gather pair: can it become one GatherBlockQuantized (CPU kernel constraints), and why not.

    ORT 1.31.1 has no DQ+Gather fusion (measured: the optimized model keeps DQ and Gather at every
    level), so a DQ before an embedding Gather dequantizes the whole table on every run. Pure and
    metadata-only, like :func:`dq_matmul_match`.
    """
    candidates: list[GatherCandidate] = []
    rejected: list[Rejected] = []
    for g in _walk(model):
        for dq_idx, dq in enumerate(g.nodes):
            if dq.op_type != "DequantizeLinear" or not dq.output or not dq.output[0] or len(dq.input) < 2:
                continue
            pairs: list[tuple[int, int, int | None]] = []
            for cons_idx, slot in g.explicit_consumers(dq.output[0]):
                cons = g.nodes[cons_idx]
                if cons.domain not in ("", "ai.onnx"):
                    continue
                if cons.op_type == "Gather":
                    pairs.append((cons_idx, slot, None))
                elif cons.op_type == "Cast" and _attr(cons, "to") in (TensorProto.FLOAT, TensorProto.FLOAT16):
                    # DQ -> Cast(float|float16) -> Gather: the fp16 exporters' pattern (see GatherCandidate.cast)
                    pairs += [(i, k, cons_idx) for i, k in g.explicit_consumers(cons.output[0])
                              if g.nodes[i].op_type == "Gather" and g.nodes[i].domain in ("", "ai.onnx")]
            for cons_idx, slot, cast_idx in pairs:
                try:
                    candidates.append(_gather_evaluate(g, dq_idx, cons_idx, slot, cast_idx))
                except _Reject as r:
                    rejected.append(Rejected(g.path, g.label(dq_idx), dq_idx, g.label(cons_idx), cons_idx,
                                                   r.code, r.reason))
    return GatherMatchResult(candidates, rejected)
