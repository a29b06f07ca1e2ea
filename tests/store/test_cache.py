"""The cache's creator lock under hostile timing: every wait on it is bounded,
a warm start never waits for it, nothing packs while another process holds it, and one finisher runs per
entry whatever the process layout. Real ORT sessions, real lock holders in other processes (stopped
with SIGSTOP, as a starved or suspended finisher would be), real forked workers."""
from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.store.finished_entries import finished_stems
from ortmem.onnxfile import scan
from ortmem.store import finisher
from ortmem.files import layout
from ortmem.store.finished import finished_problem
from ortmem.store.cache import creator_lock_path
from ortmem.files.sources import converted_key
from ortmem.ort.release import capabilities
from ortmem.ort.settings import session_settings
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.reference import run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
CPU = ["CPUExecutionProvider"]
#: A holder still alive this long after a test started is killed, so that code which waits on it
#: without a limit fails the test (it waited this long) instead of hanging the suite.
WATCHDOG_SECONDS = 20.0

needs_saving = pytest.mark.skipif(not capabilities().prepacked_save,
                                  reason=f"onnxruntime {ort.__version__} saves no pre-packed weights")

_HOLDER = r"""
import os, signal, sys
from pathlib import Path
from ortmem.store.cache import Cache
held = Cache(Path(sys.argv[1])).creating(sys.argv[2])
held.__enter__()
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # a suspended (or starved) holder: it never lets go by itself
"""


@pytest.fixture
def hold_lock() -> Iterator[Callable[[Path, str], subprocess.Popen]]:
    """``hold_lock(cache_root, key)``: a real process that takes the creator lock of ``key`` and stops
    itself; killed (which releases the lock) after the test or after :data:`WATCHDOG_SECONDS`."""
    started: list[tuple[subprocess.Popen, threading.Timer]] = []

    def hold(root: Path, key: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), key], stdout=subprocess.PIPE, text=True)
        watchdog = threading.Timer(WATCHDOG_SECONDS, proc.kill)
        watchdog.start()
        started.append((proc, watchdog))
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc, watchdog in started:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.fixture
def model(tmp_path, monkeypatch) -> Path:
    """A small QDQ model, finished by ORT as a large one is (children inherit the variable)."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    return write_model(SynthConfig.tiny(storage="external"), tmp_path / "model.onnx")


def _release(proc: subprocess.Popen) -> None:
    """Let go of a held lock the hard way (SIGKILL), which leaves its file behind as a crash would."""
    proc.kill()
    proc.wait()


def test_a_stopped_builder_delays_a_cold_start_by_the_limit_only(model, tmp_path, hold_lock, monkeypatch, caplog):
    """Another process holds the lock of the entry a cold start would build, and is stopped: the start
    waits ``ORTMEM_LOCK_TIMEOUT`` seconds, then converts without the cache, with one warning naming the
    lock and its holder; outputs are ORT's."""
    monkeypatch.setenv("ORTMEM_LOCK_TIMEOUT", "1")
    cache = tmp_path / "cache"
    key = converted_key(model, session_settings(None), {"fp16_in_fp32": None})  # what the session's start locks
    cache.mkdir(mode=0o700)
    holder = hold_lock(cache, key)
    expected = run_plain(model, FEEDS)[0]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        s = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    waited = time.monotonic() - t0
    assert 1.0 <= waited < WATCHDOG_SECONDS / 2, waited
    assert s.ortmem_action == "converted-temporary" and not s.ortmem_cache_hit
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"pid {holder.pid}" in warnings[0] and str(creator_lock_path(cache, key)) in warnings[0]
    assert np.array_equal(s.run(None, FEEDS)[0], expected)
    assert [p.name for p in cache.iterdir()] == [creator_lock_path(cache, key).name]  # nothing built meanwhile


@needs_saving
def _finished(entry: Path) -> bool:
    """Whether the converted entry holds ORT's finished model, whole."""
    stems = [stem for stem in finished_stems(entry) if (entry / f"{stem}.onnx").exists()]
    return len(stems) == 1 and finished_problem(entry, stems[0]) is None


@needs_saving
def test_a_warm_start_never_waits_for_a_held_lock_and_finishes_nothing(model, tmp_path, hold_lock, monkeypatch):
    """A hit finds the entry's lock held (a stopped background job): it loads the entry at once, as a
    plain cache hit, and finishes nothing, and the job its first run leaves stops at the held lock. Once
    the holder is gone (killed: its lock file stays), the next first run's job finishes the entry and
    the start after it loads ORT's finished model."""
    monkeypatch.setenv("ORTMEM_LOCK_TIMEOUT", "60")  # would be seen if the warm start waited at all
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")  # the small model is finished as a large one is
    cache = tmp_path / "cache"
    expected = run_plain(model, FEEDS)[0]
    cold = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    entry = Path(cold.ortmem_handoff.model).parent
    assert cold.ortmem_action == "converted"
    holder = hold_lock(cache, entry.name)
    t0 = time.monotonic()
    warm = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert time.monotonic() - t0 < WATCHDOG_SECONDS / 4
    assert warm.ortmem_cache_hit and warm.ortmem_action == "cache-hit"
    assert np.array_equal(warm.run(None, FEEDS)[0], expected)
    assert finisher.wait_background(120)
    assert not _finished(entry)
    _release(holder)
    assert creator_lock_path(cache, entry.name).exists()
    again = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert again.ortmem_action == "cache-hit"
    assert np.array_equal(again.run(None, FEEDS)[0], expected)
    assert finisher.wait_background(120) and _finished(entry)
    finished = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert finished.ortmem_action == "finished" and finished.ortmem_cache_hit
    assert np.array_equal(finished.run(None, FEEDS)[0], expected)
    assert not creator_lock_path(cache, entry.name).exists()


def _finisher(job: finisher.FinishLater) -> subprocess.CompletedProcess:
    """The background finisher's own command, run to the end (no lock handed to it)."""
    return subprocess.run([sys.executable, "-m", "ortmem.store.finisher", job.as_json()],
                          capture_output=True, text=True, timeout=120)


@needs_saving
def test_the_finisher_never_packs_while_another_process_holds_the_lock(model, tmp_path, hold_lock):
    """Neither the finisher's starter nor the finisher process itself works on an entry whose creator lock
    another process holds; with the lock free, the same finisher process packs."""
    cache = tmp_path / "cache"
    ortmem.InferenceSession(model, providers=CPU, cache=cache)
    entry = next(p for p in cache.iterdir() if not p.name.startswith("."))
    job = finisher.FinishLater(str(cache), entry.name)
    holder = hold_lock(cache, entry.name)
    before = len(finisher.started_finishers())
    assert job.start() is None and len(finisher.started_finishers()) == before
    assert _finisher(job).returncode == 0
    assert not _finished(entry)
    _release(holder)
    assert _finisher(job).returncode == 0
    assert _finished(entry)


@needs_saving
def test_a_started_finisher_holds_the_lock_until_it_is_done(model, tmp_path):
    """The starter hands its claim to the finisher: a second start (another server, a sibling worker)
    finds the entry claimed while the finisher runs, and packed after; no lock file is left."""
    cache = tmp_path / "cache"
    ortmem.InferenceSession(model, providers=CPU, cache=cache)
    entry = next(p for p in cache.iterdir() if not p.name.startswith("."))
    job = finisher.FinishLater(str(cache), entry.name)
    proc = job.start()
    assert proc is not None
    assert job.start() is None  # claimed by the running finisher
    assert proc.wait(120) == 0
    assert _finished(entry)
    assert job.start() is None  # packed
    assert not creator_lock_path(cache, entry.name).exists()


_FORKED = r"""
import hashlib, json, os, sys
import numpy as np
import ortmem
from ortmem.store import finisher
os.environ["ORTMEM_PREPARE_MIN_BYTES"] = "0"  # the tiny model gets a background job, as a large one would
feeds = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
s = ortmem.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"], cache=sys.argv[2])
assert s.ortmem_action == "converted" and s.ortmem_handoff.later is not None
go_r, go_w = os.pipe()
res_r, res_w = os.pipe()
kids = []
for _ in range(int(sys.argv[3])):  # gunicorn --preload: the master created the session, workers run it
    pid = os.fork()
    if pid == 0:
        os.read(go_r, 1)  # every worker's first run at the same moment
        out = s.run(None, feeds)[0]
        started = len(finisher.started_finishers())
        done = finisher.wait_background(120)
        line = json.dumps({"finishers": started, "done": done, "out": hashlib.sha256(out.tobytes()).hexdigest()})
        os.write(res_w, (line + "\n").encode())
        os._exit(0)
    kids.append(pid)
os.write(go_w, b"x" * len(kids))
status = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in kids]
os.close(res_w)
with os.fdopen(res_r) as f:
    results = [json.loads(line) for line in f]
print(json.dumps({"status": status, "results": results, "parent": len(finisher.started_finishers())}))
"""


@needs_saving
def test_workers_forked_after_a_cold_start_start_one_finisher(model, tmp_path):
    """A session created before fork (gunicorn ``--preload``) carries the cold start's pending packing
    into every worker: of three workers whose first runs come together, exactly one starts a finisher,
    the entry gets ORT's finished model, and every worker answers with ORT's outputs."""
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-c", _FORKED, str(model), str(cache), "3"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["status"] == [0, 0, 0] and report["parent"] == 0
    assert sorted(w["finishers"] for w in report["results"]) == [0, 0, 1]
    assert all(w["done"] for w in report["results"])
    expected = hashlib.sha256(run_plain(model, FEEDS)[0].tobytes()).hexdigest()
    assert {w["out"] for w in report["results"]} == {expected}
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and _finished(entries[0])
    assert list(cache.rglob(".*")) == []  # no lock file, no temporary folder


@pytest.mark.parametrize("text, seconds", [("", None), ("2.5", 2.5), ("0", 0.0), ("soon", None), ("-1", None),
                                           ("inf", None), ("nan", None)])
def test_the_lock_limit_setting(text, seconds, monkeypatch, caplog):
    """``ORTMEM_LOCK_TIMEOUT``: seconds (None here: the default); a value that is not a finite count of
    seconds is named in a warning and the default holds (a typo must neither wait forever nor turn
    waiting off)."""
    from ortmem.store.cache import DEFAULT_LOCK_TIMEOUT, lock_timeout

    monkeypatch.setenv("ORTMEM_LOCK_TIMEOUT", text)
    assert lock_timeout() == (DEFAULT_LOCK_TIMEOUT if seconds is None else seconds)
    assert ("ORTMEM_LOCK_TIMEOUT" in caplog.text) == (seconds is None and text != "")
