"""Converted entries finished by ORT: after a cold start's first run the background job saves ORT's
finished model of the converted entry (:func:`ortmem.store.finished_entries.finish_converted`), and later
starts load it with graph optimizations off, mapping ORT's pre-packed weights.

Every start gives plain ORT's outputs on the QDQ source; the finished model is used only on the CPU EP
with pre-packing on; a finished model ORT refuses falls back to the entry and is removed; a damaged
one is refused and finished again; the caller's options read back unchanged.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.onnxfile import scan
from ortmem.ort.release import capabilities
from ortmem.files import layout
from ortmem.store import finisher
from ortmem.ort.settings import OrtSettings
from ortmem.store.finished import finished_problem
from ortmem.store.finished_entries import finished_stem, finished_stems, finishing_settings
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.reference import CPU, run_plain

SAVES = capabilities().prepacked_save
needs_saving = pytest.mark.skipif(not SAVES, reason=f"onnxruntime {ort.__version__} saves no pre-packed weights")
FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
#: The finished model a default session's first run leaves in its entry (one per settings).
STEM = finished_stem(finishing_settings(OrtSettings(), {}))
FINISHED = f"{STEM}.onnx"


@pytest.fixture
def qdq(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny QDQ decoder; every entry is finished, whatever its size (children inherit the variable)."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    path = tmp_path / "q" / "model.onnx"
    path.parent.mkdir()
    return write_model(SynthConfig.tiny(storage="external"), path)


def _ran(session: ortmem.InferenceSession) -> np.ndarray:
    """The session's output; its first run's background job is waited for."""
    out = session.run(None, FEEDS)[0]
    assert finisher.wait_background(120)
    return out


@needs_saving
def test_the_start_after_a_first_run_loads_ort_s_finished_model(qdq: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)[0]
    so = ort.SessionOptions()
    cold = ortmem.InferenceSession(qdq, so, providers=CPU, cache=cache)
    entry = Path(cold.ortmem_handoff.model).parent
    assert cold.ortmem_action == "converted" and not finished_stems(entry)  # the cold start pays nothing
    assert np.array_equal(_ran(cold), expected)
    assert finished_problem(entry, STEM) is None
    stamp = (entry / f"{STEM}.data").stat().st_mtime_ns
    for _ in range(2):
        warm = ortmem.InferenceSession(qdq, so, providers=CPU, cache=cache)
        assert warm.ortmem_action == "finished" and warm.ortmem_cache_hit
        assert Path(warm.ortmem_handoff.model) == entry / FINISHED and warm.ortmem_handoff.later is None
        assert np.array_equal(_ran(warm), expected)
    assert (entry / f"{STEM}.data").stat().st_mtime_ns == stamp  # loaded, not made again
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # the caller's, unchanged


@needs_saving
def test_a_finished_model_is_kept_per_settings(qdq: Path, tmp_path: Path) -> None:
    """Two callers whose config entries differ share one converted entry: each one's first run finishes it
    at its own settings, both finished models are kept side by side (neither replaces the other), each
    later start loads its own, and every output is plain ORT's under that caller's options."""
    cache = tmp_path / "cache"
    plain = ort.SessionOptions()
    other = ort.SessionOptions()
    other.add_session_config_entry("session.intra_op.allow_spinning", "0")
    expected = {id(so): run_plain(qdq, FEEDS, so)[0] for so in (plain, other)}
    first = ortmem.InferenceSession(qdq, plain, providers=CPU, cache=cache)
    entry = Path(first.ortmem_handoff.model).parent
    assert np.array_equal(_ran(first), expected[id(plain)])
    hit = ortmem.InferenceSession(qdq, other, providers=CPU, cache=cache)  # the same entry, not finished for it
    assert hit.ortmem_action == "cache-hit" and hit.ortmem_handoff.later is not None
    assert Path(hit.ortmem_handoff.model).parent == entry
    assert np.array_equal(_ran(hit), expected[id(other)])
    stems = [stem for stem in finished_stems(entry) if (entry / f"{stem}.onnx").exists()]
    assert len(stems) == 2 and STEM in stems, stems  # both kept
    loaded = set()
    for _ in range(2):
        for so in (plain, other):
            warm = ortmem.InferenceSession(qdq, so, providers=CPU, cache=cache)
            assert warm.ortmem_action == "finished" and warm.ortmem_handoff.later is None
            assert np.array_equal(_ran(warm), expected[id(so)])
            loaded.add((id(so), Path(warm.ortmem_handoff.model).name))
    assert loaded == {(id(plain), FINISHED), (id(other), f"{next(s for s in stems if s != STEM)}.onnx")}
    for stem in stems:
        assert finished_problem(entry, stem) is None


def test_finished_only_for_cpu_with_prepacking_on(qdq: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    _ran(ortmem.InferenceSession(qdq, so, providers=CPU, cache=cache))  # a cold start for these options (another key)
    warm = ortmem.InferenceSession(qdq, so, providers=CPU, cache=cache)
    assert warm.ortmem_cache_hit and Path(warm.ortmem_handoff.model).name == layout.MODEL_FILE
    assert warm.ortmem_handoff.later is None
    assert not finished_stems(Path(warm.ortmem_handoff.model).parent)
    _ran(ortmem.InferenceSession(qdq, providers=CPU, cache=cache, prepacked=False))
    opted_out = ortmem.InferenceSession(qdq, providers=CPU, cache=cache, prepacked=False)
    assert opted_out.ortmem_cache_hit and Path(opted_out.ortmem_handoff.model).name == layout.MODEL_FILE
    assert not finished_stems(Path(opted_out.ortmem_handoff.model).parent)


@needs_saving
def test_a_finished_model_ort_refuses_falls_back_to_the_entry(qdq: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    from ortmem.store import hit

    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)[0]
    _ran(ortmem.InferenceSession(qdq, providers=CPU, cache=cache))
    entry = next(p for p in cache.iterdir() if (p / FINISHED).exists())
    m = onnx.load(str(entry / FINISHED), load_external_data=False)
    for t in m.graph.initializer:  # a tensor past the end of its file: ORT fails session creation
        for e in t.external_data:
            if e.key == "offset":
                e.value = str(1 << 40)
    onnx.save_model(m, str(entry / FINISHED))  # the check is bypassed below
    monkeypatch.setattr(hit, "converted_finished", lambda cache, entry, settings: (entry.path / FINISHED, True))
    s = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    assert "could not load the finished model" in caplog.text
    assert s.ortmem_action == "cache-hit" and s.ortmem_cache_hit
    assert Path(s.ortmem_handoff.model).name == layout.MODEL_FILE and not (entry / FINISHED).exists()
    assert np.array_equal(s.run(None, FEEDS)[0], expected)


@needs_saving
def test_cache_list_marks_finished_entries(qdq: Path, tmp_path: Path, capsys) -> None:
    from ortmem.cli import main

    cache = tmp_path / "cache"
    cold = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    assert main(["cache", "list", "--cache", str(cache)]) == 0
    assert "finished model" not in capsys.readouterr().out
    _ran(cold)
    assert main(["cache", "list", "--cache", str(cache)]) == 0
    assert "(+ onnxruntime's finished model)" in capsys.readouterr().out


# ---- a larger model: the memory a finished warm start saves, measured in fresh processes ----

#: ~50 MiB of converted weights (int4 codes + fp32 scales): above the default finishing threshold.
BIG_QDQ = SynthConfig(hidden=1024, intermediate=2816, layers=6, vocab=4000, heads=8, storage="external", name="big")

_START = r"""
import json, sys
import numpy as np
import ortmem
from ortmem.store import finisher
from ortmem.base import procfs
s = ortmem.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"], cache=sys.argv[2])
created = procfs.read_status("self")
out = s.run(None, {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)})[0]
print(json.dumps({"action": s.ortmem_action, "anon": created["RssAnon"], "finisher": len(finisher.started_finishers()),
                  "waited": finisher.wait_background(300), "out": out.tolist()}))
"""


def _start(model: Path, cache: Path) -> dict:
    """One start in a fresh process: what ortmem did, private memory after creation, the output."""
    r = subprocess.run([sys.executable, "-c", _START, str(model), str(cache)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_qdq(tmp_path_factory) -> Path:
    return write_model(BIG_QDQ, tmp_path_factory.mktemp("big") / "model.onnx")


def test_the_second_start_is_warm(big_qdq: Path, tmp_path: Path) -> None:
    """Start 1 converts and, after its first run, leaves one background job that finishes the entry;
    start 2 loads ORT's finished model ("finished") with far less private memory after creation. Where
    ORT saves no pre-packed weights (1.25) start 2 is a plain hit on the entry and no job is started."""
    cache = tmp_path / "cache"
    expected = ort.InferenceSession(str(big_qdq), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    first = _start(big_qdq, cache)
    entry = next(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert (entry / layout.WEIGHTS_FILE).stat().st_size >= scan.MIN_FINISHED_BYTES
    assert first["action"] == "converted" and first["waited"]
    assert first["finisher"] == (1 if SAVES else 0)
    assert (entry / FINISHED).exists() == SAVES
    second = _start(big_qdq, cache)
    assert second["finisher"] == 0
    assert second["action"] == ("finished" if SAVES else "cache-hit")
    for s in (first, second):
        assert np.array_equal(np.array(s["out"], dtype=expected.dtype), expected)
    if SAVES:  # ORT's packed B (~1.5x the 38 MiB of int4 codes at accuracy 4) is mapped, not on the heap
        assert second["anon"] < first["anon"] - 24 * 2**20, (first["anon"] >> 20, second["anon"] >> 20)
    assert not any(p.name.startswith((".tmp-", ".lock-")) for p in cache.iterdir())
    assert not any(p.name.startswith(".") for p in entry.iterdir())


# ---- a full disk: survived, recorded in the entry, not retried on every start ----

_FULL_DISK_CHILD = r"""
import json, logging, os, sys
from pathlib import Path
import numpy as np
import onnxruntime as ort
import ortmem
from ortmem.store import finisher
from ortmem.store.finished_entries import NO_SPACE_RECORD
from ortmem.measure.synth import SynthConfig, write_model

mnt = Path(sys.argv[1])
messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("ortmem").addHandler(Keep())
logging.getLogger("ortmem").setLevel(logging.WARNING)
feeds = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
(mnt / "m").mkdir()
model = write_model(SynthConfig.tiny(storage="external"), mnt / "m" / "model.onnx")
want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)
filler = mnt / "filler"
starts = []
for i in range(4):
    messages.clear()
    if i == 2:
        filler.unlink()
    s = ortmem.InferenceSession(model, providers=["CPUExecutionProvider"], cache=mnt / "c")
    entry = Path(s.ortmem_handoff.fallback or s.ortmem_handoff.model).parent
    if i == 0:  # the entry fits; ORT's finished model of it will not
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        filler.write_bytes(b"\0" * (free - (256 << 10)))
    job = s.ortmem_handoff.later is not None
    got = s.run(None, feeds)
    waited = finisher.wait_background(120)
    starts.append({"action": s.ortmem_action, "hit": s.ortmem_cache_hit, "entry": str(entry), "job": job,
                   "waited": waited, "same": all(np.array_equal(a, b) for a, b in zip(got, want)),
                   "log": list(messages),
                   "record": NO_SPACE_RECORD in json.loads((entry / "manifest.json").read_text())})
print(json.dumps(starts))
"""


def _in_small_filesystem(code: str, size: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``code`` with a fresh tmpfs of ``size`` mounted at its first argument, in a private mount
    namespace (nothing stays mounted, whatever happens); skips where no namespace can be made."""
    import os
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) not installed: no small filesystem to fill")
    mnt = tmp_path / "small"
    mnt.mkdir()
    namespace = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])  # root may mount
    cmd = [*namespace, "sh", "-c", 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"',
           "sh", size, str(mnt), sys.executable, "-c", code, str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    if r.returncode != 0 and ("unshare" in r.stderr.split(":")[0] or "mount" in r.stderr.split(":")[0]):
        pytest.skip(f"cannot mount a small filesystem here: {r.stderr.strip()[:200]}")
    return r


@needs_saving
def test_a_disk_too_full_for_the_finished_model_is_recorded_and_not_retried_each_start(tmp_path: Path, qdq) -> None:
    """The converted entry fits on the disk but ORT's finished model of it does not: the background job
    records the full disk in the entry, the next start loads the converted entry ("cache-hit"), says why
    once and leaves no job; once space is freed the next first run finishes it and the start after
    that is warm. Every start gives plain ORT's outputs."""
    r = _in_small_filesystem(_FULL_DISK_CHILD, "4m", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    cold, full, freed, warm = json.loads(r.stdout.strip().splitlines()[-1])
    for start in (cold, full, freed, warm):
        assert start["same"] and start["waited"], start
    assert cold["action"] == "converted" and cold["job"] and cold["record"], cold  # the job found the disk full
    assert full["action"] == "cache-hit" and full["hit"] and not full["job"] and full["record"], full
    assert len(full["log"]) == 1 and f"no space left on device in {full['entry']}" in full["log"][0], full
    assert "not tried again until more than" in full["log"][0]
    assert freed["action"] == "cache-hit" and freed["job"] and not freed["record"] and not freed["log"], freed
    assert warm["action"] == "finished" and warm["hit"] and not warm["job"], warm
