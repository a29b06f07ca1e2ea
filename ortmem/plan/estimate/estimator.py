"""``ortmem.plan.estimate``: how much memory a model will need, before a single weight byte is read.

What is predicted, for plain ONNX Runtime, for ortmem's hook (cold start, or a warm start without
pre-packed weights: ORT loading the converted native twin) and for ortmem's default warm start
(``ortmem_prepacked``: the twin's pre-packed MatMulNBits weights mapped from the cache entry,
:mod:`ortmem.prepacked`), in bytes of resident memory, the process included, as ``ortmem bench``
measures them:

* ``session_peak_bytes``: the high-water mark of session creation;
* ``steady_bytes``: resident memory after the first run;
* both with and without allocator hygiene (``ortmem.hygiene``, issue 8): without it glibc keeps part
  of what ORT frees, with it resident memory is memory in use;
* ``activation_peak_bytes``: what the run itself holds at its worst, and a per-node table.

How (each term measured on ORT 1.31.1 and cited in ``docs/estimator.md``):

1. **What ORT does with each initializer**, decided from the graph and tensor metadata only:
   embedded bytes are parsed into the protobuf and copied once more into an OrtValue (tensor by
   tensor); external data is mapped and costs nothing until read; constant folding (level >= 1)
   materialises Cast/Mul/... chains on constants as new heap tensors; ``DQMatMulToMatMulNBits``
   (level >= 2, exactly the nodes :func:`~ortmem.passes.dq_matmul_match.dq_matmul_match` selects)
   copies weight, scales and zero points out, writes transposed MatMulNBits tensors and drops the
   originals; the NCHWc layout transformer (level 99, x86) writes reordered Conv weights; then kernels
   pre-pack constant inputs (MatMulNBits B: ``B + 8 bytes per (column, block)`` at accuracy level 4,
   ``B`` at 0-3; fp32 MatMul/Gemm B: ``K x roundup(N, 16) x 4``) and ORT drops an initializer once every
   use of it was packed, unless a subgraph reads it from an outer scope.
2. **The order** those allocations and frees happen in is replayed through a model of glibc malloc
   (:mod:`ortmem.plan.memsim`): resident memory without hygiene, memory in use with it.
3. **Constants** that no graph determines (the interpreter and imports, pages of ORT's own code faulted
   in during creation, ortmem's own import and skeleton, run-time thread and arena overhead) come from
   ``calibration.json``, measured by ``bench/estimator/calibrate.py``.
4. **Activations**: :mod:`ortmem.plan.activations` (shape inference with ``dims``, ORT's execution
   order from :mod:`ortmem.plan.ort_graph`, known workspaces).

Everything is computed on the graph ORT *receives*, with GELU/BiasGelu fused as ORT does (level >= 2); its other fusions (attention, layer norm,
MatMul+Add, ...) change the activation picture and are not replayed (see docs/estimator.md for the error).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Union

import onnx
from onnx import TensorProto

from ...dtypes import byte_size
from ...model import Model
from ...passes.dq_matmul_match import OrtSettings, dq_matmul_match
from ...ortmodel.release import capabilities
from . import activations as act
from ...ortmodel import graph_index as og
from .graph_context import Context, ort_view
from .memsim import Heap

MiB = 1 << 20
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")

#: Tensors this small stay inside the protobuf: ORT does not copy them into an OrtValue
#: (``Graph::ConvertInitializersIntoOrtValues``, graph.cc).
ORT_INLINE_MAX = 127
#: The buffer ORT reads a model file through while parsing it (malloc trace, see ``_simulate``).
LOAD_BUFFER_BYTES = 4 << 20
#: NCHWc block (MLAS ``MlasNchwcGetBlockSize``): 16 with AVX-512F, 8 with AVX2.
_CPU_FLAGS_FILE = "/proc/cpuinfo"
#: ops ORT's ConstantFolding never folds (control flow, randomness, QDQ kept for fusion).
_NO_FOLD = {"DequantizeLinear", "QuantizeLinear", "If", "Loop", "Scan", "RandomNormal", "RandomUniform",
            "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Constant"}

ModelLike = Union[str, os.PathLike, Model]


# --------------------------------------------------------------------------------------- results
@dataclass
class Side:
    """One way of creating the session (plain ORT, or through ortmem's hook). Bytes, absolute RSS."""

    session_peak_bytes: int
    steady_bytes: int
    session_peak_bytes_with_hygiene: int
    steady_bytes_with_hygiene: int
    session_peak_bytes_without_hygiene: int
    steady_bytes_without_hygiene: int
    after_create_bytes_without_hygiene: int
    after_create_bytes_with_hygiene: int
    in_use: dict[str, int] = field(default_factory=dict)  # steady memory in use by kind, above baseline
    peak_at: str = ""  # what was being done when resident memory peaked (without hygiene)


@dataclass
class NodeRow:
    """One node of the per-node table, in execution order (subgraph nodes after their parent)."""

    position: int
    graph: str
    node: str
    op: str
    unique_name: str
    weights_bytes: int  # initializers first used here (shared ones charged once; outer scope included)
    weights: list[str]
    inputs_bytes: int
    outputs_bytes: int
    workspace_bytes: int
    live_bytes: int  # activations alive at this node in its own graph, workspace included
    subgraph_weights_bytes: int = 0
    unknown: list[str] = field(default_factory=list)


@dataclass
class Estimate:
    model: str
    settings: dict[str, Any]
    ort: Side
    ortmem: Side  # the hook on a cold start, or a warm start without pre-packed weights (the twin)
    ortmem_prepacked: Side  # a warm start loading the entry's pre-packed weights (the default)
    activation_peak_bytes: int
    activation_peak_bytes_by_order: dict[str, int]
    unknown_shapes: list[dict[str, Any]]
    unresolved_dims: list[str]
    weights: dict[str, int]
    nodes: list[NodeRow]
    baseline_bytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


# ---------------------------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """Constants no graph determines; see calibration.json for the measurements behind them."""

    baseline_bytes: int = 68 * MiB
    session_fixed_bytes: int = int(7.4 * MiB)
    ortmem_fixed_bytes: int = int(8.5 * MiB)
    run_fixed_bytes: int = int(2.4 * MiB)
    #: share of (DQ-fusion sources + dropped embedded originals) glibc keeps beyond what the heap model
    #: explains, without hygiene (fitted on the calibration models; see docs/estimator.md)
    retention_fraction: float = 0.0
    source: str = "defaults"
    #: the release the constants were fitted on (``ortmem estimate`` warns on another one)
    onnxruntime: str = ""

    @classmethod
    def load(cls, path: Path = CALIBRATION_FILE) -> "Calibration":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        c = data.get("constants", {})
        return cls(**{k: (float(v) if k == "retention_fraction" else int(v)) for k, v in c.items()
                      if k in cls.__dataclass_fields__ and k not in ("source", "onnxruntime")}, source=str(path),
                   onnxruntime=str(data.get("onnxruntime", "")))

    def for_installed_release(self) -> "Calibration":
        """These constants with the import baseline the release probe measured on this machine and
        release (``ortmodel.release``), when it did: the one constant every estimate adds whole."""
        measured = capabilities().import_baseline_bytes
        return dataclasses.replace(self, baseline_bytes=measured) if measured else self

    def release_note(self) -> str | None:
        """A warning when the installed ORT is another (major, minor) than the one the constants were fitted on."""
        from ...ortmodel.release import installed, parse_version

        here = installed().version
        if not self.onnxruntime or parse_version(here)[:2] == parse_version(self.onnxruntime)[:2]:
            return None
        return (f"calibrated on onnxruntime {self.onnxruntime}; installed {here}: the allocator constants were not "
                "refitted for it (release-specific behaviour such as pre-packed validation is modelled)")


# ------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class _Settings:
    level: int
    accuracy_level: int
    execution_order: og.ExecutionOrder
    prepacking: bool
    ort: OrtSettings


def session_settings(session_options, accuracy_level: int | None) -> _Settings:
    from ...convert import settings_from
    from ...options import get_config

    st = settings_from(session_options, accuracy_level=accuracy_level)
    order: og.ExecutionOrder = "DEFAULT"
    prepacking = True
    if session_options is not None:
        if int(getattr(session_options, "execution_order", 0)) == 1:
            order = "PRIORITY_BASED"
        prepacking = (get_config(session_options, "session.disable_prepacking") or "0") != "1"
    return _Settings(st.graph_optimization_level, st.accuracy_level, order, prepacking, st)


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
class _W:
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


@dataclass
class _New:
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


def _collect_weights(root: og.OrtGraph, model_file: str) -> dict[tuple[str, str], _W]:
    ws: dict[tuple[str, str], _W] = {}
    for g in og.walk(root):
        for name, t in g.initializers.items():
            ws[(g.path, name)] = _W((g.path, name), tensor_bytes(t), _storage(t, model_file),
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
class _Plan:
    weights: dict[tuple[str, str], _W]
    new: list[_New]
    folds: list[_New]
    qdq: list[tuple[_New, _New, _New | None, list[tuple[str, str]]]]
    nchwc: list[_New]
    notes: list[str]
    packed_nbits_nodes: dict[int, bool]  # id(node) -> packed (workspace decision)
    removed: frozenset[int] = frozenset()  # id() of nodes that become constants (folded, fused DQ)
    fused: dict[int, tuple[int, int, int, int, int]] = field(default_factory=dict)  # MatMul id -> K,N,bits,block,acc
    kernel_order: list[og.OrtNode] = field(default_factory=list)  # the order kernels are created and pre-pack
    qdq_users: dict[tuple[str, str], list[tuple[og.OrtNode, int]]] = field(default_factory=dict)
    largest_pack_source: int = 0


def _attr(node: onnx.NodeProto, name: str, default=None):
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


def plan_model(root: og.OrtGraph, skeleton: onnx.ModelProto, shapes: act.Shapes, st: _Settings, model_file: str,
          *, convert_qdq_ahead: bool = False) -> _Plan:
    ws = _collect_weights(root, model_file)
    notes: list[str] = []
    new: list[_New] = []
    folds: list[_New] = []
    const_names: dict[tuple[str, str], int] = {}  # folded outputs: key -> bytes

    # Level 1: constant folding, in execution order, until nothing changes (graph.cc / constant_folding.cc)
    folded_nodes: set[int] = set()
    if st.level >= 1:
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
                    nw = _New((g.path, node.outputs[0]), out_bytes, "fold", srcs)
                    folds.append(nw)
                    new.append(nw)
    # originals whose every use was folded are dropped
    for w in ws.values():
        if w.uses and all(id(n) in folded_nodes for _, n, _ in w.uses):
            w.dropped_by = "fold"
    for nw in folds:  # a folded tensor consumed only by other folded nodes is itself transient
        g_path, name = nw.key
        users = [n for g in og.walk(root) if g.path == g_path for n in g.nodes if name in n.inputs]
        if users and all(id(n) in folded_nodes for n in users):
            nw.by = "fold-transient"

    # Level 2: DQ + MatMul -> MatMulNBits (exactly ORT's selection)
    qdq: list[tuple[_New, _New, _New | None, list[tuple[str, str]]]] = []
    fused_consumers: dict[int, tuple[int, int, int, int, int]] = {}  # id(node) -> (K, N, bits, block, acc)
    fused_dq: set[int] = set()
    qdq_users: dict[tuple[str, str], list[tuple[og.OrtNode, int]]] = {}
    if st.level >= 2 or convert_qdq_ahead:
        result = dq_matmul_match(skeleton, settings=st.ort)
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
            b_new = _New((g.path, c.weight + "_Q"), c.N * kb * c.block_size * c.bits // 8, "qdq",
                         [(g.path, c.weight)])
            s_new = _New((g.path, c.scale + "_S"), c.N * kb * sitem, "qdq", [(g.path, c.scale)])
            z_new = None
            if c.has_zp or not c.signed:
                z_new = _New((g.path, (c.zero_point or c.weight) + "_Z"), c.N * (-(-kb * c.bits // 8)), "qdq", [])
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
    nchwc: list[_New] = []
    block = nchwc_block()
    nchwc_convs: set[int] = set()
    if st.level >= 99 and block:
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
                group = int(_attr(node.proto, "group", 1) or 1)
                i_pad = I if (I < block or group != 1) else -(-I // block) * block
                nw = _New((g.path, node.inputs[1] + "_nchwc"), O * i_pad * kh * kw * 4, "nchwc", [w.key])
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
                    if _nbits_packs(node) is not None and int(_attr(node.proto, "accuracy_level", 0) or 0) == 4:
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
    return _Plan(ws, new, folds, qdq, nchwc, notes, packed_nbits, frozenset(removed), fused_consumers,
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
    K, N = int(_attr(p, "K", 0) or 0), int(_attr(p, "N", 0) or 0)
    bits, block = int(_attr(p, "bits", 4) or 4), int(_attr(p, "block_size", 32) or 32)
    acc = int(_attr(p, "accuracy_level", 0) or 0)
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
            trans_b = int(_attr(node.proto, "transB", 0) or 0)
            K, N = (b[1][1], b[1][0]) if trans_b else b[1]
            return [(1, sgemm_packed_bytes(K, N))]
    return []


# ------------------------------------------------------------------------ creation, replayed
@dataclass
class _Sim:
    after_create_rss: int
    after_create_in_use: int
    peak_rss: int
    peak_in_use: int
    peak_at: str
    steady_rss: int
    steady_in_use: int
    in_use: dict[str, int]


def _new_initializer(h: Heap, nw: _New, label: str):
    """A tensor an optimizer creates: computed into an ``Initializer``, serialized into a TensorProto
    (``Initializer::ToProto``, a copy) for ``Graph::AddInitializedTensor``, which converts it into an
    OrtValue (another copy); the first two are freed. Three buffers, one kept."""
    work = h.alloc(nw.nbytes, f"Initializer {nw.key[1]}")
    proto = h.alloc(nw.nbytes, f"TensorProto {nw.key[1]}")
    h.free(work)
    kept = h.alloc(nw.nbytes, label)
    h.free(proto)
    return kept


def _simulate(plan: _Plan, *, dynamic: bool, all_external: bool, activation_peak: int, run_touch: int,
              prepacked: bool = False, blobs_read_at_create: bool = False) -> _Sim:
    """Replay session creation's allocations (and one run) through the glibc model.

    ``prepacked``: ORT loads the cache entry's pre-packed model (:mod:`ortmem.prepacked`): it still
    packs every MatMulNBits ``B`` on the heap, hashes the result, finds the saved blob and frees its
    copy once that kernel is done; the saved blobs (MatMulNBits ``B`` only, fp32 MatMul/Gemm packs
    stay on the heap) are not touched during creation and are read by the first run, file-backed.
    ``blobs_read_at_create``: the release compares every saved blob with its fresh packing during
    creation (``ortmodel.release`` ``prepacked_validated``, 1.32 on), so the blobs are resident file
    pages from creation on rather than from the first run."""
    h = Heap(dynamic=dynamic)
    ws = plan.weights

    def storage(w: _W) -> str:
        return "external" if all_external and w.storage == "embedded" else w.storage

    # A: parse (embedded bytes into the protobuf), then copy each into an OrtValue, freeing the proto copy
    # A subgraph's initializers live inside its parent node's attribute: ``Graph::AddNode`` copies the
    # NodeProto's attributes into the Node (``Node::AddAttributeProto``, graph.cc) and
    # ``Node::CreateSubgraph`` builds the subgraph on that copy, while the ModelProto keeps the original
    # node; neither copy's bytes are released (measured: a 4 MiB fp32 weight local to a Loop body,
    # embedded, leaves 8 MiB more in use after creation than the same weight in the main graph).
    emb = [w for w in ws.values() if storage(w) == "embedded" and w.nbytes > ORT_INLINE_MAX]
    # The load reads the file through a 4 MiB buffer that is freed once the ModelProto is parsed
    # (malloc trace of ORT 1.31.1 creating a session on an embedded 20 MB and 134 MB model: one
    # 4,194,304-byte block before the tensors' raw_data strings, freed right after them). Being the
    # first large mmapped block freed, it lifts glibc's mmap threshold to 4 MiB before the OrtValue
    # copies are made: from then on every block under 4 MiB lives in the heap.
    read_buf = h.alloc(min(LOAD_BUFFER_BYTES, sum(w.nbytes for w in emb)), "model file read buffer") if emb else None
    protos = [h.alloc(w.nbytes, "protobuf parse") for w in emb]
    h.free(read_buf)
    attr_copies = [h.alloc(w.nbytes, f"subgraph attribute copy of {w.key[1]}") for w in emb if w.key[0]]
    held: dict[tuple[str, str], Any] = {}
    for w, blk in zip(emb, protos):
        held[w.key] = h.alloc(w.nbytes, f"OrtValue copy of {w.key[1]}")
        if not w.key[0]:
            h.free(blk)
    mapped: dict[tuple[str, str], Any] = {}

    def source_block(key: tuple[str, str], nbytes: int, label: str):
        """Memory of a source being read: its heap OrtValue, or its file pages mapped in."""
        if key in held:
            return held[key], False
        if key in mapped:
            return mapped[key], False
        w = ws.get(key)
        if w is not None and storage(w) == "inline":
            return None, False
        return h.map_file(nbytes, label), True

    def drop(key: tuple[str, str]) -> None:
        h.free(held.pop(key, None))
        h.free(mapped.pop(key, None))

    # B1: constant folding (Initializer copies of the inputs, the folded output kept)
    new_blocks: dict[tuple[str, str], Any] = {}
    for nw in plan.folds:
        copies = [h.alloc(ws[s].nbytes if s in ws else 0, "constant folding copy") for s in nw.sources
                  if (s in ws and ws[s].nbytes >= 1024)]
        new_blocks[nw.key] = _new_initializer(h, nw, f"folded {nw.key[1]}")
        for c in copies:
            h.free(c)
    for k in [nw.key for nw in plan.folds if nw.by == "fold-transient"]:
        h.free(new_blocks.pop(k, None))
    for w in ws.values():
        if w.dropped_by == "fold":
            drop(w.key)
    # B2: DQ+MatMul fusion (copies of weight/scale/zp, transposed tensors kept, originals dropped at Resolve)
    if not all_external:
        for b_new, s_new, z_new, srcs in plan.qdq:
            outs = [nw for nw in (b_new, s_new, z_new) if nw is not None]
            copies = [h.alloc(ws[s].nbytes, "DQ fusion Initializer copy") for s in srcs]
            for nw in outs:
                new_blocks[nw.key] = _new_initializer(h, nw, f"fused {nw.key[1]}")
            for c in copies:
                h.free(c)
        for w in ws.values():
            if w.dropped_by == "qdq":
                drop(w.key)
    # B3: NCHWc reorder, Conv by Conv (``NchwcTransformerImpl::TransformConv``): ``Initializer
    # conv_W`` copies the filter, ``std::vector<float> reordered_filter`` receives the reordered one,
    # its bytes are set into a TensorProto's raw_data and ``AddInitializerWithOrtValue`` copies them
    # into the kept OrtValue; leaving the scope frees the proto, the vector and the copy, in that
    # order. Malloc trace of ORT 1.31.1 on the conv net: per filter ``a W, a W', a W'+1, a W'`` then
    # ``f W'+1, f W', f W``; the original filters are freed after the last Conv.
    for nw in plan.nchwc:
        copy = h.alloc(sum(ws[s].nbytes for s in nw.sources), "NCHWc Initializer copy")
        work = h.alloc(nw.nbytes, f"reordered filter {nw.key[1]}")
        proto = h.alloc(nw.nbytes + 1, f"TensorProto {nw.key[1]}")
        new_blocks[nw.key] = h.alloc(nw.nbytes, f"reordered {nw.key[1]}")
        for b in (proto, work, copy):
            h.free(b)
    for w in ws.values():
        if w.dropped_by == "nchwc":
            drop(w.key)

    # C: kernels pre-pack their constant inputs node by node (index order, main graph first); a
    # source is dropped once every use of it was packed; inputs a packing kernel reads but keeps
    # (MatMulNBits scales and zero points at accuracy level 4) stay mapped
    packed_total = 0
    by_node: dict[int, list[tuple[Any, int]]] = {}
    for w in ws.values():
        if w.packs and not w.dropped_by:
            for node, pb in w.packs:
                by_node.setdefault(id(node), []).append((w, pb))
    for nw in plan.new:
        if nw.packs and (all_external or nw.key in new_blocks):
            for node, pb in nw.packs:
                by_node.setdefault(id(node), []).append((nw, pb))
    reads: dict[int, list[Any]] = {}
    for w in ws.values():
        if w.read_at_create and not w.dropped_by:
            for _, node, _ in w.uses:
                reads.setdefault(id(node), []).append(w)
    for nw in plan.new:
        if nw.read_at_create:
            for node, _ in plan.qdq_users.get(nw.key, []):
                reads.setdefault(id(node), []).append(nw)
    done: dict[tuple[str, str], int] = {}
    live_src: dict[tuple[str, str], Any] = {}
    saved = 0  # pre-packed blobs ORT maps from prepacked.bin instead of keeping its heap copy
    for node in plan.kernel_order:
        items = by_node.get(id(node), [])
        hashed = []
        for obj, pb in items:
            if obj.key not in live_src:
                if obj.key in new_blocks:
                    live_src[obj.key] = new_blocks[obj.key]
                elif isinstance(obj, _New):  # ortmem: converted tensors are mapped files
                    live_src[obj.key] = h.map_file(obj.nbytes, f"mapped {obj.key[1]}")
                else:
                    live_src[obj.key], _ = source_block(obj.key, obj.nbytes, f"mapped {obj.key[1]}")
            blk = h.alloc(pb, f"pre-packed {obj.key[1]}")
            if prepacked and (node.op_type == "MatMulNBits" or id(node) in plan.fused):
                hashed.append(blk)
                saved += pb
                if blobs_read_at_create:
                    h.map_file(pb, f"saved blob of {obj.key[1]} compared")
            else:
                packed_total += pb
        for obj in reads.get(id(node), []):
            if obj.key in held or obj.key in mapped or obj.key in new_blocks:
                continue
            if isinstance(obj, _W) and storage(obj) != "external":
                continue
            mapped[obj.key] = h.map_file(obj.nbytes, f"read {obj.key[1]}")
        for blk in hashed:  # the hash matched a saved blob: the kernel uses the mapping instead
            h.free(blk)
        for obj, _ in items:
            done[obj.key] = done.get(obj.key, 0) + 1
            if done[obj.key] < len(obj.packs):
                continue
            src = live_src.pop(obj.key, None)
            # an embedded weight a subgraph reads from the outer scope is dropped like any other once
            # packed (measured: same in-use as the weight in the main graph); an external one stays mapped
            keep = isinstance(obj, _W) and ((obj.outer_use and storage(obj) != "embedded")
                                            or len(obj.packs) < len(obj.uses))
            if keep:
                if src is not None and obj.key not in held:
                    mapped[obj.key] = src
                continue
            if isinstance(obj, _New):
                h.free(new_blocks.pop(obj.key, None) if obj.key in new_blocks else src)
            else:
                if src is not None and src.kind == "file":
                    h.free(src)
                drop(obj.key)
    after_rss, after_in_use = h.rss, h.in_use_total
    peak_rss, peak_at, peak_in_use = h.peak_rss, h.peak_label, h.peak_in_use
    if not dynamic:
        h.trim()  # hygiene's malloc_trim(0) after creation
        after_rss = h.rss
    # one run: external weights (and saved pre-packed blobs) read for the first time, the arena's activations
    h.map_file(run_touch + (0 if blobs_read_at_create else saved), "first run reads mapped weights")
    h.alloc(activation_peak, "activations")
    steady_rss, steady_in_use = h.rss, h.in_use_total
    in_use = {
        "packed_weights": packed_total,
        "heap_weights": sum(b.size for b in held.values()) + sum(b.size for b in new_blocks.values()),
        "subgraph_proto_copies": sum(b.size for b in attr_copies) + sum(w.nbytes for w in emb if w.key[0]),
        "mapped_weights_read": sum(b.size for b in mapped.values()) + run_touch,
        "mapped_prepacked_weights": saved,
        "activations": activation_peak,
    }
    return _Sim(after_rss, after_in_use, peak_rss, peak_in_use, peak_at, steady_rss, steady_in_use, in_use)


def retention_basis(plan: _Plan, all_external: bool) -> int:
    """Bytes whose release glibc keeps beyond the heap model (calibrated by ``retention_fraction``):
    the sources ORT's DQ fusion copies and drops, and embedded originals dropped after folding,
    fusion, NCHWc or pre-packing. ortmem's path has neither (converted ahead, nothing embedded)."""
    if all_external:
        return 0
    fused = {s for _, _, _, srcs in plan.qdq for s in srcs}
    total = sum(plan.weights[s].nbytes for s in fused)
    for w in plan.weights.values():
        if w.key in fused or w.storage != "embedded" or w.nbytes <= ORT_INLINE_MAX:
            continue
        if w.dropped_by or (w.packs and len(w.packs) == len(w.uses)):  # embedded: outer-scope ones too
            total += w.nbytes
    return total


def _run_touch(plan: _Plan, shapes: act.Shapes, root: og.OrtGraph, all_external: bool) -> int:
    """Bytes of external weights a run reads that creation did not: kept (not packed away) tensors,
    whole, except Gather tables, of which only the gathered rows are read."""
    total = 0
    for w in plan.weights.values():
        ext = w.storage == "external" or (all_external and w.storage == "embedded")
        if not ext or w.dropped_by or w.read_at_create or (w.packs and not w.outer_use and len(w.packs) == len(w.uses)):
            continue
        if w.packs and w.outer_use:
            continue  # read during packing, counted as mapped at creation
        gathers = [(g, n) for g, n, slot in w.uses if n.op_type == "Gather" and slot == 0]
        if gathers and len(gathers) == len(w.uses) and w.dims:
            rows = 0
            for g, n in gathers:
                idx = shapes.get(g, n.inputs[1]) if len(n.inputs) > 1 else None
                rows += math.prod(idx.dims) if idx is not None and idx.known else w.dims[0]  # type: ignore[arg-type]
            row_bytes = w.nbytes // max(w.dims[0], 1)
            total += min(w.nbytes, rows * -(-max(row_bytes, 1) // 4096) * 4096)
        else:
            total += w.nbytes
    return total


# ------------------------------------------------------------------------------ activations
def workspace_fn(plan: _Plan, st: _Settings, nchwc: bool):
    def workspace(node: og.OrtNode, shapes: act.Shapes) -> int:
        g = node.graph
        if node.op_type == "MatMulNBits" or id(node) in plan.fused:
            if id(node) in plan.fused:
                K, N, _, block, acc = plan.fused[id(node)]
            else:
                p = node.proto
                K, N = int(_attr(p, "K", 0) or 0), int(_attr(p, "N", 0) or 0)
                block = int(_attr(p, "block_size", 32) or 32)
                acc = int(_attr(p, "accuracy_level", 0) or 0)
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


def _node_rows(root: og.OrtGraph, shapes: act.Shapes, order: og.ExecutionOrder, workspace,
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
    from ...loader import load

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
    st = session_settings(session_options, accuracy_level)
    skeleton = model.skeleton
    root = og.build(skeleton.graph)
    shapes = act.infer_shapes(skeleton, root, dims)
    model_file = Path(model.path).name
    plan = plan_model(root, skeleton, shapes, st, model_file)
    nchwc = st.level >= 99 and bool(nchwc_block())
    estimator_ws = workspace_fn(plan, st, nchwc)

    def workspace(node: og.OrtNode, sh: act.Shapes) -> int:
        return estimator_ws(node, sh) + act.kernel_temporaries(node, sh)

    # in-place reuse: the rule measured on ORT 1.31.1 that the planners use too (liveness.Context)
    rules = Context(skeleton, root, shapes, plan.removed, workspace, dims, st.execution_order, ort_view(skeleton))
    merged = act.ort_fusions(root) if st.level >= 2 else {}  # Gelu/BiasGelu run as one kernel
    unknown: dict = {}
    act_peak, rows = _node_rows(root, shapes, st.execution_order, workspace, unknown, plan.removed,
                                rules.inplace_slots, merged)
    other = "PRIORITY_BASED" if st.execution_order == "DEFAULT" else "DEFAULT"
    other_peak = act.graph_activation(root, shapes, other, workspace, {}, plan.removed,
                                      inplace=rules.inplace_slots, merged=merged).peak_bytes

    def side(all_external: bool, fixed: int, prepacked: bool = False) -> Side:
        touch = _run_touch(plan, shapes, root, all_external)
        base = cal.baseline_bytes + cal.session_fixed_bytes + fixed
        sim = dict(all_external=all_external, activation_peak=act_peak, run_touch=touch, prepacked=prepacked,
                   blobs_read_at_create=prepacked and capabilities().prepacked_validated)
        no = _simulate(plan, dynamic=True, **sim)
        yes = _simulate(plan, dynamic=False, **sim)
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
    ortmem_side = side(True, cal.ortmem_fixed_bytes)
    # the hook keeps a cache entry (and pre-packs it on the first hit) only for a model it converts;
    # any other model is handed to ORT as it is, on every start
    # a release that saves no pre-packed weights (1.25) warm-starts from the entry itself
    saves = capabilities().prepacked_save
    prepacked_side = side(True, cal.ortmem_fixed_bytes, prepacked=True) if plan.qdq and saves else ortmem_side
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
    if st.level >= 1:
        notes.append("activations are computed on the graph as given; GELU/BiasGelu fused as ORT does; ORT's other fusions (layer norm, "
                     "attention, MatMul+Add) change intermediate tensors")
    return Estimate(
        model=str(model.path),
        settings={"graph_optimization_level": st.level, "accuracy_level": st.accuracy_level,
                  "execution_order": st.execution_order, "prepacking": st.prepacking, "dims": dims,
                  "hygiene": hygiene, "calibration": cal.source},
        ort=ort_side,
        ortmem=ortmem_side,
        ortmem_prepacked=prepacked_side,
        activation_peak_bytes=act_peak,
        activation_peak_bytes_by_order={st.execution_order: act_peak, other: other_peak},
        unknown_shapes=[asdict(u) for u in unknown.values()],
        unresolved_dims=sorted(shapes.unresolved_symbols),
        weights=weights,
        nodes=rows,
        baseline_bytes=cal.baseline_bytes,
        notes=notes,
    )


def render(e: Estimate, *, max_nodes: int = 40) -> str:
    """The estimate for people: totals, then the heaviest nodes."""
    m = lambda b: f"{b / MiB:,.1f} MiB"  # noqa: E731
    lines = [f"model: {e.model}",
             f"weights: {m(e.weights['total_bytes'])} ({m(e.weights['embedded_bytes'])} embedded, "
             f"{m(e.weights['external_bytes'])} external)",
             f"process baseline (interpreter + imports): {m(e.baseline_bytes)}",
             f"{'':22}{'peak':>14}{'steady':>14}{'peak+hyg':>14}{'steady+hyg':>14}"]
    for label, s in (("onnxruntime", e.ort), ("ortmem", e.ortmem), ("ortmem pre-packed", e.ortmem_prepacked)):
        lines.append(f"{label:22}{m(s.session_peak_bytes_without_hygiene):>14}{m(s.steady_bytes_without_hygiene):>14}"
                     f"{m(s.session_peak_bytes_with_hygiene):>14}{m(s.steady_bytes_with_hygiene):>14}")
    lines.append(f"activation peak ({e.settings['execution_order']}): {m(e.activation_peak_bytes)}"
                 + "".join(f"; {k}: {m(v)}" for k, v in e.activation_peak_bytes_by_order.items()
                           if k != e.settings["execution_order"]))
    if e.unresolved_dims:
        lines.append(f"unresolved dims (pass --dim NAME=VALUE): {', '.join(e.unresolved_dims)}")
    if e.unknown_shapes:
        lines.append(f"{len(e.unknown_shapes)} tensors of unknown size counted as 0, e.g. "
                     + ", ".join(u["value"] for u in e.unknown_shapes[:5]))
    heavy = sorted(e.nodes, key=lambda r: -(r.weights_bytes + r.live_bytes))[:max_nodes]
    if heavy:
        lines.append(f"{'node':40}{'op':18}{'weights':>12}{'outputs':>12}{'workspace':>12}{'live':>12}")
        for r in sorted(heavy, key=lambda r: r.position):
            name = (r.graph + ":" if r.graph else "") + r.node
            lines.append(f"{name[:39]:40}{r.op[:17]:18}{m(r.weights_bytes):>12}{m(r.outputs_bytes):>12}"
                         f"{m(r.workspace_bytes):>12}{m(r.live_bytes):>12}")
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)
