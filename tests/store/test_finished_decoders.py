"""``ortmem prepare`` on decoders as exporters make them (ortmem.store.finished's check, ortmem.cli.prepare).

The check that decides whether a prepared model is used runs the decoder on its first step: an empty
KV cache whose symbolic head size (``kv_cache_dim``) comes from genai_config.json or the model's
GroupQueryAttention, the lengths the attention op reads consistent with the mask. A check that
cannot run records nothing and says why once; a model ORT keeps nothing of is a plain statement.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.onnxfile import scan
from ortmem.cli import main as cli_main
from ortmem.ort.release import capabilities
from ortmem.session import genai
from ortmem.store import finisher
from ortmem.store.cache import Cache
from ortmem.store.finished import FinishCheckError
from ortmem.store.finished_entries import is_marker
from tests.support.builders import elementwise
from tests.support.compare import assert_same_outputs
from tests.support.decoders import decoder_feeds, genai_decoder_folder, gqa_decoder
from tests.support.reference import CPU, run_plain

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")

#: What ORT says when the failing decoder runs (its Gather's index is past the vocabulary).
GATHER_FAULT = "indices element out of data bounds"


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model gets a prepared entry, whatever its size (the decoders here are small)."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")


def _entries(cache: Path) -> list:
    return list(Cache(cache).entries()) if cache.is_dir() else []


def _prepare(target: Path, cache: Path, capfd: pytest.CaptureFixture) -> tuple[int, list[str]]:
    """``ortmem prepare`` and its stderr lines, ORT's own log included (it writes to the process's fd 2)."""
    capfd.readouterr()
    rc = cli_main(["prepare", str(target), "--cache", str(cache)])
    return rc, capfd.readouterr().err.splitlines()


@pytest.mark.parametrize("lengths", ["mask", "inputs"])
def test_a_gqa_decoder_is_prepared_and_its_warm_start_equals_plain_ort(tmp_path, any_size, capfd, lengths):
    model = gqa_decoder(tmp_path / "model" / "model.onnx", lengths=lengths)
    cache = tmp_path / "cache"
    rc, err = _prepare(model, cache, capfd)
    assert rc == 0, err
    assert "finished entry" in err[-1] and "pre-packed initializers" in err[-1], err
    (entry,) = _entries(cache)
    assert not is_marker(entry)
    warm = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert warm.ortmem_action == "finished"
    for past in (0, 3):  # the first step, and a later one with a cache
        feeds = decoder_feeds(past=past, lengths=lengths)
        assert_same_outputs(warm.run(None, feeds), run_plain(model, feeds), f"past {past}")


def test_a_genai_shaped_folder_is_prepared_with_its_config_head_size(tmp_path, capfd):
    folder = genai_decoder_folder(tmp_path / "genai", hidden=192, heads=2, kv_heads=1)  # head size 96
    rc, err = _prepare(folder, tmp_path / "cache", capfd)
    assert rc == 0, err
    assert "model.onnx:" in "\n".join(err) and "pre-packed weights" in "\n".join(err) and "prepared" in err[-1], err
    (chosen, name), = genai.choose_files(folder)[0]
    assert name == "model.ortmem-prepared.onnx" and genai.choose_files(folder)[1] == []
    feeds = decoder_feeds(past=2, hidden=192, heads=2, kv_heads=1)
    off = ort.SessionOptions()
    off.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert_same_outputs(run_plain(folder / name, feeds, off), run_plain(folder / "model.onnx", feeds))
    # genai gets the finished file with its own options and optimizations off (genai reads the level there)
    assert genai.rewrite_config(folder) == ["model.onnx"]
    decoder = json.loads((folder / genai.GENAI_CONFIG).read_text())["model"]["decoder"]
    assert decoder["filename"] == name
    assert decoder["session_options"] == {"log_id": "onnxruntime-genai", "provider_options": [],
                                          "graph_optimization_level": "ORT_DISABLE_ALL"}
    (folder / "model.onnx.data").touch()  # the source's identity moved: the finished file no longer passes
    assert genai.rewrite_config(folder) == []
    decoder = json.loads((folder / genai.GENAI_CONFIG).read_text())["model"]["decoder"]
    assert decoder["filename"] == "model.onnx"
    assert decoder["session_options"] == {"log_id": "onnxruntime-genai", "provider_options": []}


def test_a_decoder_whose_check_cannot_run_fails_once_and_records_nothing(tmp_path, any_size, capfd):
    model = gqa_decoder(tmp_path / "model" / "model.onnx", failing=True)
    cache = tmp_path / "cache"
    for _ in range(2):  # nothing recorded: the second run tries again, and fails the same way
        rc, err = _prepare(model, cache, capfd)
        assert rc == 1
        assert sum(GATHER_FAULT in line for line in err) == 1, err  # said once: not also by ORT's log
        assert GATHER_FAULT in err[-1] and "not prepared" in err[-1]
        assert _entries(cache) == []
    start = ortmem.InferenceSession(model, providers=CPU, cache=cache)  # a start may try again too
    assert start.ortmem_action == "as-is"
    with pytest.raises(Exception, match=GATHER_FAULT):
        start.run(None, decoder_feeds())
    job = start.ortmem_handoff.later
    assert job is not None and job.kind == "finished"
    with pytest.raises(FinishCheckError, match=GATHER_FAULT):  # the background finisher's work, here
        finisher.run(job)
    assert _entries(cache) == []


def test_a_genai_folder_whose_check_cannot_run_fails_and_writes_nothing(tmp_path, capfd):
    folder = genai_decoder_folder(tmp_path / "genai", failing=True)
    rc, err = _prepare(folder, tmp_path / "cache", capfd)
    assert rc == 1 and sum(GATHER_FAULT in line for line in err) == 1, err
    assert "not prepared" in err[-1] or "not prepared" in err[-2], err
    assert sorted(p.name for p in folder.iterdir()) == ["genai_config.json", "model.onnx", "model.onnx.data"]
    assert genai.choose_files(folder)[1] == [f"model.onnx is not prepared (run `ortmem prepare {folder}`)"]


def test_a_model_ort_keeps_nothing_of_is_a_plain_statement(tmp_path, any_size, capfd):
    model = elementwise(tmp_path / "scale.onnx")
    rc, err = _prepare(model, tmp_path / "cache", capfd)
    assert rc == 0, err
    assert "nothing to prepare (onnxruntime makes no weight of it and packs none" in err[-1], err
    (entry,) = _entries(tmp_path / "cache")
    assert is_marker(entry)  # a decision the check could make: later starts need not ask again


def test_an_older_genai_manifest_without_files_is_not_taken_for_a_decision(tmp_path):
    """A manifest-only prepared file of an earlier format recorded "packs nothing" where its check had
    failed: it no longer stands for a decision, and the folder's source is named as not prepared."""
    folder = genai_decoder_folder(tmp_path / "genai")
    (folder / "model.ortmem-prepared.json").write_text(json.dumps({"format": 2, "report": {"useful": False}}))
    (folder / "model.ortmem-prepared.json").chmod(0o600)
    (_, name), = genai.choose_files(folder)[0]
    reasons = genai.choose_files(folder)[1]
    assert name == "model.onnx" and len(reasons) == 1 and "not prepared for this ortmem" in reasons[0]
    assert "another format" in reasons[0]


def test_the_check_sessions_leave_ort_s_log_quiet_and_name_the_feeds(tmp_path):
    """The error of a check that cannot run names the model, ORT's reason and the feeds it was given
    (the cache's head size and past length, read from the model itself)."""
    from ortmem.ort.settings import OrtSettings
    from ortmem.store.finished import worth_mapping

    model = gqa_decoder(tmp_path / "model.onnx", failing=True)
    with pytest.raises(FinishCheckError) as caught:
        worth_mapping(model, model, OrtSettings())
    text = str(caught.value)
    assert GATHER_FAULT in text and str(model) in text and "past_key_values.0.key [1, 2, 0, 32]" in text
    assert ort.__version__  # the installed ORT is the one asked


def _strided_conv_net(path: Path) -> Path:
    """A detector-shaped stem: three unpadded stride-2 convolutions on an image of symbolic sides. Sides
    of 8 shrink to 3, then 1, and the third kernel no longer fits (ORT refuses the run); 32 fits."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, prev, channels = [], [], "x", 3
    for i in range(3):
        w = numpy_helper.from_array(rng.standard_normal((4, channels, 3, 3)).astype(np.float32), f"w{i}")
        inits.append(w)
        nodes.append(helper.make_node("Conv", [prev, w.name], [f"c{i}"], strides=[2, 2]))
        prev, channels = f"c{i}", 4
    graph = helper.make_graph(nodes, "strided", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_the_check_tries_larger_sides_when_the_source_refuses_its_feeds(tmp_path, monkeypatch):
    """A network whose image sides must divide by its stride is still checked: unnamed axes are tried at
    32 and 64 after the default, and the check's verdict comes from real runs; with no larger sides
    tried, the same model is no verdict (FinishCheckError)."""
    from ortmem.ort.settings import OrtSettings
    from ortmem.store import finished

    model = _strided_conv_net(tmp_path / "model.onnx")
    (tmp_path / "finished").mkdir()
    report = finished.finish_model(model, tmp_path / "finished", settings=OrtSettings())
    assert report.useful or report.refusal  # a verdict from both sessions' runs, not "could not run"
    if report.useful:
        feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)}
        assert_same_outputs(ortmem.InferenceSession(str(model), providers=CPU).run(None, feeds), run_plain(model, feeds))
    monkeypatch.setattr(finished, "UNKNOWN_DIM_RETRIES", ())
    with pytest.raises(FinishCheckError, match=r"x \[1, 3, 8, 8\]"):
        finished.worth_mapping(model, model, OrtSettings())
