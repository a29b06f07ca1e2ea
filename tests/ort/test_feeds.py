"""Feeds ortmem makes for a decoder (ortmem.ort.feeds): its first step, run by real ORT sessions.

A decoder's cache inputs leave batch, past length and head size symbolic; the feeds must be those of
a real first step (empty cache, mask over past + new tokens, the lengths GroupQueryAttention reads),
with the head size from genai_config.json or from the model's own attention nodes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortmem.ort.feeds import HEAD_SIZE, KV_HEADS, attention_dims, decoder_dims, make_inputs
from tests.support.compare import assert_same_outputs
from tests.support.decoders import decoder_feeds, genai_decoder_folder, gqa_decoder
from tests.support.genai_folder import build_genai_folder
from tests.support.reference import CPU, run_plain


@pytest.mark.parametrize("lengths", ["mask", "inputs"])
def test_a_gqa_decoder_runs_on_its_first_step_as_a_caller_would_feed_it(tmp_path: Path, lengths: str) -> None:
    model = gqa_decoder(tmp_path / "model.onnx", hidden=192, heads=3, kv_heads=1, lengths=lengths)  # head size 64
    assert decoder_dims(model) == {KV_HEADS: 1, HEAD_SIZE: 64}
    session = ort.InferenceSession(str(model), providers=CPU)
    feeds = make_inputs(session, {"int_high": 1, "dims": decoder_dims(model)})
    assert feeds["past_key_values.0.key"].shape == (1, 1, 0, 64) and feeds["input_ids"].shape == (1, 8)
    if lengths == "mask":
        assert feeds["attention_mask"].shape == (1, 8) and (feeds["attention_mask"] == 1).all()
    else:
        assert feeds["seqlens_k"].tolist() == [7] and feeds["total_sequence_length"].tolist() == 8
    written = decoder_feeds(seq=8, hidden=192, heads=3, kv_heads=1, lengths=lengths)
    written["input_ids"] = feeds["input_ids"]  # the caller's own feeds but for the tokens: the same step
    assert_same_outputs(session.run(None, feeds), run_plain(model, written))


def test_a_later_step_counts_positions_and_lengths_from_the_past(tmp_path: Path) -> None:
    model = gqa_decoder(tmp_path / "model.onnx", lengths="inputs")
    session = ort.InferenceSession(str(model), providers=CPU)
    feeds = make_inputs(session, {"dims": {**decoder_dims(model), "past": 2, "seq": 3}})
    assert feeds["past_key_values.1.value"].shape == (1, 2, 2, 32)
    assert feeds["seqlens_k"].tolist() == [4] and feeds["total_sequence_length"].tolist() == 5
    present = session.run(None, feeds)[1]
    assert present.shape == (1, 2, 5, 32)


def test_the_genai_config_is_read_before_the_model(tmp_path: Path) -> None:
    """genai's test decoder (Concat caches, no attention node) in its folder: the sizes come from
    genai_config.json's decoder section where it gives them, hidden_size / num_attention_heads included,
    and from the model's own cache dims otherwise."""
    folder = build_genai_folder(tmp_path / "genai")
    assert attention_dims(folder / "model.onnx") == {KV_HEADS: 4, HEAD_SIZE: 16}  # its caches' fixed dims
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"].update({"num_attention_heads": 6, "hidden_size": 480, "num_key_value_heads": 2})
    config["model"]["decoder"].pop("head_size", None)
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert decoder_dims(folder / "model.onnx") == {HEAD_SIZE: 80, KV_HEADS: 2}
    config["model"]["decoder"]["head_size"] = 96
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert decoder_dims(folder / "model.onnx")[HEAD_SIZE] == 96


def test_a_model_without_attention_or_cache_needs_no_sizes(tmp_path: Path) -> None:
    from tests.support.builders import matmul_chain, save

    model = save(matmul_chain(np.random.default_rng(0), [16, 32, 8]), tmp_path / "chain.onnx")
    assert decoder_dims(model) == {}


def test_a_hand_made_genai_folder_agrees_with_its_model(tmp_path: Path) -> None:
    folder = genai_decoder_folder(tmp_path / "genai", hidden=192, heads=2, kv_heads=1)
    model = folder / "model.onnx"
    assert decoder_dims(model) == attention_dims(model) == {HEAD_SIZE: 96, KV_HEADS: 1}
