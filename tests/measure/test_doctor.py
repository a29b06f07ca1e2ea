"""``ortmem doctor``: a summary a user reads first (release, what is converted, cache, health), every
variant only with ``--verbose``, and everything in ``--json``."""
from __future__ import annotations

import json
import os
from pathlib import Path

import onnxruntime as ort
import pytest

from ortmem.cli import main
from ortmem.ort import release as rel

#: What ``--json`` has always held; the summary changes the text only.
JSON_KEYS = {"ortmem", "python", "platform", "onnxruntime", "capabilities", "table", "cache", "allocator_hygiene"}


def _doctor(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["doctor", *args]) == 0
    return capsys.readouterr().out


def test_summary_first_and_variants_only_when_verbose(capsys: pytest.CaptureFixture) -> None:
    caps = rel.capabilities()
    variants = [k for table in (caps.matmul, caps.gather) for k in table]
    assert len(variants) > 40
    data = json.loads(_doctor(capsys, "--json"))
    assert set(data) == JSON_KEYS
    assert set(data["capabilities"]["matmul"]) | set(data["capabilities"]["gather"]) == set(variants)

    short = _doctor(capsys).splitlines()
    assert len(short) <= 10
    status = "in the tested range" if rel.installed().facts() is not None else "supported but untested"
    assert short[0].startswith(f"onnxruntime {ort.__version__} ") and status in short[0]
    assert short[1].startswith("converts: ") and "MatMulNBits" in short[1] and "GatherBlockQuantized" in short[1]
    ok = sum(v.ok for v in caps.matmul.values())
    assert (f"(all {ok} variants)" if ok == len(caps.matmul) else f"({ok} of {len(caps.matmul)} variants)") in short[1]
    cache = next(line for line in short if line.startswith("cache "))
    assert cache == f"cache {data['cache']['path']}: 0 entries, 0.0 MiB"
    left = sum(not v.ok for table in (caps.matmul, caps.gather) for v in table.values())
    if not left and not caps.notes:
        assert "health: no problems found" in short
    if left:  # this release's refusals are a health problem, named by count with the way to see them
        assert any(f"{left} variant(s) left to ORT" in line for line in short), short
    assert not any(key in line for line in short for key in variants)

    full = _doctor(capsys, "--verbose").splitlines()
    assert full[:len(short) - 1] == short[:-1]  # the same summary, then the details
    for key in variants:  # one line each, with the probe's word and the table's
        (line,) = [x for x in full if x.split()[:1] == [key]]
        assert line.split()[1] == ("convert" if (caps.matmul | caps.gather)[key].ok else "leave")
    assert any(line.startswith("build ") for line in full) and "variants left to ORT: " in "\n".join(full)


def test_an_untrusted_cache_folder_is_a_health_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "shared-cache"
    folder.mkdir()
    os.chmod(folder, 0o777)  # anyone may write it, no sticky bit: the cache refuses it
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(folder))
    out = _doctor(capsys)
    assert f"cache {folder}: NOT USABLE" in out
    health = out.splitlines().index(next(line for line in out.splitlines() if line.startswith("health: ")))
    problem = out.splitlines()[health + 1]
    assert problem.startswith("  - cache: ") and "sticky bit" in problem and str(folder) in problem
    data = json.loads(_doctor(capsys, "--json"))
    assert data["cache"]["usable"] is False and "sticky bit" in data["cache"]["problem"]
