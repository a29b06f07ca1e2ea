"""ortmem.session.genai: onnxruntime-genai folders whose ONNX files ORT maps pre-packed. Real genai models over
a hand-written decoder with genai's inputs and outputs (no torch here for genai's builder; genai needs
no tokenizer to generate from token ids), real generation, real processes for memory."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import onnx
import pytest


from ortmem.session import genai
from ortmem.base.procfs import read_smaps_rollup
from tests.support.genai_folder import MAX_LENGTH, build_genai_folder
from tests.support.genai_run import Generation, assert_same_generation, generate as run_generation

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")

PROMPT = [5, 6, 7, 8, 9]


def generate(config) -> Generation:
    """Greedy generation from ``PROMPT``: the tokens and every step's logits."""
    return run_generation(config, PROMPT, MAX_LENGTH)


def mapped_files() -> set[str]:
    return {Path(line.split(None, 5)[5]).name for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(None, 5)) == 6}


def _assert_same(a: Generation, b: Generation) -> None:
    assert_same_generation(a, b, MAX_LENGTH - len(PROMPT))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """One small prepared folder the tests copy (preparing costs a throw-away ORT session)."""
    folder = build_genai_folder(tmp_path_factory.mktemp("genai") / "tiny")
    genai.prepare_genai_folder(folder)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    """A copy to damage or rewrite. The prepared files record their source's path, so a copy must be
    prepared again: the copy's own preparation is what is tested."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name in ("model.onnx", "model.onnx.data", genai.GENAI_CONFIG):
            (dst / f.name).write_bytes(f.read_bytes())
    genai.prepare_genai_folder(dst)
    return dst


# ------------------------------------------------------------------------------------------ tests
def test_genai_runs_the_onnxruntime_package_library():
    """genai 0.18 loads onnxruntime's own libonnxruntime.so (the release that wrote the files)."""
    assert genai.genai_ort_problem() is None
    assert any(name.startswith("libonnxruntime.so") for name in mapped_files())


def test_prepare_writes_inside_the_folder(prepared: Path):
    names = {p.name for p in prepared.iterdir()}
    assert {"model.ortmem-prepared.onnx", "model.ortmem-prepared.data", "model.ortmem-prepared.json"} <= names
    assert json.loads((prepared / genai.GENAI_CONFIG).read_text())["model"]["decoder"]["filename"] == "model.onnx"
    saved = onnx.load(str(prepared / "model.ortmem-prepared.onnx"), load_external_data=False)
    packed = {t.name for t in saved.graph.initializer if any(e.key.startswith("prepacked") for e in t.external_data)}
    assert {"l0.wk", "l0.w1", "l1.w2", "lm_head"} <= packed  # every MatMul weight, as ORT chose


def test_prepared_folder_generates_the_same_tokens_and_logits(prepared: Path, caplog):
    plain = generate(og.Config(str(prepared)))
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        config = genai.genai_config(prepared)
    assert not caplog.records
    out = generate(config)
    _assert_same(plain, out)
    assert len(set(plain[0][len(PROMPT):])) > 1  # the comparison is not between two constant streams


def test_genai_loads_the_prepared_file(prepared: Path):
    """genai_model's (so genai_config's) model really maps the prepared data (checked in a fresh
    process: this one may have mapped it in another test)."""
    code = ("import sys; from pathlib import Path; from ortmem.session.genai import genai_model\n"
            "m = genai_model(Path(sys.argv[1]))\n"
            "print(any(l.endswith('/model.ortmem-prepared.data') for l in open('/proc/self/maps').read().splitlines()))")
    out = subprocess.run([sys.executable, "-c", code, str(prepared)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_damaged_prepared_data_falls_back_with_one_warning(prepared: Path, tmp_path: Path, caplog):
    """A flipped bit in an ordinary weight of the prepared data (the embedding row of the prompt's first
    token: ORT compares only pre-packed blobs) would change the tokens; the full check catches it."""
    folder = _copy(prepared, tmp_path / "damaged")
    plain = generate(og.Config(str(folder)))
    saved = onnx.load(str(folder / "model.ortmem-prepared.onnx"), load_external_data=False)
    embed = next(t for t in saved.graph.initializer if t.name == "embed")
    at = int({e.key: e.value for e in embed.external_data}["offset"]) + PROMPT[0] * embed.dims[1] * 4 + 3
    with open(folder / "model.ortmem-prepared.data", "r+b") as f:  # the exponent byte of a float32
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    damaged = generate(genai.genai_config(folder, mode="off"))  # sizes only: the damage is used
    assert damaged[0] != plain[0] or any((a != b).any() for a, b in zip(damaged[1], plain[1]))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        config = genai.genai_config(folder)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "model.ortmem-prepared.onnx not used" in warnings[0].getMessage()
    _assert_same(plain, generate(config))


def test_unprepared_folder_loads_as_given_with_one_warning(tmp_path: Path, caplog):
    folder = build_genai_folder(tmp_path / "plain")
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        config = genai.genai_config(folder)
    assert len(caplog.records) == 1 and "not prepared" in caplog.records[0].getMessage()
    _assert_same(generate(og.Config(str(folder))), generate(config))


def test_rewrite_config_for_other_languages_and_restore(prepared: Path, tmp_path: Path, caplog):
    folder = _copy(prepared, tmp_path / "rewritten")
    original = (folder / genai.GENAI_CONFIG).read_bytes()
    plain = generate(og.Config(str(folder)))
    assert genai.rewrite_config(folder) == ["model.onnx"]
    assert (folder / genai.CONFIG_BACKUP).read_bytes() == original
    assert json.loads((folder / genai.GENAI_CONFIG).read_text())["model"]["decoder"]["filename"] == \
        "model.ortmem-prepared.onnx"
    _assert_same(plain, generate(og.Config(str(folder))))  # genai alone, no ortmem: what C/C#/Java get
    # genai_config still checks a rewritten folder, and re-points a failing file at its source
    (folder / "model.onnx.data").touch()  # the source "changed" (its identity moved)
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        config = genai.genai_config(folder)
    assert len(caplog.records) == 1
    _assert_same(plain, generate(config))
    assert genai.rewrite_config(folder) == []  # nothing valid now: the config names the source again
    assert json.loads((folder / genai.GENAI_CONFIG).read_text())["model"]["decoder"]["filename"] == "model.onnx"
    assert (folder / genai.CONFIG_BACKUP).read_bytes() == original  # the first backup is kept
    assert genai.restore_config(folder)
    assert (folder / genai.GENAI_CONFIG).read_bytes() == original


def test_model_files_follow_genai_sections_and_providers():
    """Which files a config makes genai run on the CPU EP (decoder, other sections, pipeline stages)."""
    config = {"model": {
        "decoder": {"filename": "model.ortmem-prepared.onnx", "session_options": {"provider_options": []},
                    "pipeline": [{"embeds": {"filename": "embeds.onnx"}},
                                 {"ctx": {"filename": "ctx.onnx", "session_options": {
                                     "provider_options": [{"qnn": {}}]}}},
                                 {"head": {"filename": "head.onnx", "run_on_cpu": True, "session_options": {
                                     "provider_options": [{"qnn": {}}]}}}]},
        "vision": {"filename": "vision.onnx", "session_options": {"provider_options": [{"cuda": {}}]}},
        "embedding": {"filename": "sub/embedding.onnx"},
        "speech": {"filename": "../speech.onnx", "config_filename": "audio_processor_config.json"}}}
    files = {f.filename: f for f in genai.model_files(config)}
    assert set(files) == {"model.ortmem-prepared.onnx", "embeds.onnx", "ctx.onnx", "head.onnx", "vision.onnx",
                          "sub/embedding.onnx", "../speech.onnx"}
    assert files["model.ortmem-prepared.onnx"].source == "model.onnx" and files["model.ortmem-prepared.onnx"].overlayable
    assert not files["embeds.onnx"].skip and not files["embeds.onnx"].overlayable
    assert files["ctx.onnx"].skip == "runs on qnn" and files["head.onnx"].skip is None
    assert files["vision.onnx"].skip == "runs on cuda"
    assert files["sub/embedding.onnx"].prepared_name == "sub/embedding.ortmem-prepared.onnx"
    assert "genai refuses" in files["../speech.onnx"].skip


def test_packing_settings_pass_through_genai_config_entries():
    config = {"model": {"decoder": {"filename": "m.onnx", "session_options": {
        "intra_op_num_threads": 3, "log_id": "x", "mlas.use_kleidiai": "0", "session.intra_op.allow_spinning": "0"}}}}
    settings, threads = genai.packing_settings(config, genai.model_files(config)[0])
    # every key this ORT build defines goes to the finishing session (genai's own options do not)
    from ortmem.ort.release import config_keys

    entries = {"mlas.use_kleidiai": "0", "session.intra_op.allow_spinning": "0"}
    assert threads == 3 and dict(settings.session_config) == {k: v for k, v in entries.items() if k in config_keys()}
    assert "session.intra_op.allow_spinning" in settings.session_config


def test_not_a_genai_folder(tmp_path: Path):
    assert not genai.is_genai_folder(tmp_path)
    with pytest.raises(genai.GenaiFolderError, match="genai_config.json"):
        genai.prepare_genai_folder(tmp_path)


# ------------------------------------------------------------------------------------------ memory
_CHILD = """
import sys
from pathlib import Path
import numpy as np
import onnxruntime_genai as og
folder, prepared = Path(sys.argv[1]), sys.argv[2] == "1"
if prepared:  # ortmem is imported (and its cost counted) only where it is used
    from ortmem.session.genai import genai_model
model = genai_model(folder) if prepared else og.Model(og.Config(str(folder)))
params = og.GeneratorParams(model)
params.set_search_options(max_length=8, do_sample=False)
gen = og.Generator(model, params)
gen.append_tokens(np.array([[5, 6, 7, 8]], dtype=np.int32))
gen.generate_next_token()
print("ready", flush=True)
sys.stdin.read()
"""


def _total_pss(folder: Path, prepared: bool, workers: int = 4) -> tuple[int, int]:
    """Total PSS of ``workers`` processes, each holding its model after a generation step, and their
    total private (anonymous) PSS."""
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(folder), "1" if prepared else "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(workers)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", "a genai worker failed"
        rollups = [read_smaps_rollup(p.pid) or {} for p in procs]
        return sum(r["Pss"] for r in rollups), sum(r["Pss_Anon"] for r in rollups)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


@pytest.mark.slow
def test_four_prepared_processes_hold_at_most_0_4x_plain_pss(tmp_path: Path):
    """The issue's target: 4 genai processes on a prepared folder hold at most 0.4x the total PSS of 4
    on the plain folder. 384 MiB of fp32 MatMul weights: each plain process packs all of them on its
    heap; prepared ones map one shared copy. Each prepared process also holds ortmem's run-time check
    and its imports (onnx, onnxruntime's module: about 23 MiB private), which plain ones do not."""
    folder = build_genai_folder(tmp_path / "big", layers=16, hidden=512, ffn=5632, heads=8, vocab=256, context=64)
    genai.prepare_genai_folder(folder)
    (plain, plain_anon), (mapped, mapped_anon) = _total_pss(folder, False), _total_pss(folder, True)
    print(f"\n4 processes, total PSS: plain {plain / 2**20:.0f} MiB, prepared {mapped / 2**20:.0f} MiB "
          f"({mapped / plain:.2f}x); private per process: plain {plain_anon / 4 / 2**20:.0f} MiB, "
          f"prepared {mapped_anon / 4 / 2**20:.0f} MiB")
    assert mapped <= 0.4 * plain
