"""What the hook and the session path decide from a model file's bytes (:mod:`ortmem.onnxfile.scan`),
on real files saved by onnx: where the weights sit, what needs the loader, and what ORT is given."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

import ortmem
from ortmem.onnxfile import scan
from ortmem.session.decide import prepare
from ortmem.session.request import AS_GIVEN
from ortmem.onnxfile.loader import load
from ortmem.onnxfile.scan import INLINE_MAX_BYTES, needs_session_path, plain_handoff, read_facts
from tests.support.builders import make_model, matmul_chain, save, subgraph_model
from tests.support.compare import assert_same_outputs
from tests.support.reference import CPU, run_plain


@pytest.fixture
def subgraph_file(tmp_path: Path) -> Path:
    """If branches, a Loop body, a Constant and a sparse initializer, every weight embedded."""
    return save(subgraph_model(np.random.default_rng(0)), tmp_path / "sub" / "model.onnx")


def test_weights_in_subgraphs_are_found_with_or_without_stopping(subgraph_file: Path):
    whole = read_facts(subgraph_file)
    stopped = read_facts(subgraph_file, stop_outside_main_graph=True)
    assert not whole.main_graph_only and whole.skeleton is not None
    assert not stopped.main_graph_only and stopped.skeleton is None  # no skeleton: the walk stopped
    assert stopped.embedded_bytes < whole.embedded_bytes
    for facts in (whole, stopped):
        assert not needs_session_path(subgraph_file, facts, converting=True)
        assert plain_handoff(subgraph_file, facts) is None  # the session path decides, never "as-is"


def test_a_stopped_walk_still_sends_external_data_to_the_loader(tmp_path: Path):
    """A tensor with external data after the first subgraph weight: a stopped walk never reached it,
    the search of the file finds its location entry; the whole walk checks it."""
    model = subgraph_model(np.random.default_rng(0))
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W_ext")
    (tmp_path / "weights.bin").write_bytes(w.raw_data)
    set_external_data(w, "weights.bin", offset=0, length=len(w.raw_data))
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    model.graph.initializer.append(w)  # after every node: the walk reaches it last
    path = tmp_path / "model.onnx"
    onnx.save_model(model, path)
    whole = read_facts(path)
    assert not whole.needs_loader and whole.external_ends == (("weights.bin", 64 * 64 * 4),)
    assert read_facts(path, stop_outside_main_graph=True).needs_loader


def test_main_graph_weights_are_main_graph_only(tmp_path: Path):
    path = save(matmul_chain(np.random.default_rng(1), [64, 256, 256, 8]), tmp_path / "chain.onnx")
    for stop in (False, True):
        facts = read_facts(path, stop_outside_main_graph=stop)
        assert facts.main_graph_only and facts.skeleton is not None and facts.embedded_bytes > 0


def test_a_file_above_the_search_limit_is_walked_whole(subgraph_file: Path, monkeypatch: pytest.MonkeyPatch):
    """The search a stopped walk needs reads every byte: above the limit the walk goes on instead."""
    monkeypatch.setattr(scan, "STOPPED_SEARCH_MAX_BYTES", subgraph_file.stat().st_size - 1)
    facts = read_facts(subgraph_file, stop_outside_main_graph=True)
    assert facts == read_facts(subgraph_file)
    assert not facts.main_graph_only and facts.skeleton is not None


def test_a_conversion_is_found_in_a_large_file_without_reading_its_weights(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """Above the search limit the walk's skeleton is read instead of every byte: the answer is the one
    below it, and a file the walk cannot read may hold one (the loader names the fault)."""
    from tests.support.builders import int4_model

    qdq = save(int4_model(np.random.default_rng(0), k=1024, n=512), tmp_path / "q" / "model.onnx")
    fp32 = save(matmul_chain(np.random.default_rng(1), [64, 512, 512, 8]), tmp_path / "f" / "model.onnx")
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"\x0a\xff\xff\xff\xff\x0f" + b"\x00" * 100)
    small = {p: scan.convertible_file(p) for p in (qdq, fp32)}
    monkeypatch.setattr(scan, "STOPPED_SEARCH_MAX_BYTES", 0)
    assert {p: scan.convertible_file(p) for p in (qdq, fp32)} == small == {qdq: True, fp32: False}
    assert scan.convertible_file(broken)


@pytest.mark.parametrize("nbytes", [INLINE_MAX_BYTES - 1, INLINE_MAX_BYTES, INLINE_MAX_BYTES + 1])
def test_the_hook_and_the_loader_agree_on_what_stays_inline_at_the_limit(tmp_path: Path, nbytes: int):
    """One uint8 weight of exactly the inline limit, a byte less and a byte more: the decision from the
    file's bytes (the hook's light route, a small file's start) and the loader (every other start)
    keep the same tensors inline and move the same ones, by the one limit both read."""
    w = numpy_helper.from_array(np.arange(nbytes, dtype=np.uint8), "W")
    graph = helper.make_graph([helper.make_node("Cast", ["W"], ["Wf"], to=TensorProto.FLOAT),
                               helper.make_node("Add", ["x", "Wf"], ["y"])], "inline-limit",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [nbytes])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [nbytes])], [w])
    path = save(make_model(graph), tmp_path / "model.onnx")
    moves = nbytes > INLINE_MAX_BYTES

    facts = read_facts(path)
    assert facts.embedded_bytes == (nbytes if moves else 0) and not needs_session_path(path, facts, converting=True)
    by_bytes = plain_handoff(path, facts)
    assert by_bytes is not None and by_bytes.action == ("mapped" if moves else "as-is")
    with load(path) as model:
        assert model.embedded_spans == (1 if moves else 0)
        assert [r.length for r in model.store] == ([nbytes] if moves else [])
        by_loader = prepare(model, AS_GIVEN)
        assert by_loader.action.value == by_bytes.action
        by_loader.cleanup()
    if by_bytes.workdir is not None:
        shutil.rmtree(by_bytes.workdir)

    feeds = {"x": np.ones(nbytes, np.float32)}
    session = ortmem.InferenceSession(path, providers=CPU)  # a small file: decided from its bytes
    assert session.ortmem_action == by_bytes.action
    assert_same_outputs(session.run(None, feeds), run_plain(path, feeds))
