"""Running a partitioned model: ``PipelineSession`` behaves like the unpartitioned
InferenceSession and gives bit-identical outputs."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortmem.plan.partition.run.pipeline_session import PipelineSession
from ortmem.errors import PlanError
from ortmem.plan.partition import partition
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.builders import save, subgraph_model
from tests.support.compare import assert_close_outputs, assert_same_outputs
from tests.support.reference import run_plain

DIMS = {"batch": 2, "seq": 16}
BUDGETS = {"cpu:0": 450_000, "cpu:1": 350_000, "cpu": 10**8}  # two small "devices" and a big one


def _ids(vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, size=(2, 16), dtype=np.int64)


@pytest.fixture(scope="module", params=["qdq", "native"])
def split_tiny(request, tmp_path_factory):
    """A synthetic Llama (QDQ or native MatMulNBits) split over three devices, written."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = write_model(SynthConfig.tiny(storage="external", form=request.param), folder / "tiny.onnx")
    plan = partition(model, BUDGETS, dims=DIMS, out_dir=folder / "parts", stage_overhead=0, verify=False)
    assert len(plan.stages) >= 3 and len({s.device for s in plan.stages}) == 3  # back to an earlier device too
    return model, plan


@pytest.mark.parametrize("transfer", ["auto", "ortvalue"])
def test_outputs_are_bit_identical_to_the_unpartitioned_model(split_tiny, transfer):
    model, plan = split_tiny
    feeds = {"input_ids": _ids()}
    pipe = PipelineSession(plan.out_dir, transfer=transfer)
    got = pipe.run(None, feeds)
    ref = run_plain(model, feeds)
    assert_same_outputs(got, ref)
    # and through ortmem's own session (the QDQ form converted ahead of time, as each stage is)
    import ortmem

    mine = ortmem.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert np.array_equal(mine[0], got[0])


def test_behaves_like_an_inference_session(split_tiny):
    model, plan = split_tiny
    pipe = PipelineSession(Path(plan.out_dir) / "plan.json")
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert [(a.name, a.type, a.shape) for a in pipe.get_inputs()] == \
        [(a.name, a.type, a.shape) for a in ref.get_inputs()]
    assert [(a.name, a.type, a.shape) for a in pipe.get_outputs()] == \
        [(a.name, a.type, a.shape) for a in ref.get_outputs()]
    assert pipe.get_providers() == ["CPUExecutionProvider"]
    assert len(pipe.sessions) == len(plan.stages)
    (logits,) = pipe.run(["logits"], {"input_ids": _ids()})
    assert logits.shape == (2, 16, 1000) and logits.dtype == np.float32
    with pytest.raises(ValueError, match="unknown output"):
        pipe.run(["nope"], {"input_ids": _ids()})
    with pytest.raises(ValueError, match="missing input"):
        pipe.run(None, {})


def test_subgraphs_run_in_their_stage(tmp_path):
    rng = np.random.default_rng(0)
    path = save(subgraph_model(rng), tmp_path / "m" / "m.onnx", external=True)
    plan = partition(path, {"cpu:0": 140_000, "cpu:1": 140_000, "cpu": 10**8}, by="node", out_dir=tmp_path / "p",
                     stage_overhead=0, verify=False)
    pipe = PipelineSession(plan)
    for cond in (True, False):  # both If branches
        feeds = {"x": rng.standard_normal((1, 128), dtype=np.float32), "c": np.array(cond),
                 "trip": np.array(3, np.int64)}
        assert np.array_equal(pipe.run(None, feeds)[0], run_plain(path, feeds)[0])


def test_modules_one_by_one_still_run_correctly(tmp_path):
    # by="node" may cut inside a pattern ORT fuses (an RMS norm): outputs then agree to rounding only
    model = write_model(SynthConfig.tiny(storage="external"), tmp_path / "tiny.onnx")
    plan = partition(model, {"cpu:0": 767_000, "cpu:1": 253_000, "cpu": 10**8}, by="node", dims=DIMS,
                     out_dir=tmp_path / "p", stage_overhead=0, verify=False, cut_slack=0.0)
    feeds = {"input_ids": _ids()}
    got = PipelineSession(plan).run(None, feeds)[0]
    assert_close_outputs([got], run_plain(model, feeds)[:1], rtol=0, atol=1e-4)


def test_devices_map_to_providers_and_overrides(split_tiny):
    _, plan = split_tiny
    pipe = PipelineSession(plan, providers_per_device={"cpu:0": ("CPUExecutionProvider", {})})
    assert pipe.get_providers() == ["CPUExecutionProvider"]


def test_an_unwritten_plan_cannot_run(tmp_path):
    model = write_model(SynthConfig.tiny(storage="external"), tmp_path / "tiny.onnx")
    plan = partition(model, {"cpu": 10**8}, dims=DIMS, stage_overhead=0, verify=False)
    with pytest.raises(PlanError, match="was not written"):
        PipelineSession(plan)
    with pytest.raises(PlanError, match="transfer"):
        PipelineSession(partition(model, {"cpu": 10**8}, out_dir=tmp_path / "p", stage_overhead=0, verify=False),
                        transfer="carrier pigeon")
