"""ortmem.ortmodel.release: the installed ORT, its probed capabilities, and what ortmem does with them.

The probe runs the installed ORT for real (a subprocess, cached per build and CPU); these tests check
that table and probe agree on every release CI runs, that a disagreement or a failed probe makes ortmem
step aside, and that a release outside the range gets zero-copy loading only.
"""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.ortmodel import variants as pr
from ortmem.ortmodel import release as rel
from ortmem.synth import SynthConfig, write_model

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


@pytest.fixture
def fresh_capabilities(monkeypatch):
    """Forget the process-wide answer so a test can install its own; restored afterwards."""
    monkeypatch.setattr(rel, "_current", None)
    rel._warn_once.cache_clear()
    yield
    rel._current = None


def test_installed_release_is_in_range_and_table_and_probe_agree():
    """Every release CI runs is in the table; the probe of this very build agrees with its row."""
    here = rel.installed()
    assert here.version == ort.__version__ and here.supported
    assert here.facts() is not None
    caps = rel.capabilities()
    assert caps.source == "probe" and caps.convert
    assert not [n for n in caps.notes if "disagree" in n or "expects" in n], caps.notes
    table = rel.table_capabilities()
    assert {k: v.ok for k, v in caps.matmul.items()} == {k: v.ok for k, v in table.matmul.items()}
    assert {k: v.ok for k, v in caps.gather.items()} == {k: v.ok for k, v in table.gather.items()}
    assert caps.prepacked_save == table.prepacked_save
    # the 4-bit float-scale core converts on every supported release
    assert caps.matmul_refusal(weight_type="int4", has_zp=False, scale_type="float", accuracy=4) is None


def test_probe_answers_are_cached_privately_and_reused(tmp_path, monkeypatch, fresh_capabilities):
    monkeypatch.setenv("ORTMEM_PROBE_DIR", str(tmp_path / "probes"))
    calls = []
    real = rel.run_probe
    monkeypatch.setattr(rel, "run_probe", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = rel.capabilities()
    (path,) = (tmp_path / "probes").iterdir()
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct((tmp_path / "probes").stat().st_mode & 0o777) == "0o700"
    rel._current = None
    second = rel.capabilities()
    assert len(calls) == 1 and first.as_dict() == second.as_dict()
    # an answer file others may write is never trusted: asked again
    os.chmod(path, 0o666)
    rel._current = None
    rel.capabilities()
    assert len(calls) == 2


def test_a_disagreeing_probe_makes_ortmem_step_aside():
    table = rel.table_capabilities()
    answers = json.loads(json.dumps({"variants": {}}))
    for key in table.matmul:
        answers["variants"][key] = {"fused": True, "ortmem": "equal"}
    for key in table.gather:
        answers["variants"][key] = {"fused": False, "ortmem": "equal"}
    for block in pr.BLOCK_SWEEP:
        answers["variants"][f"block:{block}"] = {"fused": True, "ortmem": "equal"}
    answers["prepacked"] = {"saved": True, "reload": "equal"}
    key = pr.variant_key("matmul", "int4", False, "float", 4)
    answers["variants"][key] = {"fused": True, "ortmem": "differs (max |diff| 0.5)"}
    caps = rel.reconcile(table, answers)
    why = caps.matmul_refusal(weight_type="int4", has_zp=False, scale_type="float", accuracy=4)
    assert why and "differs" in why
    # the probe says yes where the table says no: not converted either, and noted
    refused = [k for k, v in table.matmul.items() if not v.ok]
    if refused:
        caps = rel.reconcile(table, answers)
        assert not caps.matmul[refused[0]].ok and any("disagree" in n for n in caps.notes)
    # ORT's own fused model failing at run is a refusal too
    answers["variants"][key] = {"fused": True, "reference_error": "boom"}
    assert "fails to run its own" in rel.reconcile(table, answers).matmul[key].why


def test_block_bound_from_the_sweep():
    sweep = {f"block:{b}": {"fused": b <= 256, "ortmem": "equal"} for b in pr.BLOCK_SWEEP}
    assert rel.probed_block_max(sweep, 256) == (256, 256)
    sweep = {f"block:{b}": {"fused": True, "ortmem": "equal" if b <= 256 else "differs"} for b in pr.BLOCK_SWEEP}
    assert rel.probed_block_max(sweep, rel.UNBOUNDED) == (rel.UNBOUNDED, 256)


def test_out_of_range_release_gets_zero_copy_loading_only(tmp_path, monkeypatch, fresh_capabilities):
    """A release outside the range: no conversion, no pre-packed weights, one warning; outputs = ORT's."""
    old = rel.Release("1.20.1", "fake", (), "x86_64")
    assert not old.supported and old.facts() is None
    monkeypatch.setattr(rel, "installed", lambda: old)
    (tmp_path / "m").mkdir()
    path = write_model(SynthConfig.tiny(storage="external"), tmp_path / "m" / "model.onnx")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s1 = ortmem.InferenceSession(path, cache=tmp_path / "cache")
        s2 = ortmem.InferenceSession(path, cache=tmp_path / "cache")
    assert sum("outside ortmem's tested range" in str(w.message) for w in seen) == 1
    for s in (s1, s2):
        assert not s.ortmem_cache_hit
        assert s.ortmem_report is None or not s.ortmem_report.converted
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    assert np.array_equal(s1.run(None, FEEDS)[0], expected)


def test_a_probe_that_cannot_run_disables_conversion(tmp_path, monkeypatch, fresh_capabilities):
    monkeypatch.setenv("ORTMEM_PROBE_DIR", str(tmp_path / "probes"))

    def crash(*a, **k):
        raise RuntimeError("probe exited with -11: Segmentation fault")

    monkeypatch.setattr(rel, "run_probe", crash)
    with pytest.warns(RuntimeWarning, match="could not be probed"):
        caps = rel.capabilities()
    assert not caps.convert and "Segmentation fault" in caps.matmul_refusal(
        weight_type="int4", has_zp=False, scale_type="float", accuracy=4)


def test_parse_version():
    assert rel.parse_version("1.32.0") == (1, 32, 0)
    assert rel.parse_version("1.33.0.dev20261101") == (1, 33, 0)
    assert rel.parse_version("1.25.1+cpu") == (1, 25, 1)
    assert rel.parse_version("1.26") == (1, 26, 0)


def test_doctor_and_version(capsys):
    from ortmem.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"onnxruntime {ort.__version__}" in out and "variants left to ORT" in out and "allocator hygiene" in out
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["capabilities"]["onnxruntime"] == ort.__version__ and data["cache"]["usable"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "supported 1.25-1.32.x" in capsys.readouterr().out
