"""The bench's strategies for prepared entries (``ortmem-prepared-warm``) and genai folders (``genai``,
``genai-prepared``): real fresh-process probes and workers on tiny models, outputs compared with plain
ORT's (or plain genai's) by hash, and the ortmem start checked to be the warm one it claims to measure."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortmem.measure.bench import run_bench
from ortmem.measure.workers import run_workers
from ortmem.ort.release import capabilities
from ortmem.onnxfile.scan import MIN_BYTES_ENV

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")


def mlp(path: Path, layers: int = 3, dim: int = 256) -> Path:
    """An fp32 MLP whose MatMul weights ORT pre-packs (external data, as deployed models are)."""
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((dim, dim)) * dim ** -0.5).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]), helper.make_node("Tanh", [f"h{i}"], [f"t{i}"])]
        x = f"t{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


@pytest.fixture
def bench_env(tmp_path, monkeypatch):
    """A cache of the test's own (the strategies' caches live under it) and every model prepared
    whatever its size (the model here is small); the bench's children inherit both."""
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(MIN_BYTES_ENV, "0")
    return tmp_path


def test_prepared_warm_maps_the_prepared_entry_with_plain_orts_outputs(bench_env):
    model = mlp(bench_env / "mlp.onnx")
    report = run_bench([model], ["ort", "ortmem-prepared-warm"], 1, progress=False)
    mr = report.models[0]
    warm = mr.strategies["ortmem-prepared-warm"]
    assert not warm.errors and warm.runs
    assert [r.ortmem_action for r in warm.runs] == ["finished"]  # the entry `ortmem prepare` built, mapped
    assert mr.strategies["ort"].runs[0].ortmem_action is None
    assert mr.same_output_as_ort("ortmem-prepared-warm") is True


def test_prepared_warm_runs_as_workers(bench_env):
    model = mlp(bench_env / "mlp.onnx")
    report = run_workers(model, ["ort", "ortmem-prepared-warm"], [2])
    run = report.run("ortmem-prepared-warm", 2)
    assert run is not None and len(run.workers) == 2
    assert {w.ortmem_action for w in run.workers} == {"finished"}
    assert report.same_output(run) is True


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None,
                    reason="onnxruntime-genai is not installed (pip install '.[genai]')")
def test_genai_strategies_generate_the_same_tokens_and_logits(bench_env):
    from tests.support.genai_folder import build_genai_folder

    folder = build_genai_folder(bench_env / "genai")
    report = run_bench([folder], ["genai", "genai-prepared"], 1, progress=False)
    mr = report.models[0]
    plain, prepared = mr.strategies["genai"], mr.strategies["genai-prepared"]
    assert not plain.errors and not prepared.errors
    assert plain.runs[0].output_hash == prepared.runs[0].output_hash
    assert (folder / "model.ortmem-prepared.json").exists()  # `ortmem prepare FOLDER` wrote it in the folder
