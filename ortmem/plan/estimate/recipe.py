"""What ORT does with each initializer at session creation, decided from metadata: the session settings that matter, every weight and its uses, constant folding, the DQ+MatMul fusion, NCHWc reorders and kernel pre-packing.

Part of :mod:`ortmem.plan.estimate` (see ``estimator`` for the method)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

from ortmem.base.dtypes import byte_size
from ortmem.ort.settings import OrtSettings
from ortmem.passes.rules.dq_matmul_match import dq_matmul_match
from ortmem.plan.estimate import activations as act
from ortmem.plan.estimate import shapes as shp
from ortmem.ort import graph_index as og

#: NCHWc block (MLAS ``MlasNchwcGetBlockSize``): 16 with AVX-512F, 8 with AVX2.
_CPU_FLAGS_FILE = "/proc/cpuinfo"
#: ops ORT's ConstantFolding never folds (control flow, randomness, QDQ kept for fusion).
_NO_FOLD = {"DequantizeLinear", "QuantizeLinear", "If", "Loop", "Scan", "RandomNormal", "RandomUniform",
            "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Constant"}


def nchwc_block() -> int:
    try:
        flags = Path(_CPU_FLAGS_FILE).read_text()
    except OSError:
        return 0
    if " avx512f" in flags:
        return 16
    if " avx2" in flags:
        return 8
    return 0


# ------------------------------------------------------------------------------- weights
@dataclass
class Weight:
    """One initializer and what ORT will do with it."""

    key: tuple[str, str]  # (graph path, name)
    nbytes: int
    storage: str  # "embedded" | "external" | "inline"
    dims: tuple[int, ...]
    data_type: int
    uses: list[tuple[og.OrtGraph, og.OrtNode, int]] = field(default_factory=list)  # (graph, node, slot); slot -1 implicit
    dropped_by: str = ""  # "fold" | "qdq" | "nchwc" | "" (kept unless packed away)
    packs: list[tuple[og.OrtNode, int]] = field(default_factory=list)  # (consumer, packed bytes)
    outer_use: bool = False  # read from a subgraph: ORT never drops it
    read_at_create: bool = False  # touched during creation even if not packed (MatMulNBits scales at acc 4)
    gather_rows_touched: int | None = None  # for a Gather table: bytes read by one run
    folded_uses: int = 0  # uses by nodes constant folding removes: read once at load, never by a kernel

    @property
    def kept_uses(self) -> int:
        """Uses left once constant folding ran: a weight whose kept uses are all packed is dropped."""
        return len(self.uses) - self.folded_uses


@dataclass
class CreatedTensor:
    """A tensor ORT creates during optimization (folded constant, fused MatMulNBits input, NCHWc weight)."""

    key: tuple[str, str]
    nbytes: int
    by: str
    sources: list[tuple[str, str]]
    packs: list[tuple[og.OrtNode | None, int]] = field(default_factory=list)
    read_at_create: bool = False


def _storage(t: TensorProto, model_file: str) -> str:
    if t.data_location == TensorProto.EXTERNAL:
        loc = next((e.value for e in t.external_data if e.key == "location"), "")
        return "embedded" if os.path.basename(loc) == model_file and loc == model_file else "external"
    return "inline" if t.ByteSize() < 1024 else "embedded"


def tensor_bytes(t: TensorProto) -> int:
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    try:
        return byte_size(t.data_type, tuple(t.dims))
    except Exception:
        return len(t.raw_data)


def _collect_weights(root: og.OrtGraph, model_file: str) -> dict[tuple[str, str], Weight]:
    ws: dict[tuple[str, str], Weight] = {}
    for g in og.walk(root):
        for name, t in g.initializers.items():
            ws[(g.path, name)] = Weight((g.path, name), tensor_bytes(t), _storage(t, model_file),
                                    tuple(int(d) for d in t.dims), t.data_type)
    for g in og.walk(root):
        for node in g.nodes:
            for slot, name in enumerate(node.inputs):
                if not name:
                    continue
                hit = g.find_initializer(name)
                if hit is not None:
                    w = ws[(hit[0].path, name)]
                    w.uses.append((g, node, slot))
                    if hit[0] is not g:
                        w.outer_use = True
    return ws


# ----------------------------------------------------------------------------- the ORT recipe
@dataclass
class Recipe:
    weights: dict[tuple[str, str], Weight]
    new: list[CreatedTensor]
    folds: list[CreatedTensor]
    qdq: list[tuple[CreatedTensor, CreatedTensor, CreatedTensor | None, list[tuple[str, str]]]]
    nchwc: list[CreatedTensor]
    notes: list[str]
    packed_nbits_nodes: dict[int, bool]  # id(node) -> packed (workspace decision)
    removed: frozenset[int] = frozenset()  # id() of nodes that become constants (folded, fused DQ)
    fused: dict[int, tuple[int, int, int, int, int]] = field(default_factory=dict)  # MatMul id -> K,N,bits,block,acc
    kernel_order: list[og.OrtNode] = field(default_factory=list)  # the order kernels are created and pre-pack
    qdq_users: dict[tuple[str, str], list[tuple[og.OrtNode, int]]] = field(default_factory=dict)
    largest_pack_source: int = 0


def node_attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def nbits_packed_bytes(N: int, K: int, bits: int, block: int, accuracy_level: int) -> int | None:
    """Bytes of MatMulNBits' pre-packed B on x86-64, or None when no packed kernel exists (then every
    run dequantizes B to K*N*4 bytes). 4-bit packs at every accuracy level; 8- and 2-bit only at 4
    (2-bit for block 32/64/128). At accuracy 4 (CompInt8) the packed buffer carries a float block sum
    and a float scale per (column, block) beside the codes: 1.5x B at block 32, 1.125x at 128,
    measured (docs/estimator.md, "packed sizes")."""
    kb = -(-K // block)
    codes = N * kb * block * bits // 8
    if bits == 4:
        return codes + (8 * N * kb if accuracy_level == 4 else 0)
    if bits == 8 and accuracy_level == 4:
        return codes + 8 * N * kb
    if bits == 2 and accuracy_level == 4 and block in (32, 64, 128):
        return codes + 8 * N * kb
    return None


def sgemm_packed_bytes(K: int, N: int) -> int:
    """MLAS ``MlasGemmPackBSize``: B padded to 16 columns, fp32."""
    return K * (-(-N // 16) * 16) * 4


def plan_model(root: og.OrtGraph, skeleton: onnx.ModelProto, shapes: shp.Shapes, st: OrtSettings, model_file: str,
          *, convert_qdq_ahead: bool = False) -> Recipe:
    ws = _collect_weights(root, model_file)
    notes: list[str] = []
    new: list[CreatedTensor] = []
    folds: list[CreatedTensor] = []
    const_names: dict[tuple[str, str], int] = {}  # folded outputs: key -> bytes

    # Level 1: constant folding, in execution order, until nothing changes (graph.cc / constant_folding.cc)
    folded_nodes: set[int] = set()
    if st.graph_optimization_level >= 1:
        for g in og.walk(root):
            changed = True
            while changed:
                changed = False
                for i in g.execution_order(st.execution_order):
                    node = g.nodes[i]
                    if id(node) in folded_nodes or node.op_type in _NO_FOLD or node.subgraphs or node.domain not in ("", "ai.onnx"):
                        continue
                    ins = [v for v in node.inputs if v]
                    if not ins or not all(g.find_initializer(v) is not None or (g.path, v) in const_names for v in ins):
                        continue
                    if node.op_type in ("Shape", "Size"):
                        continue
                    folded_nodes.add(id(node))
                    changed = True
                    out_bytes = sum(act.value_bytes(g, o, shapes, {}) for o in node.outputs if o)
                    srcs = []
                    for v in ins:
                        hit = g.find_initializer(v)
                        srcs.append((hit[0].path, v) if hit else (g.path, v))
                    for o in node.outputs:
                        if o:
                            const_names[(g.path, o)] = out_bytes
                    nw = CreatedTensor((g.path, node.outputs[0]), out_bytes, "fold", srcs)
                    folds.append(nw)
                    new.append(nw)
    # originals whose every use was folded are dropped
    for w in ws.values():
        w.folded_uses = sum(1 for _, n, _ in w.uses if id(n) in folded_nodes)
        if w.uses and not w.kept_uses:
            w.dropped_by = "fold"
    for nw in folds:  # a folded tensor consumed only by other folded nodes is itself transient
        g_path, name = nw.key
        users = [n for g in og.walk(root) if g.path == g_path for n in g.nodes if name in n.inputs]
        if users and all(id(n) in folded_nodes for n in users):
            nw.by = "fold-transient"

    # Level 2: DQ + MatMul -> MatMulNBits (exactly ORT's selection)
    qdq: list[tuple[CreatedTensor, CreatedTensor, CreatedTensor | None, list[tuple[str, str]]]] = []
    fused_consumers: dict[int, tuple[int, int, int, int, int]] = {}  # id(node) -> (K, N, bits, block, acc)
    fused_dq: set[int] = set()
    qdq_users: dict[tuple[str, str], list[tuple[og.OrtNode, int]]] = {}
    if st.graph_optimization_level >= 2 or convert_qdq_ahead:
        result = dq_matmul_match(skeleton, settings=st)
        for c in result.candidates:
            if c.ort_outcome == "session_error":
                notes.append(f"{c.node_name}: ORT 1.31.1 fails session creation on this fusion")
                continue
            g, mm = _locate(root, c)
            if g is None:
                notes.append(f"{c.node_name}: candidate not found in the graph view; counted as unfused")
                continue
            kb = -(-c.K // c.block_size)
            sitem = 2 if c.scale_dtype == TensorProto.FLOAT16 else 4
            b_new = CreatedTensor((g.path, c.weight + "_Q"), c.N * kb * c.block_size * c.bits // 8, "qdq",
                         [(g.path, c.weight)])
            s_new = CreatedTensor((g.path, c.scale + "_S"), c.N * kb * sitem, "qdq", [(g.path, c.scale)])
            z_new = None
            if c.has_zp or not c.signed:
                z_new = CreatedTensor((g.path, (c.zero_point or c.weight) + "_Z"), c.N * (-(-kb * c.bits // 8)), "qdq", [])
            srcs = []
            for name in (c.weight, c.scale, c.zero_point):
                if not name:
                    continue
                hit = g.find_initializer(name)
                if hit is not None:
                    srcs.append((hit[0].path, name))
                    ws[(hit[0].path, name)].dropped_by = "qdq"
            qdq.append((b_new, s_new, z_new, srcs))
            if mm is not None:
                for nw in (s_new, z_new):
                    if nw is not None:
                        qdq_users[nw.key] = [(mm, 0)]
            new += [b_new, s_new] + ([z_new] if z_new else [])
            dq = next((n for n in g.nodes if n.op_type == "DequantizeLinear" and c.weight in n.inputs[:1]), None)
            if dq is not None:
                fused_dq.add(id(dq))
            if mm is not None:
                fused_consumers[id(mm)] = (c.K, c.N, c.bits, c.block_size, c.accuracy_level)
                packed = nbits_packed_bytes(c.N, c.K, c.bits, c.block_size, c.accuracy_level) if st.prepacking else None
                if packed is not None:
                    b_new.packs.append((mm, packed))
                    if c.accuracy_level == 4:
                        s_new.read_at_create = True
                        if z_new:
                            z_new.read_at_create = True

    # Level 99 on x86: NCHWc Conv weights
    nchwc: list[CreatedTensor] = []
    block = nchwc_block()
    nchwc_convs: set[int] = set()
    if st.graph_optimization_level >= 99 and block:
        for g in og.walk(root):
            for node in g.nodes:
                if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
                    continue
                hit = g.find_initializer(node.inputs[1])
                if hit is None:
                    continue
                w = ws[(hit[0].path, node.inputs[1])]
                if w.data_type != TensorProto.FLOAT or len(w.dims) != 4 or w.dims[0] % block:
                    continue
                O, I, kh, kw = w.dims
                group = int(node_attr(node.proto, "group", 1) or 1)
                i_pad = I if (I < block or group != 1) else -(-I // block) * block
                nw = CreatedTensor((g.path, node.inputs[1] + "_nchwc"), O * i_pad * kh * kw * 4, "nchwc", [w.key])
                nchwc.append(nw)
                new.append(nw)
                nchwc_convs.add(id(node))
                if all(id(n) in nchwc_convs or n.op_type == "Conv" for _, n, _ in w.uses):
                    w.dropped_by = w.dropped_by or "nchwc"

    # Pre-packing of constant inputs by their kernels (SessionState::PrepackConstantInitializedTensors)
    packed_nbits: dict[int, bool] = {}
    if st.prepacking:
        folded_out = {nw.key: nw for nw in folds}
        for g in og.walk(root):
            for node in g.nodes:
                if id(node) in folded_nodes or id(node) in nchwc_convs:
                    continue
                for slot, pbytes in _packable_inputs(node, g, ws, folded_out, shapes):
                    name = node.inputs[slot]
                    hit = g.find_initializer(name)
                    if hit is not None:
                        ws[(hit[0].path, name)].packs.append((node, pbytes))
                    elif (g.path, name) in folded_out:
                        folded_out[(g.path, name)].packs.append((node, pbytes))
                if node.op_type == "MatMulNBits":
                    packed_nbits[id(node)] = _nbits_packs(node) is not None
                    if _nbits_packs(node) is not None and int(node_attr(node.proto, "accuracy_level", 0) or 0) == 4:
                        for s in node.inputs[2:4]:
                            hit = g.find_initializer(s) if s else None
                            if hit is not None:
                                ws[(hit[0].path, s)].read_at_create = True
    for nid in fused_consumers:
        K, N, bits, blk, acc = fused_consumers[nid]
        packed_nbits[nid] = st.prepacking and nbits_packed_bytes(N, K, bits, blk, acc) is not None
    removed = set(folded_nodes) | fused_dq
    kernel_order = [n for g in og.walk(root) for n in g.nodes if id(n) not in removed]
    largest = max([w.nbytes for w in ws.values() if w.packs and not w.dropped_by]
                  + [nw.nbytes for nw in new if nw.packs] + [0])
    return Recipe(ws, new, folds, qdq, nchwc, notes, packed_nbits, frozenset(removed), fused_consumers,
                 kernel_order, qdq_users, largest)


def _locate(root: og.OrtGraph, c) -> tuple[og.OrtGraph | None, og.OrtNode | None]:
    for g in og.walk(root):
        for node in g.nodes:
            if node.op_type in ("MatMul", "Gemm") and (node.name == c.node or node.label == c.node) and c.input_a in node.inputs:
                return g, node
    for g in og.walk(root):  # unnamed: the DQ's consumer reading the same A
        for node in g.nodes:
            if node.op_type in ("MatMul", "Gemm") and c.input_a in node.inputs and g.find_initializer(c.weight):
                return g, node
    return None, None


def _nbits_packs(node: og.OrtNode) -> int | None:
    p = node.proto
    K, N = int(node_attr(p, "K", 0) or 0), int(node_attr(p, "N", 0) or 0)
    bits, block = int(node_attr(p, "bits", 4) or 4), int(node_attr(p, "block_size", 32) or 32)
    acc = int(node_attr(p, "accuracy_level", 0) or 0)
    if len(node.inputs) > 6 and node.inputs[6]:  # g_idx: no packed kernel
        return None
    return nbits_packed_bytes(N, K, bits, block, acc)


def _packable_inputs(node: og.OrtNode, g: og.OrtGraph, ws, folded_out, shapes) -> list[tuple[int, int]]:
    """(input slot, packed bytes) for each constant input this kernel pre-packs."""

    def const(slot: int) -> tuple[int, tuple[int, ...]] | None:
        if slot >= len(node.inputs) or not node.inputs[slot]:
            return None
        name = node.inputs[slot]
        hit = g.find_initializer(name)
        if hit is not None:
            w = ws[(hit[0].path, name)]
            return w.data_type, w.dims
        if (g.path, name) in folded_out:
            s = shapes.get(g, name)
            if s is not None and s.known:
                return s.elem_type, tuple(s.dims)  # type: ignore[arg-type]
        return None

    op, dom = node.op_type, node.domain
    if dom == "com.microsoft" and op == "MatMulNBits":
        p = _nbits_packs(node)
        return [(1, p)] if p is not None and const(1) is not None else []
    if dom in ("", "ai.onnx") and op == "MatMul":
        b = const(1)
        if b is not None and b[0] == TensorProto.FLOAT and len(b[1]) == 2:
            return [(1, sgemm_packed_bytes(b[1][0], b[1][1]))]
    if dom in ("", "ai.onnx") and op == "Gemm":
        b = const(1)
        if b is not None and b[0] == TensorProto.FLOAT and len(b[1]) == 2:
            trans_b = int(node_attr(node.proto, "transB", 0) or 0)
            K, N = (b[1][1], b[1][0]) if trans_b else b[1]
            return [(1, sgemm_packed_bytes(K, N))]
    return []




# -------------------------------------------------------------- ortmem's own DQ+Gather rewrite
@dataclass
class OrtmemGathers:
    """What ortmem's DQ -> Gather rewrite (:mod:`ortmem.passes.rules.dq_gather`) changes in the graph ORT
    receives: the DQ node no longer runs (ORT has no such fusion, so on plain ORT it dequantizes the
    whole table into a V x D float activation on every run), and the table, its scales and zero
    points are read only in the rows the GatherBlockQuantized gathers."""

    removed: frozenset[int] = frozenset()  # id() of the DQ nodes that no longer run
    tables: dict[tuple[str, str], list[tuple[og.OrtGraph, og.OrtNode]]] = field(default_factory=dict)


def ortmem_gathers(root: og.OrtGraph, skeleton: onnx.ModelProto, st: OrtSettings) -> OrtmemGathers:
    """The DQ -> Gather pairs ortmem rewrites into GatherBlockQuantized on this release (the
    matcher's candidates the release probe accepts; none below ORT_ENABLE_BASIC)."""
    from ortmem.passes.rules.dq_gather import gathers_enabled
    from ortmem.passes.rules.dq_gather_match import dq_gather_match
    from ortmem.ort.release import capabilities
    from ortmem.ort.variants import onnx_type_name

    if not gathers_enabled(st):
        return OrtmemGathers()
    graphs = {g.path: g for g in og.walk(root)}
    caps = capabilities()
    removed: set[int] = set()
    tables: dict[tuple[str, str], list[tuple[og.OrtGraph, og.OrtNode]]] = {}
    for c in dq_gather_match(skeleton).candidates:
        if caps.gather_refusal(weight_type=onnx_type_name(c.weight_dtype), has_zp=c.zero_point is not None,
                               scale_type=onnx_type_name(c.scale_dtype)) is not None:
            continue
        g = graphs.get(c.graph_path)
        if g is None:
            continue
        dq = next((n for n in g.nodes if n.op_type == "DequantizeLinear" and n.inputs[:1] == [c.weight]), None)
        gather = next((n for n in g.nodes if n.op_type == "Gather" and c.indices in n.inputs[1:2]
                       and (n.name == c.node or n.label == c.node)), None)
        if dq is None or gather is None:
            continue
        if not c.dq_kept:
            removed.add(id(dq))
        for name in (c.weight, c.scale, c.zero_point):
            hit = g.find_initializer(name) if name else None
            if hit is not None:
                tables.setdefault((hit[0].path, name), []).append((g, gather))
    return OrtmemGathers(frozenset(removed), tables)
