"""The handoff on its own: a frozen request in, a read-only handoff out, for each kind of start.

What ``ortmem.InferenceSession`` does with a handoff is tested in ``tests/session/test_inference.py``; here the
handoff is asked directly (:func:`ortmem.session.decide.prepare`), and what it hands over is given to a
*plain* ``onnxruntime.InferenceSession``, whose outputs must equal ORT's own run of the original model.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortmem.session.handoff import Handoff
from ortmem.session.decide import prepare
from ortmem.session.request import AS_GIVEN, Request
from ortmem.onnxfile.loader import load
from ortmem.store import finisher
from ortmem.store.handoff_records import FOLDER
from ortmem.store.start import Decision
from ortmem.ort.release import capabilities
from tests.support.builders import tiny_decoder
from tests.support.compare import assert_same_outputs
from tests.support.reference import CPU, run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


def _run(handoff: Handoff) -> list[np.ndarray]:
    """What ORT answers for what the handoff gives it, with the config entries it asks for."""
    with handoff.creation_options(None) as options:
        sess = ort.InferenceSession(handoff.model, options, providers=CPU)
    handoff.after_create()
    return sess.run(None, FEEDS)


@pytest.fixture
def qdq(tmp_path):
    return tiny_decoder(tmp_path / "src", storage="external")


def _request(tmp_path, **kw) -> Request:
    return Request.for_session(None, CPU, cache=tmp_path / "cache", **kw)


def test_a_request_is_frozen_and_decided_once(tmp_path):
    request = _request(tmp_path)
    with pytest.raises(AttributeError):
        request.converting = False  # type: ignore[misc]
    assert request.converting  # the CPU EP is one ORT fuses DQ+MatMul for
    # pre-packed weights only where this ORT saves them (the release probe's answer, asked here once)
    assert request.prepacked == (request.settings.prepacking and capabilities().prepacked_save)
    assert not Request.for_session(None, CPU, cache=False).cache
    assert not Request.for_session(None, CPU, cache=tmp_path / "c", convert=False).converting


def test_cold_then_warm_start_hand_over_the_store_entry_with_ort_outputs(tmp_path, qdq):
    expected = run_plain(qdq, FEEDS)
    request = _request(tmp_path)

    cold = prepare(str(qdq), request)
    assert cold.action == Decision.CONVERTED and not cold.cache_hit and cold.report is not None
    assert str(tmp_path / "cache") in cold.model  # ORT loads the new entry by path
    with pytest.raises(AttributeError):
        cold.action = "as-is"  # type: ignore[misc]
    assert_same_outputs(_run(cold), expected)

    warm = prepare(str(qdq), request)  # the same frozen request serves again (not finished yet: the entry)
    assert warm.cache_hit and warm.report is None and warm.action == Decision.CACHE_HIT
    assert warm.start is not None and str(warm.start.path) == warm.model
    assert_same_outputs(_run(warm), expected)


def test_a_refused_entry_is_a_step_that_returns_a_new_handoff(tmp_path, qdq):
    request = _request(tmp_path)
    if not request.prepacked:
        pytest.skip(f"onnxruntime {ort.__version__} saves no finished model: no fallback to take")
    cold = prepare(str(qdq), request)
    cold.after_create()
    assert cold.start is not None and cold.start.entry is not None
    finisher.run(finisher.FinishLater(str(request.cache.root), cold.start.entry.key))  # what a first run leaves
    warm = prepare(str(qdq), request)
    assert warm.action == Decision.FINISHED and warm.cache_hit and warm.fallback is not None
    refused = warm.refused()
    assert refused is not warm and warm.action == Decision.FINISHED  # the handoff itself is never edited
    assert refused.model == warm.fallback and refused.fallback is None and refused.action == Decision.CACHE_HIT
    assert_same_outputs(_run(refused), run_plain(qdq, FEEDS))
    again = prepare(str(qdq), request)  # what ORT refused was discarded: the next start loads the entry
    assert again.action == Decision.CACHE_HIT and again.model == refused.model


def test_a_model_as_given_is_handed_over_without_converting(tmp_path, qdq):
    handoff = prepare(load(qdq), AS_GIVEN)
    assert handoff.report is None and not handoff.cache_hit and handoff.action in (Decision.AS_IS, Decision.MAPPED)
    assert_same_outputs(_run(handoff), run_plain(qdq, FEEDS))
    handoff.cleanup()


@pytest.mark.usefixtures("no_temp_folder")
def test_without_a_cache_the_conversion_is_borrowed_from_memory(tmp_path, qdq):
    handoff = prepare(str(qdq), Request.for_session(None, CPU, cache=False))
    assert handoff.action == Decision.IN_MEMORY and handoff.memory is not None and handoff.report is not None
    assert_same_outputs(_run(handoff), run_plain(qdq, FEEDS))


def _embedded_mlp(path, *, op: str = "MatMul"):
    """A small fp32 model with its weights inside the .onnx (above the inline limit: handed over as a
    skeleton beside a hard link); ``op`` another op type makes a model ORT refuses."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node(op, ["x", "w"], ["y"])], "mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_a_small_model_with_nothing_to_convert_is_handed_over_from_its_bytes(tmp_path):
    """No store lookup, no loader: ``mapped`` (a skeleton beside a hard link, kept as the file's
    handoff record, the only thing written into the store's folder), with the file itself as the
    fallback; ORT's outputs on it equal ORT's own run of the file."""
    import onnxruntime as ort_module

    path = _embedded_mlp(tmp_path / "mlp.onnx")
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))  # as an installed model: a file written just now gets no record
    handoff = prepare(path, _request(tmp_path))
    assert handoff.action == Decision.MAPPED and handoff.source is None and handoff.fallback == str(path)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [FOLDER]  # no entry: the store was not asked
    assert Path(handoff.model).parent.parent == tmp_path / "cache" / FOLDER
    feeds = {"x": np.ones((2, 64), np.float32)}
    with handoff.creation_options(None) as options:
        sess = ort_module.InferenceSession(handoff.model, options, providers=CPU)
    handoff.after_create()
    assert_same_outputs(sess.run(None, feeds), run_plain(path, feeds))


def test_a_skeleton_ort_refuses_falls_back_to_the_file_with_one_warning(tmp_path, caplog):
    """A model ORT refuses (an unknown op) fails as it fails in plain ORT, naming the user's file, after
    one warning: ortmem never makes a model valid or invalid, and never leaves its skeleton's path as
    the last word."""
    import logging

    import ortmem

    path = _embedded_mlp(tmp_path / "bad.onnx", op="NoSuchOperator")
    with pytest.raises(Exception) as ortmem_error:
        with caplog.at_level(logging.WARNING, logger="ortmem"):
            ortmem.InferenceSession(path, providers=CPU, cache=tmp_path / "cache")
    with pytest.raises(Exception) as ort_error:
        ort.InferenceSession(str(path), providers=CPU)
    assert type(ortmem_error.value) is type(ort_error.value) and str(path) in str(ortmem_error.value)
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


@pytest.mark.parametrize("content", [b"", b"\x0a\x05hello"], ids=["empty", "no-graph"])
def test_a_small_file_without_a_graph_is_named_by_the_loader_not_handed_over(tmp_path, content):
    """The byte-level route hands over only files with a graph: an empty file or a ModelProto without
    one goes the loader's way and fails with its CorruptModelError naming the file, as before."""
    import ortmem
    from ortmem.errors import CorruptModelError

    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(CorruptModelError) as err:
        ortmem.InferenceSession(path, providers=CPU, cache=tmp_path / "cache")
    assert str(path) in str(err.value)
