"""``verify="sampled"`` checks what docs/cache-security.md says: the first and last page of every weight span,
of a prepared entry's data file too (each initializer, each pre-packed blob), not only its size."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import ortmem
from ortmem.onnxfile import scan
from ortmem.cli import main as cli_main
from ortmem.onnxfile.walk import external_data_dict
from ortmem.ort.release import capabilities
from ortmem.store import finisher
from ortmem.files.digest import sampled_digest
from tests.support.builders import biased_chain, save
from tests.support.reference import run_plain

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")

CPU = ["CPUExecutionProvider"]
WIDTH = 512
PAGE = 4096


def _span(entry: Path, name: str) -> tuple[int, int]:
    """(offset, length) of initializer ``name`` in the prepared entry's ``model.data``."""
    saved = onnx.load(str(entry / "model.onnx"), load_external_data=False)
    (ext,) = [external_data_dict(t) for t in saved.graph.initializer if t.name == name]
    return int(ext["offset"]), int(ext["length"])


def _flip(path: Path, offset: int) -> None:
    """One byte changed in place; the file keeps its size and its atime/mtime."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("where", ["a bias's first page", "a weight's last page"])
def test_sampled_verification_finds_a_flipped_byte_in_a_prepared_entry(where, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    model = save(biased_chain(np.random.default_rng(0), [WIDTH] * 4), tmp_path / "m.onnx", external=True)
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(model), "--cache", str(cache)]) == 0
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    feeds = {"x": np.random.default_rng(7).standard_normal((2, WIDTH)).astype(np.float32)}
    expected = run_plain(model, feeds)[0]
    assert ortmem.InferenceSession(model, providers=CPU, cache=cache, verify="sampled").ortmem_action == "finished"
    offset, length = _span(entry, "b1" if where.startswith("a bias") else "W1")
    _flip(entry / "model.data", offset + 5 if where.startswith("a bias") else offset + length - 7)
    if where.startswith("a bias"):  # ORT maps the damaged bias as it is: a silently wrong output
        assert not np.array_equal(run_plain(entry / "model.onnx", feeds)[0], expected)

    s = ortmem.InferenceSession(model, providers=CPU, cache=cache, verify="sampled")

    assert s.ortmem_action != "finished"
    assert caplog.text.count("sampled digest") == 1 and "model.data" in caplog.text
    assert np.array_equal(s.run(None, feeds)[0], expected)
    assert finisher.wait_background(120)
    rebuilt = ortmem.InferenceSession(model, providers=CPU, cache=cache, verify="sampled")  # built after that run
    assert rebuilt.ortmem_action == "finished" and np.array_equal(rebuilt.run(None, feeds)[0], expected)


def test_sampled_verification_reads_small_files_whole(tmp_path, monkeypatch):
    """The prepared model's own manifest, which records the samples, is digested in full: a damaged data
    file whose recorded sample digest was made to match is still found."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    model = save(biased_chain(np.random.default_rng(0), [WIDTH] * 4), tmp_path / "m.onnx", external=True)
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(model), "--cache", str(cache)]) == 0
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    offset, _ = _span(entry, "b1")
    _flip(entry / "model.data", offset + 5)
    manifest = json.loads((entry / "model.json").read_bytes())
    manifest["spot_digest"] = sampled_digest(entry / "model.data", [tuple(s) for s in manifest["spot_spans"]])
    st = (entry / "model.json").stat()
    (entry / "model.json").write_bytes(json.dumps(manifest, indent=1).encode())  # as the writer formats it
    assert (entry / "model.json").stat().st_size == st.st_size
    os.utime(entry / "model.json", ns=(st.st_atime_ns, st.st_mtime_ns))

    s = ortmem.InferenceSession(model, providers=CPU, cache=cache, verify="sampled")

    assert s.ortmem_action != "finished"
    feeds = {"x": np.random.default_rng(7).standard_normal((2, WIDTH)).astype(np.float32)}
    assert np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])
    finisher.wait_background(120)
