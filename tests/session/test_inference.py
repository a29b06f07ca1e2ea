"""ortmem.InferenceSession against onnxruntime.InferenceSession on the same files."""
from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.base.options import get_config
from ortmem.onnxfile.scan import FOLDER_KEY
from tests.support import builders as mb
from tests.support.compare import assert_same_outputs
from tests.support.threads import run_in_threads


def _feeds_chain(rng, width):
    return {"x": rng.standard_normal((3, width), dtype=np.float32)}


CASES = {
    "chain": (lambda rng: mb.matmul_chain(rng, [64, 256, 256, 32]), lambda rng: _feeds_chain(rng, 64)),
    "embedding": (
        lambda rng: mb.embedding_model(rng, 2048, 64, 16),
        lambda rng: {"ids": rng.integers(0, 2048, size=(2, 5), dtype=np.int64)},
    ),
    "many_small": (lambda rng: mb.many_small(rng, 200), lambda rng: {"x": rng.standard_normal((1, 16), dtype=np.float32)}),
    "int4": (lambda rng: mb.int4_model(rng), lambda rng: {"x": rng.standard_normal((1, 256), dtype=np.float32)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("external", [False, True])
def test_outputs_bit_identical_for_every_input_form(tmp_path, rng, case, external):
    build, feeds_of = CASES[case]
    m = build(rng)
    path = mb.save(m, tmp_path / "m.onnx", external=external)
    feeds = feeds_of(rng)
    expected = ort.InferenceSession(str(path)).run(None, feeds)
    for model_input in (str(path), path, ortmem.load(path), m, m.SerializeToString()):
        sess = ortmem.InferenceSession(model_input)
        assert_same_outputs(sess.run(None, feeds), expected)


@pytest.mark.parametrize("branch", [True, False])
def test_subgraph_model(tmp_path, rng, branch):
    m = mb.subgraph_model(rng)
    path = mb.save(m, tmp_path / "s.onnx")
    feeds = {"x": rng.standard_normal((1, 128), dtype=np.float32), "c": np.array(branch), "trip": np.array(3, dtype=np.int64)}
    expected = ort.InferenceSession(str(path)).run(None, feeds)
    assert_same_outputs(ortmem.InferenceSession(path).run(None, feeds), expected)


def test_full_session_surface(tmp_path, rng):
    m = mb.matmul_chain(rng, [32, 64, 8])
    path = mb.save(m, tmp_path / "m.onnx")
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = ortmem.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(str(path))
    assert isinstance(sess, ort.InferenceSession)
    assert [i.name for i in sess.get_inputs()] == [i.name for i in ref.get_inputs()]
    assert [o.shape for o in sess.get_outputs()] == [o.shape for o in ref.get_outputs()]
    assert sess.get_providers() == ["CPUExecutionProvider"]
    assert sess.get_session_options().enable_profiling
    x = rng.standard_normal((2, 32), dtype=np.float32)
    (y,) = sess.run(None, {"x": x})
    ov = sess.run_with_ort_values(None, {"x": ort.OrtValue.ortvalue_from_numpy(x)})
    assert np.array_equal(ov[0].numpy(), y)
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output(sess.get_outputs()[0].name)
    sess.run_with_iobinding(binding)
    assert np.array_equal(binding.copy_outputs_to_cpu()[0], y)
    prof = sess.end_profiling()
    assert prof and (tmp_path / prof).exists() or __import__("os").path.exists(prof)
    assert sess.get_modelmeta() is not None


def test_user_options_honoured_and_not_mutated(tmp_path, rng):
    m = mb.matmul_chain(rng, [32, 64, 8])
    path = mb.save(m, tmp_path / "m.onnx")  # embedded: needs the folder key during creation
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ortmem.InferenceSession(path, so)
    assert sess.get_session_options().intra_op_num_threads == 1
    assert sess.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert sess.get_session_options().get_session_config_entry("session.disable_prepacking") == "1"
    # the user's object: what it had is still there; ortmem's folder key is not
    assert so.get_session_config_entry("session.disable_prepacking") == "1"
    assert so.intra_op_num_threads == 1
    assert get_config(so, FOLDER_KEY) is None  # ortmem never set it: the skeleton loads by path beside hard links
    # a user value for the same key is put back exactly
    so.add_session_config_entry(FOLDER_KEY, "/user/value")
    ortmem.InferenceSession(path, so)
    assert so.get_session_config_entry(FOLDER_KEY) == "/user/value"


def test_options_shared_across_threads(tmp_path, rng):
    m = mb.matmul_chain(rng, [32, 64, 8])
    path = mb.save(m, tmp_path / "m.onnx")
    so = ort.SessionOptions()
    x = rng.standard_normal((1, 32), dtype=np.float32)
    expected = ort.InferenceSession(str(path)).run(None, {"x": x})[0]

    def worker():
        for _ in range(5):
            assert np.array_equal(ortmem.InferenceSession(path, so).run(None, {"x": x})[0], expected)

    run_in_threads(worker)


def test_handed_weights_are_released_and_temp_files_removed(tmp_path, rng, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    m = mb.matmul_chain(rng, [64, 64])
    model = ortmem.load(mb.save(m, tmp_path / "m.onnx"))
    ortmem.InferenceSession(model)
    assert all(w.state is ortmem.WeightState.RELEASED for w in model.weights)
    ortmem.InferenceSession(m)  # spilled to a private temp folder
    assert list((tmp_path / "tmp").iterdir()) == []


def test_bad_input_never_reaches_ort(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x0a\xff\xff\xff\x0f")
    with pytest.raises(ortmem.OrtmemError, match="bad.onnx"):
        ortmem.InferenceSession(bad)
    with pytest.raises(TypeError):
        ortmem.InferenceSession(12345)


@pytest.mark.parametrize("cache", [False, True])
def test_a_start_decided_from_the_bytes_hands_over_what_prepare_decides(tmp_path, rng, monkeypatch, cache):
    """A small model file with nothing to convert is decided from its bytes before the request or the
    store is asked (:func:`ortmem.session.decide.bytes_start`): the session's handoff is the one
    :func:`ortmem.session.decide.prepare` makes of the same file, and ORT's outputs are plain ORT's."""
    import os

    from ortmem.session.decide import prepare
    from ortmem.session.request import Request

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "cache"))
    path = mb.save(mb.matmul_chain(rng, [64, 128, 16]), tmp_path / "m.onnx")
    feeds = _feeds_chain(rng, 64)
    ortmem.InferenceSession(path, cache=cache)  # the first start with a cache creates its folder
    s = ortmem.InferenceSession(path, cache=cache)
    assert s.ortmem_action == "mapped" and s.ortmem_reason == "" and s.ortmem_report is None and not s.ortmem_cache_hit
    expected = prepare(path, Request.for_session(None, None, cache=cache))
    handoff = s.ortmem_handoff
    assert (handoff.action, handoff.fallback, handoff.config, handoff.later) == (expected.action, expected.fallback,
                                                                                expected.config, expected.later)
    assert os.path.basename(handoff.model) == os.path.basename(expected.model)  # a skeleton beside a hard link
    expected.after_create()
    np.testing.assert_array_equal(s.run(None, feeds)[0], ort.InferenceSession(str(path)).run(None, feeds)[0])
