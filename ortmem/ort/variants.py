"""The variants ortmem asks the installed ONNX Runtime about, and the tiny DQ models that pose them.

Pure (numpy + onnx only), so that the release layer (:mod:`ortmem.ort.release`) and the passes
can name variants without importing the probe program (:mod:`ortmem.measure.release_probe`), which sits above
the session path it exercises. The names are plain data (``TensorProto.DataType`` numbers, fixed by
onnx.proto, as in :mod:`ortmem.base.dtypes`) and onnx is imported only by the model builders, which only
the probe runs: a warm start reads the release's answers by these names and never imports onnx.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx
    from onnx import TensorProto

FLOAT, UINT8, INT8, INT64, FLOAT16, UINT4, INT4, UINT2, INT2 = 1, 2, 3, 7, 10, 21, 22, 25, 26
#: (ONNX type, bits, signed) of every DQ weight type ortmem's rewrite knows.
WEIGHT_TYPES = {"int2": (INT2, 2, True), "uint2": (UINT2, 2, False), "int4": (INT4, 4, True),
                "uint4": (UINT4, 4, False), "int8": (INT8, 8, True), "uint8": (UINT8, 8, False)}
SCALE_TYPES = {"float": FLOAT, "float16": FLOAT16}
#: Block sizes swept for the fusion bound (int4, float scales, accuracy 4). ORT's rule takes powers of two.
BLOCK_SWEEP = (16, 32, 64, 128, 256, 512, 1024, 2048)
ACCURACY_LEVELS = (0, 4)
#: DQ weight types a DQ+Gather can become GatherBlockQuantized from (uint2 travels as uint8 bits=2).
GATHER_WEIGHT_TYPES = ("uint2", "int4", "uint4", "uint8")
#: The probe's answer on :func:`dq_shared_weight_model`: whether ORT fuses DQs whose weight has other consumers.
SHARED_WEIGHT_KEY = "structure:shared_weight"
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
    from onnx import helper, numpy_helper

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
    from onnx import helper, numpy_helper

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
    from onnx import helper

    opset = 25 if WEIGHT_TYPES[wtype][1] == 2 else 21
    return helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", opset)])


def dq_gather_model(wtype: str, stype: str, has_zp: bool, seed: int = 0) -> onnx.ModelProto:
    """``Y = Gather(DequantizeLinear(W, S[, Z], axis=1, block_size=16), ids)``, a [16, 32] table."""
    from onnx import helper, numpy_helper

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
    g = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("ids", INT64, [3])],
                          [helper.make_tensor_value_info("Y", f, [3, d])], inits)
    return _model(g, wtype)


def dq_shared_weight_model(seed: int = 0) -> onnx.ModelProto:
    """Two DequantizeLinear nodes reading one int4 weight, each feeding a MatMul: the structural
    question of the shared-initializer guard (``DQMatMulToMatMulNBits`` rejects a DQ whose weight has
    other consumers from ORT PR #28326 on). Block 32, float scales, K = 64, N = 8."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    block, k, n = 32, 64, N_COLS
    inits = [_codes(rng, "int4", [k, n]),
             numpy_helper.from_array(((rng.random((2, n)) + 0.5) / 64).astype(np.float32), "S1"),
             numpy_helper.from_array(((rng.random((2, n)) + 0.5) / 64).astype(np.float32), "S2")]
    nodes = [helper.make_node("DequantizeLinear", ["W", "S1"], ["Wd1"], axis=0, block_size=block, name="dq1"),
             helper.make_node("DequantizeLinear", ["W", "S2"], ["Wd2"], axis=0, block_size=block, name="dq2"),
             helper.make_node("MatMul", ["A", "Wd1"], ["Y1"], name="mm1"),
             helper.make_node("MatMul", ["A", "Wd2"], ["Y2"], name="mm2")]
    g = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("A", FLOAT, [2, k])],
                          [helper.make_tensor_value_info("Y1", FLOAT, [2, n]),
                           helper.make_tensor_value_info("Y2", FLOAT, [2, n])], inits)
    return _model(g, "int4")
