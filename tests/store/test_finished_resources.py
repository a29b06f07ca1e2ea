"""A prepared entry ORT cannot load for want of memory is kept, and the start still gets ORT's outputs.

Each start runs in a child process under an address-space limit (``RLIMIT_AS``, as ``ulimit -v``)
found by trying: the least plain ORT needs for the model, plus what importing ortmem's session path
adds, plus a margin. There plain ORT runs; the prepared entry (source weights and pre-packed copies,
twice the bytes to map) does not fit, and ORT fails with ``bad_alloc``. That failure says nothing
about the entry: it must stay in the cache, and the start must fall back to the source and give plain
ORT's outputs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ortmem
from ortmem.onnxfile import scan
from ortmem.cli import main as cli_main
from ortmem.session.request import Request
from ortmem.ort.release import capabilities
from ortmem.store import finisher, finished_entries
from ortmem.store.cache import Cache
from ortmem.store.finished import finish_model
from tests.support.builders import biased_chain, save
from tests.support.reference import run_plain

pytestmark = [
    pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux's"),
]

CPU = ["CPUExecutionProvider"]
MIB = 1 << 20
WIDTH = 1024

# The child: imports what its kind of program imports, then limits its address space and creates the
# session; prints one JSON line (VmSize before creation, what happened), saves the outputs.
CHILD = r"""
import json, logging, resource, sys
import numpy as np
kind, limit, model, cache, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
import onnxruntime as ort
if kind == "ortmem":
    from ortmem.session.inference import InferenceSession
def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
report = {"vm_before": vm_size()}
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
feeds = {"x": np.random.default_rng(7).standard_normal((2, @WIDTH@)).astype(np.float32)}
try:
    if kind == "ortmem":
        s = InferenceSession(model, providers=["CPUExecutionProvider"], cache=cache)
        report["action"] = s.ortmem_action
    else:
        s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    np.save(out, s.run(None, feeds)[0])
    report["ok"] = True
except BaseException as exc:
    report.update(ok=False, error=type(exc).__module__ + "." + type(exc).__name__, message=str(exc)[:300],
                  chained=exc.__cause__ is not None or exc.__context__ is not None)
print(json.dumps(report), flush=True)
""".replace("@WIDTH@", str(WIDTH))


def _child(kind: str, limit: int, model: Path, cache: Path, out: Path) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", CHILD, kind, str(limit), str(model), str(cache), str(out)],
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the child died (rc {r.returncode}): {r.stderr[-2000:]}"
    return json.loads(lines[-1]), r.stderr


def _plain_need(model: Path, cache: Path, out: Path) -> tuple[int, int, int]:
    """(fails, runs, before): address-space limits 4 MiB apart, plain ORT failing to create and run the
    model under the first and succeeding under the second; its address space before creation."""
    free, _ = _child("plain", 0, model, cache, out)
    assert free["ok"]
    lo, hi = free["vm_before"], free["vm_before"] + 256 * MIB  # nothing left to create in at lo
    assert _child("plain", hi, model, cache, out)[0]["ok"]
    while hi - lo > 4 * MIB:
        mid = (lo + hi) // 2
        if _child("plain", mid, model, cache, out)[0]["ok"]:
            hi = mid
        else:
            lo = mid
    return lo, hi, free["vm_before"]


@pytest.mark.slow
def test_a_prepared_entry_that_does_not_fit_in_memory_is_kept_and_the_start_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    # 32 MiB of fp32 weights with external data; its prepared entry maps them and their packed copies
    model = save(biased_chain(np.random.default_rng(0), [WIDTH] * 9), tmp_path / "m.onnx", external=True)
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(model), "--cache", str(cache)]) == 0
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert (entry / "model.data").stat().st_size > 63 * MIB
    out = tmp_path / "out.npy"
    feeds = {"x": np.random.default_rng(7).standard_normal((2, WIDTH)).astype(np.float32)}
    expected = run_plain(model, feeds)[0]
    plain_fails, plain_runs, plain_before = _plain_need(model, cache, out)
    unlimited, _ = _child("ortmem", 0, model, cache, out)
    assert unlimited["ok"] and unlimited["action"] == "finished"
    # what importing ortmem's session path costs in address space, and a margin
    limit = plain_runs + max(0, unlimited["vm_before"] - plain_before) + 6 * MIB

    report, log = _child("ortmem", limit, model, cache, out)

    assert report["ok"], report
    assert report["action"] == "as-is"  # the prepared model did not fit: the source, as plain ORT loads it
    assert log.count("ran short of resources") == 1 and "bad_alloc" in log
    assert np.array_equal(np.load(out), expected)
    assert (entry / "model.data").is_file()  # kept: nothing was wrong with it

    # Where the source does not fit either, the caller gets ORT's own error, and the entry still stays.
    report, log = _child("ortmem", plain_fails, model, cache, out)

    assert not report["ok"]
    assert report["error"].startswith("onnxruntime.") and not report["chained"], report
    assert "ran short of resources" in log
    warm = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert warm.ortmem_action == "finished" and np.array_equal(warm.run(None, feeds)[0], expected)


BAD_ALLOC = "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: std::bad_alloc"


def _short_while_saving(source, folder, *args, **kwargs):
    raise finished_entries.FinishError(f"onnxruntime could not save the prepared model: {BAD_ALLOC}", file=str(source))


def _short_while_judging(source, folder, *args, **kwargs):
    report = finish_model(source, folder, *args, **kwargs)
    return report._replace(useful=False,
                           refusal=f"onnxruntime cannot run the prepared model ({BAD_ALLOC})")


@pytest.mark.parametrize("shortage", [_short_while_saving, _short_while_judging])
def test_a_shortage_while_preparing_records_no_verdict(shortage, tmp_path, monkeypatch):
    """ORT short of memory while an entry is prepared says nothing about the model: no marker ("load it as
    given from now on") is published; the next preparation builds the entry."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    model = save(biased_chain(np.random.default_rng(0), [256] * 3), tmp_path / "m.onnx", external=True)
    cache = Cache(tmp_path / "cache")
    request = Request.for_session(None, CPU, cache=cache.root)
    key = finished_entries.finished_key(model, request.settings, request.packing[0], request.converting)
    with monkeypatch.context() as m:
        m.setattr(finished_entries, "finish_model", shortage)
        with pytest.raises(finished_entries.FinishError, match="bad_alloc"):
            finished_entries.ensure_finished(cache, model, key)
    assert finished_entries.lookup_finished(cache, key) is None  # neither an entry nor a marker

    entry, built = finished_entries.ensure_finished(cache, model, key)

    assert built and not finished_entries.is_marker(entry)
    feeds = {"x": np.random.default_rng(7).standard_normal((2, 256)).astype(np.float32)}
    s = ortmem.InferenceSession(model, providers=CPU, cache=cache.root)
    assert s.ortmem_action == "finished" and np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])


def test_background_work_that_cannot_start_does_not_fail_the_run(tmp_path, monkeypatch, caplog):
    """A cold start leaves the building of the prepared entry for after its first run; where no thread
    or process can be started then, the run still returns ORT's outputs (one warning)."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    model = save(biased_chain(np.random.default_rng(0), [256] * 3), tmp_path / "m.onnx", external=True)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(finisher.FinishLater, "start", no_thread)
    s = ortmem.InferenceSession(model, providers=CPU, cache=tmp_path / "cache")
    assert s.ortmem_handoff.later is not None  # the start did leave work for after the run
    feeds = {"x": np.random.default_rng(7).standard_normal((2, 256)).astype(np.float32)}
    assert np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])
    assert caplog.text.count("could not start packing in the background") == 1
    assert np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])
