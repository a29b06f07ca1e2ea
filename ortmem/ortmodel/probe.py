"""Ask the installed ONNX Runtime, with tiny models, what it does with the patterns ortmem rewrites.

Why a probe
-----------
What ORT fuses (``DQMatMulToMatMulNBits``: bit widths, zero points, scale types, block-size bounds) and
which ``MatMulNBits`` / ``GatherBlockQuantized`` variants its kernels run correctly change from release
to release (1.32 fuses block 512, 1.31 stops at 256; 1.25 refuses a 2-bit GatherBlockQuantized with zero
points and fails 2-bit MatMulNBits with fp16 scales at run time). A table read from one release's source is
not enough, so ortmem asks the build it runs on: for each variant it builds a DQ model of a few KiB,

1. lets ORT optimize it (``optimized_model_filepath``) and records whether ORT fused it and with which
   attributes (the *fusion* question: converting where ORT would not changes numerics);
2. runs ORT on the QDQ model (the reference) and on the model ortmem's own rewrite produces, and records
   whether the outputs are identical (the *kernel* question: ortmem must never write a node this ORT
   cannot run or runs differently).

This module is the child program (``python -m ortmem.ortmodel.probe`` prints one JSON object); it runs
in a subprocess because older releases crash the process on some malformed graphs, and a crash must
cost a probe, not the user's program. :mod:`ortmem.ortmodel.release` runs it once per ORT build and CPU
and caches the answer. About 130 tiny sessions: 2-5 s on a 2-core VM.
"""
from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INT2, UINT2 = 26, 25
#: (ONNX type, bits, signed) of every DQ weight type ortmem's rewrite knows.
WEIGHT_TYPES = {"int2": (INT2, 2, True), "uint2": (UINT2, 2, False), "int4": (TensorProto.INT4, 4, True),
                "uint4": (TensorProto.UINT4, 4, False), "int8": (TensorProto.INT8, 8, True),
                "uint8": (TensorProto.UINT8, 8, False)}
SCALE_TYPES = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
#: Block sizes swept for the fusion bound (int4, float scales, accuracy 4). ORT's rule takes powers of two.
BLOCK_SWEEP = (16, 32, 64, 128, 256, 512, 1024, 2048)
ACCURACY_LEVELS = (0, 4)
N_COLS = 8  # a multiple of 4, so 2-bit rows are byte aligned (1.31.1 gets 2-bit N % 4 != 0 wrong)


def onnx_type_name(code: int) -> str:
    """The probe's name of an ONNX element type (``"int4"``, ``"float16"``...), ``"type<N>"`` for others."""
    for name, (onnx_type, _, _) in WEIGHT_TYPES.items():
        if onnx_type == code:
            return name
    for name, onnx_type in SCALE_TYPES.items():
        if onnx_type == code:
            return name
    return f"type{code}"


def variant_key(kind: str, wtype: str, has_zp: bool, stype: str, accuracy: int = 4) -> str:
    """The key a probe answer is filed under (``release.Capabilities`` looks candidates up by it)."""
    return f"{kind}:{wtype}:{'zp' if has_zp else 'nozp'}:{stype}:acc{accuracy}"


def _codes(rng: np.random.Generator, wtype: str, shape: list[int]) -> TensorProto:
    onnx_type, bits, signed = WEIGHT_TYPES[wtype]
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    values = rng.integers(lo, hi, shape)
    if bits == 8:
        return numpy_helper.from_array(values.astype(np.int8 if signed else np.uint8), "W")
    # pack sub-byte codes low bits first, as ONNX stores int4/int2 raw data
    per = 8 // bits
    flat = (values.reshape(-1) & ((1 << bits) - 1)).astype(np.uint8)
    flat = np.concatenate([flat, np.zeros((-flat.size) % per, np.uint8)])
    packed = np.zeros(flat.size // per, np.uint8)
    for i in range(per):
        packed |= flat[i::per] << (bits * i)
    return helper.make_tensor("W", onnx_type, shape, packed.tobytes(), raw=True)


def _zero_points(rng: np.random.Generator, wtype: str, shape: list[int]) -> TensorProto:
    t = _codes(rng, wtype, shape)
    t.name = "Z"
    return t


def dq_matmul_model(wtype: str, stype: str, block: int, has_zp: bool, seed: int = 0, n: int = N_COLS) -> onnx.ModelProto:
    """``Y = A @ DequantizeLinear(W, S[, Z], axis=0, block_size)``, K = 2 blocks, N = 8 by default."""
    rng = np.random.default_rng(seed)
    k = 2 * block
    f = SCALE_TYPES[stype]
    np_f = np.float32 if stype == "float" else np.float16
    inits = [_codes(rng, wtype, [k, n]),
             numpy_helper.from_array(((rng.random((2, n)) + 0.5) / 64).astype(np_f), "S")]
    inputs = ["W", "S"]
    if has_zp:
        inits.append(_zero_points(rng, wtype, [2, n]))
        inputs.append("Z")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["Wd"], axis=0, block_size=block, name="dq"),
             helper.make_node("MatMul", ["A", "Wd"], ["Y"], name="mm")]
    g = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("A", f, [2, k])],
                          [helper.make_tensor_value_info("Y", f, [2, n])], inits)
    return _model(g, wtype)


def _model(g: onnx.GraphProto, wtype: str) -> onnx.ModelProto:
    """Opset 21 (blocked DequantizeLinear), 25 for 2-bit weights (int2/uint2 arrived in opset 25); IR 10."""
    opset = 25 if WEIGHT_TYPES[wtype][1] == 2 else 21
    return helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", opset)])


def dq_gather_model(wtype: str, stype: str, has_zp: bool, seed: int = 0) -> onnx.ModelProto:
    """``Y = Gather(DequantizeLinear(W, S[, Z], axis=1, block_size=16), ids)``, a [16, 32] table."""
    rng = np.random.default_rng(seed)
    v, d, block = 16, 32, 16
    f = SCALE_TYPES[stype]
    np_f = np.float32 if stype == "float" else np.float16
    inits = [_codes(rng, wtype, [v, d]),
             numpy_helper.from_array(((rng.random((v, d // block)) + 0.5) / 8).astype(np_f), "S")]
    inputs = ["W", "S"]
    if has_zp:
        inits.append(_zero_points(rng, wtype, [v, d // block]))
        inputs.append("Z")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["Wd"], axis=1, block_size=block, name="dq"),
             helper.make_node("Gather", ["Wd", "ids"], ["Y"], axis=0, name="ga")]
    g = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("Y", f, [3, d])], inits)
    return _model(g, wtype)


def _feeds(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {}
    for vi in m.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TensorProto.INT64:
            out[vi.name] = np.array([3, 0, 15], np.int64)
        else:
            dt = np.float16 if vi.type.tensor_type.elem_type == TensorProto.FLOAT16 else np.float32
            out[vi.name] = rng.standard_normal(shape).astype(dt)
    return out


def _session(ort: Any, path: Path, accuracy: int, level: Any = None, optimized: Path | None = None) -> Any:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    if level is not None:
        so.graph_optimization_level = level
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def probe_variant(ort: Any, m: onnx.ModelProto, accuracy: int, work: Path, fused_op: str,
                  convert: bool = True) -> dict[str, Any]:
    """Fusion and kernel answers for one model (see the module docstring)."""
    from ..convert import settings_from, write_converted
    from ..loader import load
    from ..passes.dq_matmul import plan_conversion
    from .release import unrestricted_capabilities

    work.mkdir(parents=True, exist_ok=True)
    src = work / "qdq.onnx"
    onnx.save(m, src)
    answer: dict[str, Any] = {}
    try:
        _session(ort, src, accuracy, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, work / "opt.onnx")
        opt = onnx.load(work / "opt.onnx", load_external_data=False)
        nodes = [n for n in opt.graph.node if n.op_type == fused_op]
        answer["fused"] = bool(nodes) and not any(n.op_type == "DequantizeLinear" for n in opt.graph.node)
        if nodes:
            answer["attrs"] = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute
                               if a.type == onnx.AttributeProto.INT}
    except Exception as exc:  # noqa: BLE001 - ORT's pybind errors: the answer is the message
        answer["fused"], answer["ort_error"] = False, _short(exc)
    feeds = _feeds(m)
    try:
        reference = _session(ort, src, accuracy).run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        answer["reference_error"] = _short(exc)
        return answer
    if not convert:
        return answer
    try:
        model = load(src)
        with model:
            plan = plan_conversion(model, settings_from(accuracy_level=accuracy), capabilities=unrestricted_capabilities())
            if not plan.has_work:
                answer["ortmem"] = "not converted"
                return answer
            out = work / "converted"
            out.mkdir()
            write_converted(model, plan, out)
        ours = _session(ort, out / "model.onnx", accuracy).run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        answer["ortmem"] = "error: " + _short(exc)
        return answer
    same = len(ours) == len(reference) and all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(ours, reference))
    if same:
        answer["ortmem"] = "equal"
    else:
        diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) for a, b in zip(ours, reference))
        answer["ortmem"] = f"differs (max |diff| {diff:.3g})"
    return answer


def probe_prepacked(ort: Any, work: Path) -> dict[str, Any]:
    """Does this release save pre-packed MatMulNBits weights to an external file, and does a session on
    the saved model give the QDQ model's outputs? (1.25 saves none; 1.32 re-packs and compares them.)"""
    from ..convert import settings_from, write_converted
    from ..loader import load
    from ..passes.dq_matmul import plan_conversion
    from ..prepacked import save_prepacked
    from .release import unrestricted_capabilities

    work.mkdir(parents=True, exist_ok=True)
    # B must be large enough to be stored as external data (ortmem keeps tensors of one page inline)
    m = dq_matmul_model("int4", "float", 128, False, n=128)
    src = work / "qdq.onnx"
    onnx.save(m, src)
    feeds = _feeds(m)
    reference = _session(ort, src, 4).run(None, feeds)
    out = work / "converted"
    out.mkdir()
    with load(src) as model:
        write_converted(model, plan_conversion(model, settings_from(accuracy_level=4),
                                               capabilities=unrestricted_capabilities()), out)
    try:
        saved = save_prepacked(out)
    except Exception as exc:  # noqa: BLE001 - PrepackError or ORT's own
        return {"saved": False, "error": _short(exc)}
    if saved is None:
        return {"saved": False}
    ours = _session(ort, saved, 4).run(None, feeds)
    return {"saved": True, "reload": "equal" if all(np.array_equal(a, b) for a, b in zip(ours, reference)) else "differs"}


def variants() -> Iterator[tuple[str, onnx.ModelProto, int, str, bool]]:
    """(key, model, accuracy level, fused op, convert?) for every question the probe asks."""
    for wtype in WEIGHT_TYPES:
        for has_zp in (False, True):
            for stype in SCALE_TYPES:
                for acc in ACCURACY_LEVELS:
                    yield (variant_key("matmul", wtype, has_zp, stype, acc),
                           dq_matmul_model(wtype, stype, 32, has_zp), acc, "MatMulNBits", True)
    for block in BLOCK_SWEEP:
        yield f"block:{block}", dq_matmul_model("int4", "float", block, False), 4, "MatMulNBits", True
    for wtype in ("uint2", "int4", "uint4", "uint8"):
        for has_zp in (False, True):
            for stype in SCALE_TYPES:
                yield (variant_key("gather", wtype, has_zp, stype), dq_gather_model(wtype, stype, has_zp), 4,
                       "GatherBlockQuantized", True)


def run_all() -> dict[str, Any]:
    import onnxruntime as ort

    ort.set_default_logger_severity(4)
    results: dict[str, Any] = {"onnxruntime": ort.__version__, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="ortmem-probe-") as tmp:
        for i, (key, m, acc, op, convert) in enumerate(variants()):
            try:
                results["variants"][key] = probe_variant(ort, m, acc, Path(tmp) / str(i), op, convert)
            except Exception as exc:  # noqa: BLE001 - one broken question must not lose the others
                results["variants"][key] = {"probe_error": _short(exc), "trace": traceback.format_exc(limit=3)}
        try:
            results["prepacked"] = probe_prepacked(ort, Path(tmp) / "prepacked")
        except Exception as exc:  # noqa: BLE001
            results["prepacked"] = {"saved": False, "probe_error": _short(exc)}
    return results


def main() -> None:
    """Entry point of the probe child (see :func:`ortmem.ortmodel.release.run_probe`)."""
    json.dump(run_all(), sys.stdout)
