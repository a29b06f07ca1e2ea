"""A warm start reads each cache file in full once per boot, and again whenever the file changes.

Real entries of a real model, real sessions: outputs are compared with plain ORT's on the source
model. What a stamp may skip is counted on :func:`ortmem.files.digest.file_digest`, the one reader of
every byte.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

import ortmem
from ortmem.files import digest, stamps
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.compare import assert_same_outputs
from tests.support.reference import run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


@pytest.fixture
def stamp_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "verified"
    monkeypatch.setenv(stamps.FOLDER_ENV, str(folder))
    monkeypatch.setattr(stamps, "RACY_SECONDS", 0.0)  # the files below are seconds old, not minutes
    return folder


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The names of the files read in full, in order."""
    seen: list[str] = []
    real = digest.file_digest

    def counting(path, algorithm=None):
        seen.append(Path(path).name)
        return real(path, algorithm)

    monkeypatch.setattr(digest, "file_digest", counting)
    return seen


@pytest.fixture
def model(tmp_path) -> Path:
    return write_model(SynthConfig(storage="external"), tmp_path / "model.onnx")


def _session(model: Path, tmp_path: Path, verify: str = "full") -> ortmem.InferenceSession:
    return ortmem.InferenceSession(str(model), providers=["CPUExecutionProvider"], cache=tmp_path / "cache",
                                   prepacked=False, verify=verify)


def test_a_file_found_whole_is_not_read_again_until_it_changes(tmp_path, stamp_dir, reads, model):
    cold = _session(model, tmp_path)
    assert cold.ortmem_action == "converted"
    weights = Path(cold.ortmem_handoff.model).parent / "weights.bin"
    first = _session(model, tmp_path)
    assert first.ortmem_action == "cache-hit" and "weights.bin" in reads
    reads.clear()
    second = _session(model, tmp_path)
    assert second.ortmem_action == "cache-hit" and "weights.bin" not in reads
    assert_same_outputs(second.run(None, FEEDS), run_plain(model, FEEDS))

    with open(weights, "r+b") as f:  # damage, with the size unchanged: ctime moves, the stamp no longer names it
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0x5A]))
    reads.clear()
    third = _session(model, tmp_path)
    assert "weights.bin" in reads
    assert third.ortmem_action == "converted"  # found damaged, discarded, rebuilt
    assert_same_outputs(third.run(None, FEEDS), run_plain(model, FEEDS))


def test_an_edit_in_place_with_its_times_set_back_is_read_again(tmp_path, stamp_dir, reads, model):
    """Size, inode, atime and mtime can all be kept by whoever edits a file; its ctime cannot: the stamp
    must name it, or a damaged weights.bin would be served unread (a silently wrong output)."""
    cold = _session(model, tmp_path)
    weights = Path(cold.ortmem_handoff.model).parent / "weights.bin"
    _session(model, tmp_path)  # read in full, stamped
    reads.clear()
    assert _session(model, tmp_path).ortmem_action == "cache-hit" and "weights.bin" not in reads
    before = os.stat(weights)
    with open(weights, "r+b") as f:
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0x5A]))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(weights)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    reads.clear()

    again = _session(model, tmp_path)

    assert "weights.bin" in reads
    assert again.ortmem_action == "converted"  # found damaged, discarded, rebuilt
    assert_same_outputs(again.run(None, FEEDS), run_plain(model, FEEDS))


def test_always_reads_every_byte_on_every_start(tmp_path, stamp_dir, reads, model):
    _session(model, tmp_path)
    _session(model, tmp_path)
    reads.clear()
    again = _session(model, tmp_path, verify="always")
    assert again.ortmem_action == "cache-hit" and "weights.bin" in reads


def test_a_file_written_just_now_is_not_stamped(tmp_path, stamp_dir, monkeypatch):
    monkeypatch.setattr(stamps, "RACY_SECONDS", 3600.0)
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 16))
    recorded = digest.file_digest(f)
    assert digest.matches(f, recorded)
    assert list(stamp_dir.iterdir()) == []  # a second write within the tick would not show in stat


def test_a_stamp_folder_others_may_write_is_not_used(tmp_path, stamp_dir, reads):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 16))
    recorded = digest.file_digest(f)
    assert digest.matches(f, recorded) and len(list(stamp_dir.iterdir())) == 1
    os.chmod(stamp_dir, 0o777)
    try:
        assert stamps.folder() is None
        reads.clear()
        assert digest.matches(f, recorded) and reads == ["w.bin"]
    finally:
        os.chmod(stamp_dir, stat.S_IRWXU)


def test_a_stamp_names_the_recorded_digest(tmp_path, stamp_dir):
    """A stamp vouches for one recorded digest only: the same bytes checked against another record are
    read and judged again (an entry rebuilt with other contents is never taken for the old one)."""
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 16))
    recorded = digest.file_digest(f)
    assert digest.matches(f, recorded)
    other = recorded[:-1] + ("0" if recorded[-1] != "0" else "1")
    assert not digest.matches(f, other)
