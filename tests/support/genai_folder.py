"""An onnxruntime-genai "llama"-type folder over a hand-written decoder with genai's input and output names
(no torch for genai's own builder; genai generates from token ids without a tokenizer): the genai tests
and the benchmarks' genai strategies run it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortmem.session import genai

MAX_LENGTH = 16  # genai_config's search.max_length: prompt and generated tokens together

def _weight(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale), name)


def _layer(i: int, x: str, hidden: int, ffn: int, heads: int, rng: np.random.Generator,
           inits: list, inputs: list, outputs: list) -> tuple[list, str]:
    """One decoder layer: K/V projections appended to the KV cache (present = past ++ new), a
    context vector from the whole cache, an fp32 MLP. Not attention, but every generated token depends
    on every MatMul weight and on the cache genai keeps, which is what the comparison needs."""
    p, head = f"l{i}", hidden // heads
    nodes = []
    for kv in ("key", "value"):
        inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT,
                                                    ["batch", heads, "past", head]))
        outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                     ["batch", heads, "total", head]))
        inits.append(_weight(rng, f"{p}.w{kv[0]}", (hidden, hidden), hidden ** -0.5))
        nodes += [helper.make_node("MatMul", [x, f"{p}.w{kv[0]}"], [f"{p}.{kv}.flat"]),
                  helper.make_node("Reshape", [f"{p}.{kv}.flat", "kv_shape"], [f"{p}.{kv}.4d"]),
                  helper.make_node("Transpose", [f"{p}.{kv}.4d"], [f"{p}.{kv}.new"], perm=[0, 2, 1, 3]),
                  helper.make_node("Concat", [f"past_key_values.{i}.{kv}", f"{p}.{kv}.new"],
                                   [f"present.{i}.{kv}"], axis=2)]
    inits += [_weight(rng, f"{p}.w1", (hidden, ffn), hidden ** -0.5), _weight(rng, f"{p}.w2", (ffn, hidden), ffn ** -0.5)]
    nodes += [helper.make_node("Mul", [f"present.{i}.key", f"present.{i}.value"], [f"{p}.kv"]),
              helper.make_node("ReduceMean", [f"{p}.kv", "seq_axis"], [f"{p}.ctx4"], keepdims=1),
              helper.make_node("Transpose", [f"{p}.ctx4"], [f"{p}.ctxt"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", [f"{p}.ctxt", "ctx_shape"], [f"{p}.ctx"]),
              helper.make_node("Add", [x, f"{p}.ctx"], [f"{p}.x1"]),
              helper.make_node("MatMul", [f"{p}.x1", f"{p}.w1"], [f"{p}.h"]),
              helper.make_node("Tanh", [f"{p}.h"], [f"{p}.a"]),
              helper.make_node("MatMul", [f"{p}.a", f"{p}.w2"], [f"{p}.m"]),
              helper.make_node("Add", [f"{p}.x1", f"{p}.m"], [f"{p}.x2"]),
              helper.make_node("Tanh", [f"{p}.x2"], [f"{p}.out"])]
    return nodes, f"{p}.out"


def build_genai_folder(folder: Path, *, layers: int = 2, hidden: int = 64, ffn: int = 128, heads: int = 4,
                       vocab: int = 97, context: int = 64, seed: int = 0) -> Path:
    """A genai "llama"-type folder: ``model.onnx`` + ``model.onnx.data`` (every weight external, as
    genai's builder writes them) and ``genai_config.json`` with genai's default input/output names."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    inits = [_weight(rng, "embed", (vocab, hidden), 1.0), _weight(rng, "pos_embed", (context, hidden), 0.1),
             numpy_helper.from_array(np.array([0, 0, heads, head], np.int64), "kv_shape"),
             numpy_helper.from_array(np.array([0, 1, hidden], np.int64), "ctx_shape"),
             numpy_helper.from_array(np.array([2], np.int64), "seq_axis")]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["tok"]),
             helper.make_node("Gather", ["pos_embed", "position_ids"], ["pos"]),
             helper.make_node("Add", ["tok", "pos"], ["x0"])]
    x = "x0"
    for i in range(layers):
        more, x = _layer(i, x, hidden, ffn, heads, rng, inits, inputs, outputs)
        nodes += more
    inits.append(_weight(rng, "lm_head", (hidden, vocab), hidden ** -0.5))
    nodes.append(helper.make_node("MatMul", [x, "lm_head"], ["logits"]))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    config = {"model": {
        "type": "llama", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "vocab_size": vocab,
        "context_length": context,
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "filename": "model.onnx", "num_attention_heads": heads, "num_key_value_heads": heads,
            "head_size": head, "hidden_size": hidden, "num_hidden_layers": layers,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                       "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
            "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                        "present_value_names": "present.%d.value"}}},
        "search": {"max_length": MAX_LENGTH, "do_sample": False, "past_present_share_buffer": False}}
    (folder / genai.GENAI_CONFIG).write_text(json.dumps(config, indent=2))
    return folder
