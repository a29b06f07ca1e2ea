"""Disk the cache uses (ortmem.files.layout.disk_use), as ``ortmem cache list`` and ``ortmem doctor`` print it.

A converted entry hard-links the source files it leaves unchanged: their bytes are the user's model
files, on disk before the entry, and a second entry of the same model links the same inode again. The
sizes count each inode once and say how much of it is shared with the user's files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ortmem
from ortmem.cli import main
from ortmem.store.cache import Cache
from ortmem.files.layout import SOURCE_LINK_PREFIX, DiskUse, disk_use
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.reference import CPU


def _write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def test_a_hard_link_counts_once_and_is_shared_only_while_linked_from_outside(tmp_path: Path) -> None:
    user = _write(tmp_path / "models" / "w.data", 300_000)
    a, b = tmp_path / "cache" / "a", tmp_path / "cache" / "b"
    _write(a / "weights.bin", 70_000)
    _write(b / "weights.bin", 5_000)
    os.link(user, a / "source-0.data")
    os.link(user, b / "source-0.data")
    os.symlink(user, b / "not-counted")  # a symbolic link is no file of the entry
    total, each = disk_use([a, b])
    assert each[a] == DiskUse(370_000, 300_000) and each[b] == DiskUse(305_000, 300_000)
    assert total == DiskUse(375_000, 300_000)  # the shared source once, not twice
    user.unlink()  # only the cache holds it now: counted once, and no longer the user's
    total, each = disk_use([a, b])
    assert total == DiskUse(375_000, 0) and each[a] == DiskUse(370_000, 0)
    assert DiskUse(375_000 * 2**10, 300_000 * 2**10).text() == "366.2 MiB, 293.0 MiB of it shared with your model files"
    assert DiskUse(2**20).text() == "1.0 MiB"


@pytest.fixture
def linked_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, int, int]:
    """A converted entry of a QDQ model with external data, in the default cache folder: (source data
    file, the entry's bytes, the bytes of its hard-linked sources)."""
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "root"))
    (tmp_path / "m").mkdir()
    model = write_model(SynthConfig.tiny(storage="external"), tmp_path / "m" / "qdq.onnx")
    assert ortmem.InferenceSession(model, providers=CPU).ortmem_action == "converted"
    (entry,) = Cache().entries()
    linked = [f for f in entry.path.iterdir() if f.name.startswith(SOURCE_LINK_PREFIX)]
    assert linked and all(os.path.samefile(f, tmp_path / "m" / "qdq.onnx.data") for f in linked)
    files = [f for f in entry.path.iterdir() if f.is_file()]
    return tmp_path / "m" / "qdq.onnx.data", sum(f.stat().st_size for f in files), linked[0].stat().st_size


def test_cache_list_says_what_is_shared_with_the_model_files(linked_entry, capsys) -> None:
    _, size, shared = linked_entry
    assert main(["cache", "list"]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    phrase = f"{size / 2**20:.1f} MiB, {shared / 2**20:.1f} MiB of it shared with your model files"
    assert header.endswith(f"1 entry, {phrase}")
    assert f"{size / 2**20:9.1f} MiB" in row and row.endswith(f"({shared / 2**20:.1f} MiB of it shared with your model files)")


def test_doctor_counts_a_linked_source_once_and_says_it_is_shared(linked_entry, capsys) -> None:
    source, size, shared = linked_entry
    assert main(["doctor", "--json"]) == 0
    cache = json.loads(capsys.readouterr().out)["cache"]
    assert (cache["entries"], cache["bytes"], cache["shared_bytes"]) == (1, size, shared)
    assert main(["doctor"]) == 0
    assert f"1 entries, {size / 2**20:.1f} MiB, {shared / 2**20:.1f} MiB of it shared" in capsys.readouterr().out
    source.unlink()  # the user removed the model: the entry's link is the last, nothing is shared
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"]["shared_bytes"] == 0
