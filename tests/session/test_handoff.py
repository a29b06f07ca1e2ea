"""The handoff's own steps on real models and real ORT sessions: the options it creates ORT's session with
(scoped to the call: the caller's object reads back unchanged), :meth:`Handoff.refused`,
:meth:`Handoff.after_create` and :meth:`Handoff.with_recorded_settings`. Every session's outputs are
compared with plain ORT's on the original model (:func:`tests.support.reference.run_plain`)."""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.base.options import get_config
from ortmem.onnxfile.loader import load
from ortmem.onnxfile.scan import FOLDER_KEY, RECOMPUTE_METADATA
from ortmem.ort.recorded_settings import DISABLE_OPTIMIZERS_KEY
from ortmem.ort.release import capabilities
from ortmem.session.decide import prepare
from ortmem.session.handoff import Handoff
from ortmem.session.request import AS_GIVEN, Request
from ortmem.store import finisher
from ortmem.store.start import Decision
from tests.support.builders import matmul_chain, save, tiny_decoder
from tests.support.compare import assert_same_outputs
from tests.support.reference import CPU, run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
CHAIN_FEEDS = {"x": np.random.default_rng(7).standard_normal((3, 64), dtype=np.float32)}
CSE = "CommonSubexpressionElimination"
#: What the recompute-written models below record, as the session replays it.
RECORDED = {"execution_order": "PRIORITY_BASED", "session_config": {DISABLE_OPTIMIZERS_KEY: CSE}}
needs_saving = pytest.mark.skipif(not capabilities().prepacked_save,
                                  reason=f"onnxruntime {ort.__version__} saves no finished model")


def _records_recompute(path: Path) -> Path:
    """Add the metadata ``ortmem recompute`` writes (PRIORITY_BASED order, CSE skipped) to ``path``."""
    m = onnx.load(str(path), load_external_data=False)
    for key, value in (("execution_order", "PRIORITY_BASED"), ("disabled_optimizers", CSE)):
        prop = m.metadata_props.add()
        prop.key, prop.value = RECOMPUTE_METADATA + key, value
    onnx.save(m, str(path))
    return path


def _create(handoff: Handoff, options=None) -> ort.InferenceSession:
    """ORT's session on what the handoff gives, with the options it yields."""
    with handoff.creation_options(options) as used:
        return ort.InferenceSession(handoff.model, used, providers=CPU)


def _chain(path: Path, *, external: bool = False) -> Path:
    return save(matmul_chain(np.random.default_rng(3), [64, 256, 256, 32]), path, external=external)


@pytest.fixture
def qdq(tmp_path) -> Path:
    """The tiny QDQ decoder, recording the settings of a recompute rewrite."""
    return _records_recompute(tiny_decoder(tmp_path / "src", storage="external"))


def _finished(qdq: Path, cache: Path) -> tuple[Request, Handoff]:
    """A warm start's handoff of ORT's finished model (a first run's finishing done here)."""
    request = Request.for_session(None, CPU, cache=cache)
    cold = prepare(str(qdq), request)
    cold.after_create()
    finisher.run(finisher.FinishLater(str(request.cache.root), cold.start.entry.key))
    warm = prepare(str(qdq), request)
    assert warm.action == Decision.FINISHED and warm.fallback is not None
    return request, warm


@needs_saving
def test_a_finished_models_creation_scopes_its_settings_to_the_call(tmp_path, qdq):
    """ORT's session gets optimizations off, the recorded order and the union of disabled optimizers;
    the caller's options read back as they were set, entries, level and order alike."""
    _, warm = _finished(qdq, tmp_path / "cache")
    handoff = warm.with_recorded_settings()
    assert dict(handoff.recompute) == RECORDED
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.add_session_config_entry(DISABLE_OPTIMIZERS_KEY, "ConstantFolding")
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with handoff.creation_options(so) as used:
        assert used is so and used.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(handoff.model, used, providers=CPU)
    got = sess.get_session_options()  # what ORT's session was created with
    assert got.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert got.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert got.get_session_config_entry(DISABLE_OPTIMIZERS_KEY) == f"ConstantFolding;{CSE}"
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert so.execution_order == ort.ExecutionOrder.DEFAULT
    assert so.get_session_config_entry(DISABLE_OPTIMIZERS_KEY) == "ConstantFolding"
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    handoff.after_create()
    assert_same_outputs(sess.run(None, FEEDS), run_plain(qdq, FEEDS))

    # no options given: ortmem's own carry the same, and ORT's session is created the same way
    with handoff.creation_options(None) as own:
        assert isinstance(own, ort.SessionOptions) and own is not so
        assert own.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        assert own.execution_order == ort.ExecutionOrder.PRIORITY_BASED
        assert own.get_session_config_entry(DISABLE_OPTIMIZERS_KEY) == CSE
        sess = ort.InferenceSession(handoff.model, own, providers=CPU)
    assert sess.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert_same_outputs(sess.run(None, FEEDS), run_plain(qdq, FEEDS))


@pytest.mark.parametrize("callers_folder", [None, "elsewhere"], ids=["absent", "set"])
def test_config_entries_reach_ort_for_the_call_only(tmp_path, callers_folder):
    """Skeleton bytes load only with the handoff's folder entry (ORT finds the data beside nothing
    else); the caller's value for that key comes back exactly, an absent one reads back empty."""
    path = _chain(tmp_path / "m" / "m.onnx", external=True)
    skeleton = onnx.load(str(path), load_external_data=False).SerializeToString()
    handoff = Handoff(model=skeleton, config=MappingProxyType({FOLDER_KEY: str(path.parent)}), action=Decision.MAPPED)
    with pytest.raises(Exception):  # without the entry ORT looks for the data beside the process
        ort.InferenceSession(skeleton, providers=CPU)
    so = ort.SessionOptions()
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if callers_folder is not None:
        so.add_session_config_entry(FOLDER_KEY, str(tmp_path / callers_folder))
    sess = _create(handoff, so)
    assert sess.get_session_options().get_session_config_entry(FOLDER_KEY) == str(path.parent)
    assert sess.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert get_config(so, FOLDER_KEY) == (str(tmp_path / callers_folder) if callers_folder else "")
    assert so.execution_order == ort.ExecutionOrder.PRIORITY_BASED  # the caller's own, untouched
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert_same_outputs(sess.run(None, CHAIN_FEEDS), run_plain(path, CHAIN_FEEDS))


@needs_saving
def test_a_finished_model_ort_refuses_is_discarded_and_the_entry_loaded(tmp_path, qdq):
    request, warm = _finished(qdq, tmp_path / "cache")
    finished = Path(warm.model)
    m = onnx.load(str(finished), load_external_data=False)
    for t in m.graph.initializer:  # a tensor past the end of its file: ORT refuses the session
        for e in t.external_data:
            if e.key == "offset":
                e.value = str(1 << 40)
    finished.chmod(0o600)
    onnx.save_model(m, str(finished))
    with pytest.raises(Exception):
        _create(warm)
    refused = warm.refused()
    assert warm.action == Decision.FINISHED and warm.model == str(finished)  # the handoff is never edited
    assert refused.action == Decision.CACHE_HIT and refused.model == warm.fallback
    assert refused.fallback is None and refused.start is None
    assert not finished.exists()  # the store offers it no more
    assert_same_outputs(_create(refused).run(None, FEEDS), run_plain(qdq, FEEDS))
    again = prepare(str(qdq), request)
    assert again.action == Decision.CACHE_HIT and again.model == warm.fallback


@needs_saving
def test_a_refusal_for_want_of_resources_keeps_the_finished_model(tmp_path, qdq):
    request, warm = _finished(qdq, tmp_path / "cache")
    kept = warm.refused(keep=True)
    assert kept.action == Decision.CACHE_HIT and kept.model == warm.fallback and Path(warm.model).is_file()
    assert_same_outputs(_create(kept).run(None, FEEDS), run_plain(qdq, FEEDS))
    again = prepare(str(qdq), request)
    assert again.action == Decision.FINISHED and again.model == warm.model


def test_a_refused_skeleton_falls_back_to_the_file_as_is(tmp_path):
    path = _chain(tmp_path / "m.onnx")
    mapped = prepare(path, Request.for_session(None, CPU, cache=tmp_path / "cache"))
    assert mapped.action == Decision.MAPPED and mapped.fallback == str(path) and mapped.model != str(path)
    refused = mapped.refused()
    assert refused.action == Decision.AS_IS and refused.model == str(path) and refused.fallback is None
    assert_same_outputs(_create(refused).run(None, CHAIN_FEEDS), run_plain(path, CHAIN_FEEDS))
    refused.after_create()


def _mapped(tmp_path, request):
    return prepare(_chain(tmp_path / "m.onnx"), Request.for_session(None, CPU, cache=tmp_path / "cache"))


def _loaded(tmp_path, request):
    return prepare(load(_chain(tmp_path / "m.onnx")), AS_GIVEN)


def _converted_temporary(tmp_path, request):
    return prepare(str(tiny_decoder(tmp_path / "src", storage="external")), Request.for_session(None, CPU, cache=False))


def _in_memory(tmp_path, request):
    request.getfixturevalue("no_temp_folder")
    return _converted_temporary(tmp_path, request)


@pytest.mark.parametrize("make, action", [(_mapped, Decision.MAPPED), (_loaded, Decision.MAPPED),
                                          (_converted_temporary, Decision.CONVERTED_TEMPORARY),
                                          (_in_memory, Decision.IN_MEMORY)],
                         ids=["mapped", "loaded", "converted-temporary", "in-memory"])
def test_after_create_gives_back_what_it_holds_and_may_be_called_again(tmp_path, request, make, action):
    handoff = make(tmp_path, request)
    assert handoff.action == action
    assert all(d.is_dir() for d in handoff.tempdirs) and (handoff.tempdirs or handoff.memory is not None)
    source = handoff.source
    feeds = FEEDS if handoff.report is not None else CHAIN_FEEDS
    original = tmp_path / "src" / "model.onnx" if handoff.report is not None else tmp_path / "m.onnx"
    sess = _create(handoff)
    handoff.after_create()
    handoff.after_create()
    handoff.cleanup()
    assert not any(d.exists() for d in handoff.tempdirs)
    if source is not None:
        assert all(w.state is ortmem.WeightState.RELEASED for w in source.weights)
    assert_same_outputs(sess.run(None, feeds), run_plain(original, feeds))


def test_with_recorded_settings_parses_nothing_without_metadata(tmp_path, monkeypatch):
    """No recompute mention in what ORT gets: the same handoff back, nothing parsed; a model that records
    them is parsed and replayed."""
    plain = _chain(tmp_path / "plain.onnx")
    handoffs = [prepare(plain, Request.for_session(None, CPU, cache=tmp_path / "cache")),  # a skeleton by path
                prepare(load(plain), AS_GIVEN),  # the loader's own parse
                Handoff(model=plain.read_bytes()), Handoff(model=str(plain))]

    def parsed(*args, **kwargs):
        raise AssertionError("parsed a model that records nothing")

    with monkeypatch.context() as m:
        m.setattr(Handoff, "skeleton", parsed)
        m.setattr(onnx, "load", parsed)
        for handoff in handoffs:
            assert handoff.with_recorded_settings() is handoff and not handoff.recompute
    for handoff in handoffs:
        handoff.after_create()
    recorded = Handoff(model=str(_records_recompute(_chain(tmp_path / "rec.onnx"))))
    replayed = recorded.with_recorded_settings()
    assert replayed is not recorded and dict(replayed.recompute) == RECORDED
    assert_same_outputs(_create(replayed).run(None, CHAIN_FEEDS), run_plain(tmp_path / "rec.onnx", CHAIN_FEEDS))


@pytest.mark.usefixtures("no_temp_folder")
def test_an_in_memory_conversion_replays_the_recorded_settings(qdq):
    handoff = prepare(str(qdq), Request.for_session(None, CPU, cache=False))
    assert handoff.action == Decision.IN_MEMORY and RECOMPUTE_METADATA.encode() in handoff.model
    try:
        assert dict(handoff.with_recorded_settings().recompute) == RECORDED
    finally:
        handoff.after_create()
