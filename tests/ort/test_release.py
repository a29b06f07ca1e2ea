"""ortmem.ort.release: the installed ORT, its probed capabilities, and what ortmem does with them.

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
from ortmem.ort import variants as pr
from ortmem.ort import release as rel
from ortmem.store.writer import write_converted
from ortmem.ort.settings import session_settings
from ortmem.passes.engine import plan_conversion
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.reference import run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


def test_the_probe_decides_and_a_tested_release_agrees_with_its_row():
    """The installed release is decided by its probe. A tested release (one with a table row, run by
    CI) must still measure what the row records: a disagreement means the record is stale."""
    here = rel.installed()
    assert here.version == ort.__version__ and here.supported
    caps = rel.capabilities()
    assert caps.source == "probe" and caps.convert
    # the 4-bit float-scale core converts on every supported release
    assert caps.matmul_refusal(weight_type="int4", has_zp=False, scale_type="float", accuracy=4) is None
    table = rel.table_capabilities()
    if table is None:  # untested here: nothing to agree with, and no disagreement can be noted
        assert not [n for n in caps.notes if "disagree" in n], caps.notes
        return
    assert not [n for n in caps.notes if "disagree" in n], caps.notes
    assert {k: v.ok for k, v in caps.matmul.items()} == {k: v.ok for k, v in table.matmul.items()}
    assert {k: v.ok for k, v in caps.gather.items()} == {k: v.ok for k, v in table.gather.items()}
    for name in ("fusion_block_max", "convert_block_max", "prepacked_save", "prepacked_validated",
                 "shared_initializer_guard", "borrows_memory_buffers"):
        assert getattr(caps, name) == getattr(table, name), name


def test_tested_releases_are_the_table_rows_and_what_ci_runs():
    """TESTED_RELEASES, the table's rows and the releases .ci/run runs the full suite on are one list."""
    from tests.support.paths import REPO

    assert {rel.parse_version(v)[:2] for v in rel.TESTED_RELEASES} == set(rel.RELEASE_TABLE)
    script = (REPO / ".ci" / "run").read_text()
    for version in rel.TESTED_RELEASES[:-1]:  # the newest is the one pip picks for the README's command
        assert version in script, f"{version} is tested but .ci/run does not run it"


def _answers_of_this_build() -> dict:
    """The probe's answers for the installed build (cached by the capabilities the session uses)."""
    rel.capabilities()
    folder = rel.probe_dir()
    data = json.loads((folder / f"{rel.installed().key()}.json").read_text())
    assert rel.well_formed(data)
    return data


def test_a_release_without_a_row_is_decided_by_its_probe_alone(tmp_path, monkeypatch, fresh_capabilities):
    """Simulate the next release (and one between two tested ones) by removing this release's row:
    every decision is the same, so conversions are byte-identical; a newer one gets one notice."""
    answers = _answers_of_this_build()
    here = rel.installed()
    with_row = rel.from_probe(here, answers)
    row = rel.RELEASE_TABLE.pop(here.version_tuple[:2], None)
    try:
        without = rel.from_probe(here, answers)
        newest_row = max(rel.RELEASE_TABLE)
        untested = without.notes if here.version_tuple[:2] > newest_row else ()
    finally:
        if row is not None:
            rel.RELEASE_TABLE[here.version_tuple[:2]] = row
    decisions = lambda c: {k: v for k, v in c.as_dict().items() if k not in ("notes", "onnxruntime")}  # noqa: E731
    assert decisions(without) == decisions(with_row)
    if here.version_tuple[:2] > newest_row:  # the newest tested release, simulated as the next one
        assert any("newer than the last release" in n for n in untested)
    # the same capabilities write the same bytes
    (tmp_path / "m").mkdir()
    path = write_model(SynthConfig.tiny(storage="external", embedding="quantized"), tmp_path / "m" / "model.onnx")
    outs = []
    for caps in (with_row, without):
        out = tmp_path / f"out-{len(outs)}"
        out.mkdir()
        with ortmem.load(path) as model:
            write_converted(model, plan_conversion(model, session_settings(), capabilities=caps), out)
        outs.append({f.name: f.read_bytes() for f in out.iterdir()})
    assert outs[0] == outs[1] and outs[0]


def test_a_newer_release_converts_with_one_notice(tmp_path, monkeypatch, fresh_capabilities):
    """A release newer than every row: converted where the probe proves it, one warning that says so,
    outputs equal to ORT's."""
    answers = _answers_of_this_build()
    here = rel.installed()
    newer = rel.Release(f"{here.version_tuple[0]}.{max(rel.RELEASE_TABLE)[1] + 1}.0", here.build, here.cpu_flags,
                        here.machine)
    monkeypatch.setattr(rel, "installed", lambda: newer)
    monkeypatch.setattr(rel, "run_probe", lambda *a, **k: answers)
    monkeypatch.setattr(rel, "_current", None)  # computed for the real release by _answers_of_this_build
    monkeypatch.setenv("ORTMEM_PROBE_DIR", str(tmp_path / "probes"))
    (tmp_path / "m").mkdir()
    path = write_model(SynthConfig.tiny(storage="external"), tmp_path / "m" / "model.onnx")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = ortmem.InferenceSession(path, cache=tmp_path / "cache")
        ortmem.InferenceSession(path, cache=tmp_path / "cache")
    assert sum("newer than the last release" in str(w.message) for w in seen) == 1
    assert first.ortmem_report is not None and first.ortmem_report.converted > 0
    expected = run_plain(path, FEEDS)[0]
    assert np.array_equal(first.run(None, FEEDS)[0], expected)


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


def _all_yes() -> dict:
    """Answers of a probe that saw every variant fused and reproduced, the sweep fused throughout."""
    mm_keys, ga_keys = rel.all_variant_keys()
    answers = {"variants": {}, "prepacked": {"saved": True, "reload": "equal", "validated": False}}
    for key in mm_keys:
        answers["variants"][key] = {"fused": True, "ortmem": "equal"}
    for key in ga_keys:
        answers["variants"][key] = {"fused": False, "ortmem": "equal"}
    for block in pr.BLOCK_SWEEP:
        answers["variants"][f"block:{block}"] = {"fused": True, "ortmem": "equal"}
    answers["variants"][pr.SHARED_WEIGHT_KEY] = {"fused": False}
    return answers


def test_what_the_probe_measures_is_what_ortmem_does():
    here = rel.installed()
    answers = _all_yes()
    key = pr.variant_key("matmul", "int4", False, "float", 4)
    answers["variants"][key] = {"fused": True, "ortmem": "differs (max |diff| 0.5)"}
    caps = rel.from_probe(here, answers)
    why = caps.matmul_refusal(weight_type="int4", has_zp=False, scale_type="float", accuracy=4)
    assert why and "differs" in why
    assert caps.matmul_refusal(weight_type="int4", has_zp=True, scale_type="float", accuracy=4) is None
    # ORT's own fused model failing at run is a refusal too
    answers["variants"][key] = {"fused": True, "reference_error": "boom"}
    assert "fails to run its own" in rel.from_probe(here, answers).matmul[key].why
    # a variant the probe could not answer is left to ORT
    del answers["variants"][key]
    assert "not probed" in rel.from_probe(here, answers).matmul[key].why
    # the structural rules and release-wide facts come from the probe too, the safe side when unanswered
    assert rel.from_probe(here, answers).shared_initializer_guard
    answers["variants"][pr.SHARED_WEIGHT_KEY] = {"fused": True}
    assert not rel.from_probe(here, answers).shared_initializer_guard
    del answers["variants"][pr.SHARED_WEIGHT_KEY]
    assert rel.from_probe(here, answers).shared_initializer_guard
    answers["prepacked"] = {"saved": True, "reload": "differs"}
    assert not rel.from_probe(here, answers).prepacked_save
    assert rel.from_probe(here, {**answers, "borrows_memory_buffers": True}).borrows_memory_buffers


def test_block_bound_from_the_sweep():
    sweep = {f"block:{b}": {"fused": b <= 256, "ortmem": "equal"} for b in pr.BLOCK_SWEEP}
    assert rel.probed_block_max(sweep) == (256, 256)
    sweep = {f"block:{b}": {"fused": True, "ortmem": "equal" if b <= 256 else "differs"} for b in pr.BLOCK_SWEEP}
    assert rel.probed_block_max(sweep) == (rel.UNBOUNDED, 256)
    # 1.28: the rule fuses 512 into a kernel that refuses it; ORT's own session fails: not convertible
    sweep = {f"block:{b}": {"fused": True, "ortmem": "equal"} for b in pr.BLOCK_SWEEP}
    sweep["block:512"]["reference_error"] = "Only block sizes 16, 32, 64, 128, and 256 are supported"
    assert rel.probed_block_max(sweep)[1] == 256


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
    assert sum("older than ortmem's range" in str(w.message) for w in seen) == 1
    for s in (s1, s2):
        assert not s.ortmem_cache_hit
        assert s.ortmem_report is None or not s.ortmem_report.converted
    expected = run_plain(path, FEEDS)[0]
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
    assert f"onnxruntime {ort.__version__}" in out and "converts: " in out and "allocator hygiene" in out
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["capabilities"]["onnxruntime"] == ort.__version__ and data["cache"]["usable"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "supported 1.25 on" in capsys.readouterr().out


_START_COUNTING_SCANS = r"""
import sys, onnxruntime as ort
import ortmem
from ortmem.ort import release
scans = []
real = release.scan_config_keys
release.scan_config_keys = lambda files: scans.append(1) or real(files)
options = ort.SessionOptions() if sys.argv[2] == "options" else None
session = ortmem.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
print(session.ortmem_action, len(scans))
"""


def test_ortmem_prepare_reads_the_config_keys_so_that_serving_starts_do_not(tmp_path):
    """This build's session config keys are scanned from ORT's library (about a quarter of a second):
    ``ortmem prepare`` does it at deploy time and keeps them with the probe's answers. A start whose
    caller passes no SessionOptions needs none (the caller set nothing); one that passes them reads the
    kept keys. Fresh processes, a probe folder of their own holding only the probe's answers."""
    import shutil
    import subprocess
    import sys

    from tests.support.builders import matmul_chain, save

    rel.capabilities()  # the probe's answers exist in the shared probe folder
    here = rel.installed()
    probes = tmp_path / "probes"
    probes.mkdir(mode=0o700)
    shutil.copy2(rel.probe_dir() / f"{here.key()}.json", probes)
    keys_file = probes / f"{here.key()}{rel.CONFIG_KEYS_SUFFIX}"
    model = save(matmul_chain(np.random.default_rng(11), [64, 512, 512, 8]), tmp_path / "m" / "chain.onnx")
    env = {**os.environ, rel.PROBE_DIR_ENV: str(probes), "ORTMEM_CACHE_DIR": str(tmp_path / "cache")}

    def start(options: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", _START_COUNTING_SCANS, str(model), options], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert start("none")[1] == "0" and not keys_file.exists()
    done = subprocess.run([sys.executable, "-m", "ortmem", "prepare", str(model)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert keys_file.exists()
    action, scans = start("options")
    assert scans == "0" and action in ("finished", "mapped", "as-is")
    assert np.array_equal(
        ortmem.InferenceSession(str(model), ort.SessionOptions(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.ones((4, 64), np.float32)})[0],
        run_plain(model, {"x": np.ones((4, 64), np.float32)})[0])
