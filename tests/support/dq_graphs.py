"""DequantizeLinear graphs with the knobs ortmem's matchers read (weight and scale types, axis, block size,
zero points, shapes), built by hand with ``onnx.helper``: the matcher tests, the conversion tests and
``bench/converted_digests.py`` build the same ones.

Weights are random codes from a generator seeded by the graph's tag (``zlib.crc32``: ``hash()``
differs per process), so a graph is the same bytes in every run.
"""
from __future__ import annotations

import zlib

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as H
from onnx import numpy_helper as nh

from tests.support.builders import make_model

INT2, UINT2 = 26, 25
K, N = 64, 16
RANGES = {T.INT4: (-8, 8), T.UINT4: (0, 16), T.INT8: (-128, 128), T.UINT8: (0, 256), INT2: (-2, 2), UINT2: (0, 4),
          T.INT16: (-100, 100), T.UINT16: (0, 100)}
NP_NAMES = {T.INT4: "int4", T.UINT4: "uint4", INT2: "int2", UINT2: "uint2"}  # ml_dtypes' names of the sub-byte types


def rng_for(tag: str) -> np.random.Generator:
    """The generator of the graph named ``tag``: the same codes in every run and process."""
    return np.random.default_rng(zlib.crc32(tag.encode()))  # hash() differs per process


def wt(name: str, shape, dtype=T.INT4, rng=None, values=None) -> T:
    """Quantized weight codes of ``dtype`` (random in the type's range, or ``values``)."""
    rng = rng or np.random.default_rng(0)
    lo, hi = RANGES[dtype]
    v = rng.integers(lo, hi, shape) if values is None else np.asarray(values)
    if dtype in NP_NAMES:
        import ml_dtypes  # onnx's own dependency

        return nh.from_array(v.astype(getattr(ml_dtypes, NP_NAMES[dtype])), name)
    return nh.from_array(v.astype(onnx.helper.tensor_dtype_to_np_dtype(dtype)), name)


def st(name: str, shape, dtype=T.FLOAT, rng=None, value=None) -> T:
    """Scales of ``dtype`` in [0.5, 1.5) (or all ``value``); bfloat16 written as its raw bits."""
    rng = rng or np.random.default_rng(1)
    v = (rng.random(shape) + 0.5) if value is None else np.full(shape, value)
    if dtype == T.BFLOAT16:
        bits = (np.asarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        t = T(name=name, data_type=T.BFLOAT16, dims=list(np.shape(v)))
        t.raw_data = bits.tobytes()
        return t
    return nh.from_array(np.asarray(v, onnx.helper.tensor_dtype_to_np_dtype(dtype)), name)


def vi(name, shape, dtype=T.FLOAT):
    """A graph input or output."""
    return H.make_tensor_value_info(name, dtype, shape)


def dqn(w="W", s="S", z=None, out="Wd", name="dq", **attrs):
    """The DequantizeLinear node (zero point optional)."""
    return H.make_node("DequantizeLinear", [w, s] + ([z] if z is not None else []), [out], name=name, **attrs)


def mm(a="A", b="Wd", y="Y", name="mm"):
    """The MatMul reading the dequantized weight."""
    return H.make_node("MatMul", [a, b], [y], name=name)


def model(nodes, inputs, outputs, inits, opset=21, extra_opsets=()):
    """The graph as a model at IR 10 (what every supported ORT release reads)."""
    return make_model(H.make_graph(nodes, "g", inputs, outputs, inits),
                      opset_imports=[H.make_opsetid("", opset), *extra_opsets])


def dq_mm(*, k=K, n=N, wtype=T.INT4, stype=T.FLOAT, block=32, axis=0, scale_shape=None, zp=False,
          zp_shape=None, attrs=None, opset=21, tag="m"):
    """DQ(W) -> MatMul(A, .) with the knobs the rule looks at."""
    rng = rng_for(tag)
    if scale_shape is None:
        scale_shape = [-(-k // block), n]
    inits = [wt("W", [k, n], wtype, rng), st("S", scale_shape, stype, rng)]
    z = None
    if zp:
        inits.append(wt("Z", scale_shape if zp_shape is None else zp_shape, wtype, rng))
        z = "Z"
    if attrs is None:
        attrs = dict(axis=axis, block_size=block)
    at = stype
    return model([dqn(z=z, **attrs), mm()], [vi("A", [2, k], at)], [vi("Y", [2, n], at)], inits, opset=opset)


V, D = 12, 64  # the DQ+Gather table's rows and columns
MS = H.make_opsetid("com.microsoft", 1)


def dq_gather(tag, *, wtype=T.INT4, stype=T.FLOAT, attrs=None, scale_shape=None, zp=False, table=(V, D),
              extra_nodes=(), extra_outputs=(), gather_axis=0, idx_type=T.INT64, cast_to=None):
    """DQ(table) -> Gather(ids) [-> Cast]: the DQ+Gather form the matcher reads, with its knobs."""
    rng = rng_for(tag)
    attrs = dict(axis=1, block_size=16) if attrs is None else attrs
    if scale_shape is None:
        scale_shape = [table[0], -(-table[1] // attrs.get("block_size", 16))]
    inits = [wt("W", list(table), wtype, rng), st("S", scale_shape, stype, rng)]
    z = None
    if zp:
        inits.append(wt("Z", scale_shape, wtype, rng))
        z = "Z"
    nodes = [dqn(z=z, **attrs), H.make_node("Gather", ["Wc" if cast_to else "Wd", "ids"], ["Y"], name="gather", axis=gather_axis),
             *extra_nodes]
    if cast_to:
        nodes.insert(1, H.make_node("Cast", ["Wd"], ["Wc"], name="cast", to=cast_to))
    return model(nodes, [vi("ids", [5], idx_type)], [vi("Y", None, cast_to or stype), *extra_outputs], inits,
                 opset=25 if wtype in (INT2, UINT2) else 21)


GATHERS = {
    "int4_blockwise_zp": dict(zp=True),
    "int4_blockwise": dict(),
    "uint4_blockwise": dict(wtype=T.UINT4),
    "uint8_zp": dict(wtype=T.UINT8, zp=True),
    "uint8_no_zp": dict(wtype=T.UINT8),
    "uint2_zp": dict(wtype=UINT2, zp=True, attrs=dict(axis=1, block_size=16)),
    "int4_block_larger_than_row": dict(attrs=dict(axis=1, block_size=128)),
    "int4_block_1024": dict(attrs=dict(axis=1, block_size=1024)),
    "int4_odd_width": dict(table=(V, 41)),
    "int4_blocks_along_rows": dict(attrs=dict(axis=0, block_size=16), scale_shape=[1, D]),
    "int4_per_row_zp": dict(attrs=dict(axis=0), scale_shape=[V], zp=True),
    "uint8_per_row": dict(wtype=T.UINT8, attrs=dict(axis=0), scale_shape=[V]),
    "int4_per_column": dict(attrs=dict(axis=1), scale_shape=[D]),
    "int4_per_tensor_zp": dict(attrs={}, scale_shape=[], zp=True),
    "uint8_per_tensor": dict(wtype=T.UINT8, attrs={}, scale_shape=[]),
    "fp16_scales": dict(stype=T.FLOAT16),
    "int32_indices": dict(idx_type=T.INT32),
    "fp16_then_cast_to_float": dict(stype=T.FLOAT16, zp=True, cast_to=T.FLOAT),
    "tied_with_matmul": dict(extra_nodes=[H.make_node("MatMul", ["Xa", "Wd"], ["Y2"], name="lm")],
                             extra_outputs=[vi("Y2", None)]),
}


def hand_gather_models() -> dict[str, tuple[onnx.ModelProto, dict[str, np.ndarray]]]:
    """The matcher's DQ+Gather forms (``GATHERS``) as models, with the feeds that run them."""
    out = {}
    for name, kw in GATHERS.items():
        m = dq_gather(name, **kw)
        feeds = {"ids": np.array([0, 3, -1, 7, 0], np.int32 if kw.get("idx_type") == onnx.TensorProto.INT32 else np.int64)}
        if name == "tied_with_matmul":
            m.graph.input.append(vi("Xa", [2, 12]))
            feeds["Xa"] = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 12)
        out[name] = (m, feeds)
    return out


#: The synthetic decoder's quantized-embedding variants (``SynthConfig.tiny(embedding="quantized", **kw)``).
GATHER_VARIANTS = {
    "int4": {},
    "int4+zp": {"zero_points": True},
    "uint4": {"weight_type": "uint4"},
    "uint4+zp": {"weight_type": "uint4", "zero_points": True},
    "uint8": {"weight_type": "uint8"},  # GBQ's uint8 default zero point is 128: an explicit 0 is made
    "uint8+zp": {"weight_type": "uint8", "zero_points": True},
    "uint2": {"weight_type": "uint2"},  # the table travels as uint8 bits=2 over the same bytes
    "uint2+zp": {"weight_type": "uint2", "zero_points": True},
    "block128": {"block_size": 128},
    "external": {"storage": "external"},
}



def fp16_graphs() -> dict[str, tuple[onnx.ModelProto, dict[str, np.ndarray]]]:
    """Hand-built fp16 graphs around DQ(int4, fp16 scales)+MatMul/Gemm: what sits next to the fused
    node decides which Casts ORT removes and which fp16 CPU kernels it forces to fp32."""
    rng = np.random.default_rng(7)
    K = N = 64

    def q(name):
        codes = rng.integers(0, 256, size=(K * N // 2,), dtype=np.uint8)
        return [H.make_tensor(name, T.INT4, [K, N], codes.tobytes(), raw=True),
                nh.from_array((rng.random((K // 32, N)) * 0.02 + 0.005).astype(np.float16), name + "_s")]

    def dq(name):
        return H.make_node("DequantizeLinear", [name, name + "_s"], [name + "_d"], axis=0, block_size=32)

    def vi(n, shape):
        return H.make_tensor_value_info(n, T.FLOAT16, shape)

    ln = [nh.from_array(rng.random(K).astype(np.float16), "b0"),
          nh.from_array((rng.random(K) + 0.5).astype(np.float16), "g"),
          nh.from_array((rng.random(K) * 0.1).astype(np.float16), "beta")]
    x3 = rng.standard_normal((1, 3, K)).astype(np.float16)
    graphs = {
        # LayerNormalization has an fp16 CPU kernel, but sits between two unassigned nodes (Add and the
        # fused node): ORT's ForceSingleNodeCPUFloat16ToFloat32 runs it in fp32
        "layernorm_forced_to_fp32": ([H.make_node("Add", ["X", "b0"], ["x1"]),
                                      H.make_node("LayerNormalization", ["x1", "g", "beta"], ["x2"], axis=-1),
                                      dq("W1"), H.make_node("MatMul", ["x2", "W1_d"], ["y1"]),
                                      H.make_node("Add", ["y1", "x1"], ["Y"])], q("W1") + ln, [1, 3, K], x3),
        "transpose_forced_to_fp32": ([H.make_node("Add", ["X", "b0"], ["x1"]),
                                      H.make_node("Transpose", ["x1"], ["x2"], perm=[0, 1, 2]),
                                      dq("W1"), H.make_node("MatMul", ["x2", "W1_d"], ["y1"]),
                                      H.make_node("Transpose", ["y1"], ["y2"], perm=[0, 1, 2]),
                                      H.make_node("Add", ["y2", "x1"], ["Y"])], q("W1") + ln, [1, 3, K], x3),
        "softmax_between_two": ([dq("W1"), H.make_node("MatMul", ["X", "W1_d"], ["y1"]),
                                 H.make_node("Softmax", ["y1"], ["r"], axis=-1),
                                 dq("W2"), H.make_node("MatMul", ["r", "W2_d"], ["Y"])], q("W1") + q("W2"), [1, 3, K], x3),
        "chained_and_bias": ([dq("W1"), H.make_node("MatMul", ["X", "W1_d"], ["y1"]),
                              H.make_node("Add", ["y1", "b0"], ["y2"]),
                              dq("W2"), H.make_node("Gemm", ["y2", "W2_d", "b0"], ["Y"])],
                             q("W1") + q("W2") + ln[:1], [2, K], rng.standard_normal((2, K)).astype(np.float16)),
    }
    out = {}
    for name, (nodes, inits, shape, x) in graphs.items():
        g = H.make_graph(nodes, name, [vi("X", shape)], [vi("Y", shape[:-1] + [N])], inits)
        out[name] = (make_model(g), {"X": x})
    return out
