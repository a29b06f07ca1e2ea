"""ortmem.measure: fresh-process probes against allocations of known size, the bench runner, the gate.

The strategies below are imported *by file path* in the measured child process
(``f"{__file__}:name"``), so this module's top level must stay cheap and side-effect free.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortmem.measure import STRATEGIES, ProbeError, ProbeUnsupported, Strategy, probe
from ortmem.base import procfs
from ortmem.measure.bench import (
    SCHEMA,
    StrategyResult,
    add_arguments,
    main,
    plot,
    read_json,
    render_table,
    run_bench,
    schedule,
    to_json_dict,
    write_json,
)
from ortmem.measure.budget_gate import assert_session_peak_below, session_memory_budget  # noqa: F401
from ortmem.ort.feeds import make_inputs, resolve_dim

MiB = 1 << 20
HERE = os.path.abspath(__file__)
slow = pytest.mark.slow

# --- strategies run inside the measured child ------------------------------------------------------

_KEEP: list[Any] = []  # keeps mappings alive for the life of the child


def alloc_200(model: str, options: dict) -> Any:
    """Touch 200 MiB of heap during "creation", free it, then create a trivial session. Held for
    0.3 s: the parent samples every 10 ms, and on a loaded machine a sample can come late."""
    a = np.ones(200 * MiB // 8)  # np.ones writes every page
    time.sleep(0.3)
    del a
    return ort.InferenceSession(model)


def keep_120(model: str, options: dict) -> Any:
    """Leave 120 MiB of heap allocated after "creation": memray must report it as in use."""
    _KEEP.append(np.ones(120 * MiB // 8))
    return ort.InferenceSession(model)


def map_100(model: str, options: dict) -> Any:
    """Map a 100 MiB file and fault every page in: RssFile must grow, RssAnon must not."""
    f = open(options["file"], "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    int(np.frombuffer(mm, np.uint8)[:: mmap.PAGESIZE].sum())
    _KEEP.append((f, mm))
    time.sleep(0.2)  # many sampler ticks with the mapping resident, even on a busy machine
    return ort.InferenceSession(model)


def spawn_helper(model: str, options: dict) -> Any:
    """A helper process that touches 150 MiB; its memory must count against the strategy."""
    code = "import time; b = b'\\x01' * (150 << 20); time.sleep(0.3)"
    subprocess.run([sys.executable, "-c", code], check=True)
    return ort.InferenceSession(model)


def broken(model: str, options: dict) -> Any:
    raise RuntimeError("strategy exploded on purpose")


def prepare_copy(model: str, options: dict, workdir: str) -> str:
    """An expensive preparation step (300 MiB) that must not be measured; returns a new path."""
    junk = np.ones(300 * MiB // 8)
    del junk
    out = os.path.join(workdir, "prepared.onnx")
    with open(model, "rb") as src, open(out, "wb") as dst:
        dst.write(src.read())
    return out


def create_prepared(model: str, options: dict) -> Any:
    assert model.endswith("prepared.onnx"), model
    return ort.InferenceSession(model)


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    # imported here: the probe's child imports this file for its strategies, from any folder
    from tests.support.builders import embedding_relu_model

    return str(embedding_relu_model(tmp_path_factory.mktemp("measure") / "tiny.onnx"))


@pytest.fixture(scope="module")
def bench_report(tiny: str):
    return run_bench([tiny], ["ort", "ort-noopt"], repeat=2, progress=False)


def _above(result, field: str) -> float:
    return (getattr(result, field) - result.baseline_rss_bytes) / MiB


# --- probe -----------------------------------------------------------------------------------------


@slow
def test_known_allocation_is_measured(tiny: str) -> None:
    r = probe(f"{HERE}:alloc_200", tiny)
    above = _above(r, "peak_create_bytes")
    assert 180 <= above <= 220, f"peak above baseline {above:.1f} MiB, expected 200 +-10%"
    assert r.helper_pids == [] and r.helper_peak_create_bytes == 0
    assert r.peak_create_bytes == r.main_peak_create_bytes
    assert _above(r, "rss_after_create_bytes") < 50  # the array was freed (munmap'd)
    assert r.hwm_reset
    assert (r.peak_anon_bytes - r.baseline_anon_bytes) / MiB > 150  # sampler saw it as heap
    names = [e for e, _ in sorted(r.events.items(), key=lambda kv: kv[1])]
    assert names.index("create_start") < names.index("create_end") < names.index("run_start") < names.index("run_end")
    assert r.timeline and all(isinstance(p[0], float) for p in r.timeline)


@slow
def test_mapped_file_counts_as_file_not_anon(tiny: str, tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(np.random.default_rng(0).integers(0, 255, 100 * MiB, dtype=np.uint8).tobytes())
    r = probe(f"{HERE}:map_100", tiny, options={"file": str(blob)})
    # exact, read by the child right after creation (the mapping is still alive then) ...
    assert (r.file_after_create_bytes - r.baseline_file_bytes) / MiB >= 95
    assert (r.anon_after_create_bytes - r.baseline_anon_bytes) / MiB < 25
    # ... and the parent's sampled peaks agree
    file_growth = (r.peak_file_bytes - r.baseline_file_bytes) / MiB
    anon_growth = (r.peak_anon_bytes - r.baseline_anon_bytes) / MiB
    assert file_growth >= 95, file_growth
    assert anon_growth < 25, anon_growth
    assert _above(r, "peak_create_bytes") >= 95  # VmHWM counts file-backed pages too


@slow
def test_helper_process_memory_is_counted(tiny: str) -> None:
    r = probe(f"{HERE}:spawn_helper", tiny)
    assert r.helper_pids, "the sampler never saw the helper process"
    assert 150 <= r.helper_peak_create_bytes / MiB <= 200, r.helper_peak_create_bytes / MiB
    # the helper ran while the child waited for it: both at once are the strategy's peak
    assert _above(r, "peak_create_bytes") >= 150, _above(r, "peak_create_bytes")
    assert _above(r, "main_peak_create_bytes") < 100  # the child itself never held it


@slow
def test_output_hash_equal_for_ort_and_noopt(tiny: str) -> None:
    a = probe("ort", tiny)
    b = probe("ort-noopt", tiny)
    assert a.output_hash and a.output_hash == b.output_hash
    assert a.outputs == [{"name": "y", "dtype": "float32", "shape": [1, 8, 16]}]
    c = probe("ort", tiny, options={"dims": {"seq": 3}})
    assert c.outputs[0]["shape"] == [1, 3, 16] and c.output_hash != a.output_hash


@slow
def test_memray_reports_heap_peak_and_site(tiny: str) -> None:
    r = probe(f"{HERE}:alloc_200", tiny, memray=True)
    assert r.memray_enabled and r.memray is not None
    assert r.memray["peak_bytes"] >= 200 * MiB
    top = r.memray["top"][0]
    assert top["bytes"] >= 200 * MiB
    assert any("alloc_200" in frame for frame in top["stack"]), top["stack"]
    assert r.memray["in_use_heap_bytes"] < 20 * MiB  # freed before creation ended


def test_memray_in_use_after_creation_counts_what_stays(tiny: str) -> None:
    r = probe(f"{HERE}:keep_120", tiny, memray=True)
    assert 120 * MiB <= r.memray["in_use_heap_bytes"] < 140 * MiB


@slow
def test_preparation_runs_apart_and_is_not_measured(tiny: str) -> None:
    strat = Strategy("prep-test", create=f"{HERE}:create_prepared", prepare=f"{HERE}:prepare_copy")
    r = probe(strat, tiny)
    assert r.prepared_model is not None and r.prepared_model.endswith("prepared.onnx")
    assert r.prepare_wall_s is not None
    assert _above(r, "peak_bytes") < 100  # the 300 MiB of the preparation is not in the peak


@slow
def test_failing_strategy_raises_probe_error_with_stderr(tiny: str) -> None:
    with pytest.raises(ProbeError, match="strategy exploded on purpose"):
        probe(f"{HERE}:broken", tiny)


def test_unknown_strategy_name() -> None:
    with pytest.raises(KeyError, match="unknown strategy"):
        probe("no-such-strategy", "x.onnx")


def test_unsupported_platform_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procfs, "unsupported_reason", lambda: "no /proc here")
    with pytest.raises(ProbeUnsupported, match="no /proc"):
        probe("ort", "x.onnx")


def test_inputs_are_deterministic_and_valid_indices() -> None:
    class Meta:
        def __init__(self, name: str, type_: str, shape: list) -> None:
            self.name, self.type, self.shape = name, type_, shape

    class Fake:
        def get_inputs(self) -> list:
            return [
                Meta("input_ids", "tensor(int64)", ["batch_size", "sequence_length"]),
                Meta("attention_mask", "tensor(int64)", ["batch_size", "sequence_length"]),
                Meta("position_ids", "tensor(int64)", [1, "sequence_length"]),
                Meta("x", "tensor(float16)", [2, None]),
            ]

    a, b = make_inputs(Fake()), make_inputs(Fake())
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["input_ids"].shape == (1, 8) and a["input_ids"].max() < 100 and a["input_ids"].min() >= 0
    assert (a["attention_mask"] == 1).all()
    assert a["position_ids"].tolist() == [list(range(8))]
    assert a["x"].dtype == np.float16 and a["x"].shape == (2, 8)
    assert resolve_dim("seq", {"seq": 5}) == 5 and resolve_dim(7, {}) == 7


# --- bench -----------------------------------------------------------------------------------------


def test_schedule_interleaves() -> None:
    """Rounds of every strategy once, each round rotated by one (tests/measure/test_bench.py)."""
    assert schedule(["m"], ["A", "B", "C"], 2) == [
        ("m", "A", 0), ("m", "B", 0), ("m", "C", 0), ("m", "B", 1), ("m", "C", 1), ("m", "A", 1),
    ]


@slow
def test_bench_runs_interleaved(bench_report) -> None:
    runs = [r for sr in bench_report.models[0].strategies.values() for r in sr.runs]
    executed = [r.strategy for r in sorted(runs, key=lambda r: r.started_unix)]
    assert executed == ["ort", "ort-noopt", "ort-noopt", "ort"]
    assert [o[1] for o in bench_report.order] == executed


@slow
def test_bench_json_round_trip(bench_report, tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    write_json(bench_report, path)
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA == "ortmem.bench/2"
    strat = raw["models"][0]["strategies"][0]
    assert set(strat) >= {"strategy", "summary", "spread", "bimodal", "ratios", "runs", "errors", "median_run"}
    assert strat["ratios"]["ort"]["peak_bytes"] == pytest.approx(1.0)
    assert raw["models"][0]["strategies"][1]["same_output_as_ort"] is True
    back = read_json(path)
    assert to_json_dict(back) == raw
    assert render_table(back) == render_table(bench_report)
    old = json.loads(json.dumps(raw))  # a version-1 file (no workers, no file_after_run_bytes) still reads
    old["schema"] = "ortmem.bench/1"
    del old["workers"]
    for run in old["models"][0]["strategies"][0]["runs"]:
        del run["file_after_run_bytes"]
    path.write_text(json.dumps(old))
    assert read_json(path).models[0].strategies["ort"].runs[0].file_after_run_bytes is None
    raw["schema"] = "ortmem.bench/999"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="schema"):
        read_json(path)


@slow
def test_table_and_plot(bench_report, tmp_path: Path) -> None:
    lines = render_table(bench_report).splitlines()
    assert lines[1].startswith("strategy") and "peak MiB" in lines[1]
    assert "private run/ort" in lines[1] and "shared run" in lines[1] and "shared pk" not in lines[1]
    assert any(line.startswith("ort-noopt") for line in lines)
    wide = render_table(bench_report, wide=True).splitlines()
    assert "shared pk" in wide[1] and "init fastest/ort" in wide[1] and any(w.startswith("ort-noopt") for w in wide)
    png = tmp_path / "bench.png"
    plot(bench_report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    from ortmem.measure.plotting import figure
    from tests.support.figures import cut_off

    named = copy.deepcopy(bench_report)  # a long model name: its title is wrapped, not cut
    named.models[0].model = str(tmp_path / ("llama-3.2-3b-instruct-int4-block32-" * 3 + "qdq.onnx"))
    for report in (bench_report, named):
        fig = figure(report)
        try:
            assert cut_off(fig) == []
            assert fig.axes[0].get_title(loc="left").startswith(os.path.basename(report.models[0].model)[:20])
        finally:
            plt.close(fig)


@slow
def test_bimodal_flag(bench_report) -> None:
    run = bench_report.models[0].strategies["ort"].runs[0]
    low = dataclasses.replace(run, peak_bytes=100 * MiB)
    high = dataclasses.replace(run, peak_bytes=110 * MiB)
    steady = StrategyResult("x", runs=[low, dataclasses.replace(run, peak_bytes=101 * MiB)])
    split = StrategyResult("x", runs=[low, high, low])
    assert not steady.bimodal
    assert split.bimodal and split.spread == pytest.approx(1.1)
    assert split.runs[split.median_run].peak_bytes == 100 * MiB


@slow
def test_bench_prepares_once_and_ratios_to_twin(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    twin = Strategy("twin", create=f"{HERE}:create_prepared", prepare=f"{HERE}:prepare_copy")
    monkeypatch.setitem(STRATEGIES, "twin", twin)
    report = run_bench([tiny], ["ort", "twin"], repeat=2, progress=False)
    mr = report.models[0]
    tw = mr.strategies["twin"]
    assert len(tw.runs) == 2 and not tw.errors
    assert tw.prepared_model and all(r.prepared_model == tw.prepared_model for r in tw.runs)
    assert len({r.prepare_wall_s for r in tw.runs}) == 1  # one preparation, shared by the repeats
    assert mr.ratios("twin")["twin"]["peak_bytes"] == pytest.approx(1.0)
    assert "twin" in mr.ratios("ort") and mr.same_output_as_ort("twin") is True
    jitters = [r.heap_jitter_bytes for r in mr.strategies["ort"].runs]
    assert jitters == [r.heap_jitter_bytes for r in tw.runs] and len(set(jitters)) == 2


@slow
def test_cli_main(tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser(prog="ortmem bench")
    add_arguments(parser)
    assert main(parser.parse_args([tiny, "-s", "nope"])) == 2
    args = parser.parse_args([tiny, "-s", "ort", "-n", "1", "--dim", "seq=4", "--json", str(tmp_path / "r.json"),
                              "--plot", str(tmp_path / "r.png"), "-q"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tiny.onnx" in out and "peak MiB" in out
    back = read_json(tmp_path / "r.json")
    assert back.models[0].strategies["ort"].runs[0].outputs[0]["shape"] == [1, 4, 16]
    assert (tmp_path / "r.png").stat().st_size > 10_000


# --- gate ------------------------------------------------------------------------------------------


@slow
def test_gate_passes_and_fails(tiny: str) -> None:
    r = assert_session_peak_below(tiny, 2048 * MiB)
    assert r.peak_bytes < 2048 * MiB
    with pytest.raises(AssertionError, match=r"exceeds budget 10\.0 MiB"):
        assert_session_peak_below(tiny, 10 * MiB)
    assert_session_peak_below(tiny, 260 * MiB, strategy=f"{HERE}:alloc_200", include_baseline=False)
    with pytest.raises(AssertionError, match="over the import baseline"):
        assert_session_peak_below(tiny, 150 * MiB, strategy=f"{HERE}:alloc_200", include_baseline=False)


@slow
def test_gate_fixture(tiny: str, session_memory_budget) -> None:  # noqa: F811
    result = session_memory_budget(tiny, 1024 * MiB, strategy="ort-noopt", phase="create")
    assert result.strategy == "ort-noopt"
