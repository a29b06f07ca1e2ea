"""Decoders as exporters make them, written by hand with onnx.helper (no torch, no genai builder):
GroupQueryAttention (com.microsoft) layers over a KV cache whose inputs have symbolic batch, sequence,
past length and head size (``kv_cache_dim``), fp32 MatMul weights ORT pre-packs, and a tied
embedding read as ``Gather(Transpose(lm_head))``. What a check that runs a decoder on feeds of its own
making must get right: past 0, the head size, the cache lengths the attention op reads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: The symbolic last dim of every ``past_key_values.*`` input, as some exporters name it.
HEAD_DIM_NAME = "kv_cache_dim"
#: Rotary tables' rows: the longest sequence (past + new) the decoder accepts.
MAX_POSITIONS = 64


def _weight(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _layer(i: int, x: str, *, hidden: int, heads: int, kv_heads: int, ffn: int, rng: np.random.Generator,
           inits: list, inputs: list, outputs: list) -> tuple[list, str]:
    """One pre-norm-free decoder layer: Q/K/V projections, GroupQueryAttention over the cache (present =
    past ++ new), an output projection and an fp32 MLP, each with a residual."""
    p, head = f"layers.{i}", hidden // heads
    for kv in ("key", "value"):
        inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT,
                                                    ["batch_size", kv_heads, "past_sequence_length", HEAD_DIM_NAME]))
        outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                     ["batch_size", kv_heads, "total_sequence_length", HEAD_DIM_NAME]))
    inits += [_weight(rng, f"{p}.q", (hidden, hidden), hidden ** -0.5),
              _weight(rng, f"{p}.k", (hidden, kv_heads * head), hidden ** -0.5),
              _weight(rng, f"{p}.v", (hidden, kv_heads * head), hidden ** -0.5),
              _weight(rng, f"{p}.o", (hidden, hidden), hidden ** -0.5),
              _weight(rng, f"{p}.up", (hidden, ffn), hidden ** -0.5),
              _weight(rng, f"{p}.down", (ffn, hidden), ffn ** -0.5)]
    nodes = [helper.make_node("MatMul", [x, f"{p}.{w}"], [f"{p}.{w}.out"]) for w in ("q", "k", "v")]
    nodes += [
        helper.make_node("GroupQueryAttention",
                         [f"{p}.q.out", f"{p}.k.out", f"{p}.v.out", f"past_key_values.{i}.key",
                          f"past_key_values.{i}.value", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
                         [f"{p}.attn", f"present.{i}.key", f"present.{i}.value"], domain="com.microsoft",
                         num_heads=heads, kv_num_heads=kv_heads, do_rotary=1),
        helper.make_node("MatMul", [f"{p}.attn", f"{p}.o"], [f"{p}.o.out"]),
        helper.make_node("Add", [x, f"{p}.o.out"], [f"{p}.x1"]),
        helper.make_node("MatMul", [f"{p}.x1", f"{p}.up"], [f"{p}.up.out"]),
        helper.make_node("Tanh", [f"{p}.up.out"], [f"{p}.act"]),
        helper.make_node("MatMul", [f"{p}.act", f"{p}.down"], [f"{p}.down.out"]),
        helper.make_node("Add", [f"{p}.x1", f"{p}.down.out"], [f"{p}.out"]),
    ]
    return nodes, f"{p}.out"


def gqa_decoder(path: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                ffn: int = 256, vocab: int = 97, lengths: str = "mask", failing: bool = False,
                seed: int = 0) -> Path:
    """Write a GroupQueryAttention decoder to ``path`` (every weight in ``<name>.data``).

    ``lengths="mask"``: the inputs are ``input_ids``, ``attention_mask`` (past + new) and the cache, and
    ``seqlens_k``/``total_sequence_length`` are computed from the mask, as onnxruntime-genai's builder
    does; ``lengths="inputs"``: they are graph inputs (int32 ``[batch]`` and a scalar) and there is no
    mask. ``failing``: token ids are shifted past the vocabulary before the embedding, so every run
    fails in Gather whatever the feeds (the model loads; only running it shows the fault)."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    inv = 1.0 / (10000 ** (np.arange(0, head, 2, dtype=np.float64) / head))
    angles = np.outer(np.arange(MAX_POSITIONS, dtype=np.float64), inv)
    inits = [_weight(rng, "lm_head", (hidden, vocab), hidden ** -0.5),
             numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache")]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])]
    ids = "input_ids"
    nodes = []
    if failing:
        inits.append(numpy_helper.from_array(np.array(1 << 20, np.int64), "id_shift"))
        nodes.append(helper.make_node("Add", ["input_ids", "id_shift"], ["shifted_ids"]))
        ids = "shifted_ids"
    nodes += [helper.make_node("Transpose", ["lm_head"], ["embed_tokens"], perm=[1, 0]),  # the tied embedding
              helper.make_node("Gather", ["embed_tokens", ids], ["x0"])]
    if lengths == "mask":
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                    ["batch_size", "total_sequence_length"]))
        inits += [numpy_helper.from_array(np.array([1], np.int64), "one_axis"),
                  numpy_helper.from_array(np.array(1, np.int64), "one"),
                  numpy_helper.from_array(np.array(1, np.int64), "dim1")]
        nodes += [helper.make_node("ReduceSum", ["attention_mask", "one_axis"], ["mask_sum"], keepdims=0),
                  helper.make_node("Sub", ["mask_sum", "one"], ["mask_last"]),
                  helper.make_node("Cast", ["mask_last"], ["seqlens_k"], to=TensorProto.INT32),
                  helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
                  helper.make_node("Gather", ["mask_shape", "dim1"], ["mask_len"], axis=0),
                  helper.make_node("Cast", ["mask_len"], ["total_sequence_length"], to=TensorProto.INT32)]
    elif lengths == "inputs":
        inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch_size"]),
                   helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    else:
        raise ValueError(f"lengths must be 'mask' or 'inputs', not {lengths!r}")
    x = "x0"
    for i in range(layers):
        more, x = _layer(i, x, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, rng=rng, inits=inits,
                         inputs=inputs, outputs=outputs)
        nodes += more
    nodes.append(helper.make_node("MatMul", [x, "lm_head"], ["logits"]))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{path.name}.data", size_threshold=1024)
    return path


def genai_decoder_folder(folder: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                         vocab: int = 97, **kw) -> Path:
    """An onnxruntime-genai-shaped folder, made by hand: ``genai_config.json`` as the builder writes its
    decoder section (head size, head counts, hidden size, input names) over :func:`gqa_decoder`'s
    ``model.onnx``. Nothing of onnxruntime-genai is needed to write or prepare it."""
    folder = Path(folder)
    gqa_decoder(folder / "model.onnx", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab, **kw)
    config = {"model": {
        "type": "llama", "vocab_size": vocab, "context_length": MAX_POSITIONS, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0,
        "decoder": {"filename": "model.onnx", "head_size": hidden // heads, "hidden_size": hidden,
                    "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers,
                    "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                    "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                               "past_key_names": "past_key_values.%d.key",
                               "past_value_names": "past_key_values.%d.value"},
                    "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                "present_value_names": "present.%d.value"}}},
        "search": {"max_length": MAX_POSITIONS, "do_sample": False}}
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4))
    return folder


def decoder_feeds(*, batch: int = 1, seq: int = 3, past: int = 0, layers: int = 2, hidden: int = 128, heads: int = 4,
                  kv_heads: int = 2, vocab: int = 97, lengths: str = "mask", seed: int = 5) -> dict[str, np.ndarray]:
    """Feeds a caller of :func:`gqa_decoder` would give (written out here, not by ortmem's feed maker)."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    feeds: dict[str, np.ndarray] = {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64)}
    if lengths == "mask":
        feeds["attention_mask"] = np.ones((batch, past + seq), np.int64)
    else:
        feeds["seqlens_k"] = np.full((batch,), past + seq - 1, np.int32)
        feeds["total_sequence_length"] = np.array(past + seq, np.int32)
    for i in range(layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, kv_heads, past, head)).astype(np.float32)
    return feeds
