"""Tests for small faults in the core that no other test would catch: each one holds a behaviour that a
one-line mistake would break. Real ORT sessions, real files, real
processes; outputs are compared with ORT's own run of the same model.

The faults, and the test that holds each:

1. The finished model's validity check compares only the ORT version (CPU flags, machine and format ignored):
   ``test_finished_models_made_for_another_cpu_machine_or_format_are_not_mapped`` (a real background job
   run in a process that sees other CPU flags, another machine, format or ORT; the warm start here must
   never map its files). It also holds each part of the finished model's key by behaviour, the CPU flags
   included: a key without one of them lets the foreign files be mapped.
2. ``ctime`` dropped from a source's identity:
   ``test_a_source_edited_in_place_with_its_mtime_restored_is_never_served_stale``.
3. The background finisher does not take the creator lock:
   ``test_the_background_finisher_does_not_pack_while_another_process_holds_the_creator_lock``.
4. A hit finishes the entry while another process holds its creator lock:
   ``test_a_hit_does_not_finish_while_another_process_holds_the_creator_lock``.
5. ``ORTMEM_HOOK`` kept in the finisher's environment:
   ``test_a_finisher_started_from_a_hooked_program_runs_unhooked``.
6. The external-data end-of-file check off by one:
   ``test_external_data_one_byte_short_is_refused_and_exactly_long_enough_loads``.
7. The block-size bound of the DQ+MatMul matcher held by a single value:
   ``test_ortmem_converts_exactly_the_block_sizes_this_ort_fuses`` (each side of the lower and upper
   bound, against ORT's own optimized model and outputs).

Also held here, by behaviour:

- the owner checks, without root (a fake owner): ``test_an_entry_owned_by_another_user_is_never_used``;
- publishing an entry in place instead of temp + rename, by what a reader sees rather than a folder's
  name: ``test_a_reader_never_sees_an_entry_while_it_is_built`` (a start looking while another process
  builds finds nothing and disturbs nothing; the builder then publishes a hit) and
  ``test_a_builder_killed_before_publishing_leaves_nothing_a_reader_sees`` (kill -9 before publishing:
  no half entry is found, warned about or thrown away).

Lock tests assert "does not pack while the lock is held", never "blocks": a start may give up waiting
after a bounded time, as long as it packs nothing then.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.onnxfile import scan
from ortmem.files import layout
from ortmem.store.finished import finished_problem
from ortmem.store.cache import Cache, creator_lock_path
from ortmem.store.verdict import start
from ortmem.errors import ExternalDataError, OrtmemError
from ortmem.ort.release import capabilities
from ortmem.ort.settings import session_settings
from ortmem.ort.variants import dq_matmul_model
from ortmem.passes.rules.dq_matmul_match import dq_matmul_match
from ortmem.store.finisher import FinishLater, run as run_finisher, wait_background
from ortmem.measure.synth import SynthConfig, write_model
from tests.support import builders as mb
from tests.support.compare import assert_same_outputs
from tests.support.reference import run_plain

CPU = ["CPUExecutionProvider"]
FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
SAVES = capabilities().prepacked_save
needs_saving = pytest.mark.skipif(not SAVES, reason=f"onnxruntime {ort.__version__} saves no pre-packed "
                                                    "MatMulNBits weights (ortmem.ort.release)")
#: The one ortmem package under test: children started here import this same copy.
PACKAGE_PARENT = str(Path(ortmem.__file__).resolve().parent.parent)
#: Longest a lock test waits for a start to reach the lock (it is normally there within a second or two).
LOCK_DEADLINE_S = 30.0


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture
def qdq(tmp_path) -> Path:
    """A tiny Llama-shaped int4 QDQ model (external data): converted by ortmem, too small for a finisher."""
    path = tmp_path / "q" / "model.onnx"
    path.parent.mkdir()
    return write_model(SynthConfig.tiny(storage="external"), path)


def _only_entry(root: Path):
    (entry,) = list(Cache(root).entries())
    return entry


def _child_env() -> dict[str, str]:
    """The environment of a child that must import the ortmem under test (as the finisher's does)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    return env


def _packed_or_packing(entry_dir: Path) -> list[str]:
    """Files ORT's finishing leaves in an entry, done or under way (``ortmem.store.finished``'s own names)."""
    return sorted(p.name for p in entry_dir.iterdir()
                  if p.name.startswith((layout.FINISHED_STEM, ".prepare-", f".{layout.FINISHED_STEM}.")))


def _stem(entry_dir: Path) -> str:
    """The stem of the one finished model ORT's finishing left in an entry ("" when none)."""
    from ortmem.store.finished_entries import finished_stems

    stems = finished_stems(entry_dir)
    assert len(stems) <= 1, stems
    return stems[0] if stems else ""


class LockHolder:
    """Another process holding an entry's creator lock through ortmem's own ``Cache.creating``."""

    _CODE = ("import sys\nfrom pathlib import Path\nfrom ortmem.store.cache import Cache\n"
             "with Cache(Path(sys.argv[1])).creating(sys.argv[2]):\n"
             "    print('held', flush=True)\n    sys.stdin.readline()\n")

    def __init__(self, root: Path, key: str):
        self.lock = creator_lock_path(root, key)
        self.proc = subprocess.Popen([sys.executable, "-c", self._CODE, str(root), key], env=_child_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def waiters(self) -> int:
        """How many processes wait on this lock now (``/proc/locks`` lists a blocked flock as ``->``)."""
        try:
            inode = os.stat(self.lock).st_ino
            lines = Path("/proc/locks").read_text().splitlines()
        except OSError:
            return 0
        return sum(1 for line in lines if "->" in line and line.split()[-3].endswith(f":{inode}"))

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def _until(done, holder: LockHolder) -> None:
    """Return once ``done()`` holds, a start waits on ``holder``'s lock, or the deadline passes."""
    end = time.monotonic() + LOCK_DEADLINE_S
    while time.monotonic() < end and not done() and not holder.waiters():
        time.sleep(0.05)


# ------------------------------------------------------------------ 1: the pre-packed validity check
def _mapped_inodes() -> set[int]:
    """Inodes of every file this process maps now (ORT maps a pre-packed model's blobs for its life)."""
    out = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[4] != "0":
            out.add(int(parts[4]))
    return out


#: The background job on another machine, simulated in a child process: what ``finished_key_parts`` reads there.
_FOREIGN_FINISHER = """
import json, sys
import onnxruntime
from ortmem.ort import release
from ortmem.store import finished
from ortmem.store.finisher import FinishLater, run
field = sys.argv[3]
if field == "cpu_flags":  # one instruction set fewer (or one more): MLAS may pick another layout
    here = release.cpu_flags()
    release.cpu_flags = lambda: tuple(here[1:]) if here else ("avx512_vnni",)
elif field == "machine":
    here = release.machine()
    release.machine = lambda: "riscv64" if here != "riscv64" else "x86_64"
elif field == "finished_format":
    finished.FINISHED_FORMAT += 1
elif field == "onnxruntime":
    onnxruntime.__version__ = "0.0.1"
print(json.dumps(str(run(FinishLater(sys.argv[1], sys.argv[2], "full")))))
"""


@needs_saving
@pytest.mark.parametrize("field", ["cpu_flags", "machine", "finished_format", "onnxruntime"])
def test_finished_models_made_for_another_cpu_machine_or_format_are_not_mapped(field, qdq, tmp_path):
    """A finished model made on a machine with other CPU flags (MLAS picks the packed layout by
    instruction set), another machine, ORT or file format is useless or wrong here: a warm start must
    load the plain entry, never map it. The foreign job is a real background job run in a process that
    sees another ``field``; the warm start runs here, on this machine."""
    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)
    ortmem.InferenceSession(qdq, providers=CPU, cache=cache)  # cold: converts (too small for a finisher)
    entry = _only_entry(cache)
    r = subprocess.run([sys.executable, "-c", _FOREIGN_FINISHER, str(cache), entry.key, field], env=_child_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and _stem(entry.path) and (entry.path / f"{_stem(entry.path)}.json").exists(), \
        r.stderr[-2000:]
    foreign = (entry.path / f"{_stem(entry.path)}.data").stat().st_ino

    warm = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    assert foreign not in _mapped_inodes(), f"a model finished for another {field} was mapped"
    assert_same_outputs(warm.run(None, FEEDS), expected)
    again = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)  # and the entry still works
    assert_same_outputs(again.run(None, FEEDS), expected)


# ------------------------------------------------------------------------- 2: ctime in the identity
def test_a_source_edited_in_place_with_its_mtime_restored_is_never_served_stale(rng, tmp_path):
    """Same size, same inode, mtime set back with ``os.utime``: only ctime tells. The next start must
    run the edited model (as ORT does), never the entry converted from the old bytes."""
    path = mb.save(mb.int4_model(rng), tmp_path / "m" / "model.onnx")
    old = time.time_ns() - 120 * 10**9  # older than any "racy" window: stat alone must vouch for it
    os.utime(path, ns=(old, old))
    feeds = {"x": rng.standard_normal((1, 256), dtype=np.float32)}
    before = run_plain(path, feeds)
    cache = tmp_path / "cache"
    assert_same_outputs(ortmem.InferenceSession(path, providers=CPU, cache=cache).run(None, feeds), before)

    weight = next(t for t in onnx.load(str(path)).graph.initializer if t.name == "Wq").raw_data
    data = bytearray(path.read_bytes())
    at = data.find(weight)
    assert at > 0 and data.find(weight, at + 1) < 0
    data[at:at + len(weight)] = bytes(b ^ 0x88 for b in weight)  # every int4 code moves by 8
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = path.stat()
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    after = run_plain(path, feeds)
    assert not np.array_equal(after[0], before[0])

    again = ortmem.InferenceSession(path, providers=CPU, cache=cache)
    assert_same_outputs(again.run(None, feeds), after)


# ------------------------------------------------------------------------------ 3, 4: creator lock
@needs_saving
def test_the_background_finisher_does_not_pack_while_another_process_holds_the_creator_lock(qdq, tmp_path):
    """The finisher (``python -m ortmem.store.finisher``, as a cold start leaves it) finds the entry's
    creator lock held by another process: it packs nothing until that process lets go."""
    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)
    ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    entry = _only_entry(cache)
    job = FinishLater(str(cache), entry.key, "full")
    holder = LockHolder(cache, entry.key)
    finisher = None
    try:
        finisher = subprocess.Popen([sys.executable, "-m", "ortmem.store.finisher", job.as_json()],
                                  env=_child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _until(lambda: finisher.poll() is not None, holder)
        assert _packed_or_packing(entry.path) == [], "the finisher packed while another process held the lock"
    finally:
        holder.release()
        if finisher is not None:
            _, err = finisher.communicate(timeout=120)
    assert finisher.returncode == 0, err[-2000:]
    assert run_finisher(job) is not None and finished_problem(entry.path, _stem(entry.path)) is None  # once free
    warm = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    assert warm.ortmem_action == "finished"
    assert_same_outputs(warm.run(None, FEEDS), expected)


@needs_saving
def test_a_hit_does_not_finish_while_another_process_holds_the_creator_lock(qdq, tmp_path, monkeypatch):
    """A cache hit of an entry not finished yet leaves ORT's finishing to the job its first run starts;
    with the entry's creator lock held by another process (a job, another worker) nothing is finished
    meanwhile, in the session's process or in that job."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")  # the small model gets the job a big one gets
    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)
    ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    entry = _only_entry(cache)
    result: dict = {}

    def first_hit() -> None:
        try:
            s = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
            result["out"] = s.run(None, FEEDS)
            result["waited"] = wait_background(120)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            result["error"] = exc

    holder = LockHolder(cache, entry.key)
    thread = threading.Thread(target=first_hit, daemon=True)
    try:
        thread.start()
        _until(lambda: not thread.is_alive(), holder)
        assert _packed_or_packing(entry.path) == [], "a hit finished the entry while another process held the lock"
    finally:
        holder.release()
        thread.join(120)
    assert "error" not in result, result.get("error")
    assert_same_outputs(result["out"], expected)


# --------------------------------------------------------------------------- 5: the finisher unhooked
_RECORDER = """
import atexit, json, os, sys

def _record():
    hook = sys.modules.get("ortmem.intercept.session_hook")
    with open(os.environ["ESCAPES_RECORD"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "hooked": bool(hook and hook.is_hooked()),
                            "sessions": len(hook.sessions()) if hook else 0}) + "\\n")

atexit.register(_record)
"""

_HOOKED_PROGRAM = """
import json, sys
import numpy as np
import onnxruntime as ort
from ortmem.store import finisher
import os
os.environ["ORTMEM_PREPARE_MIN_BYTES"] = "0"  # this small model gets the job a big one gets
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
out = s.run(None, {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)})[0]
print(json.dumps({"action": s.ortmem_action, "finishers": finisher.started_finishers(),
                  "waited": finisher.wait_background(120), "out": out.tolist()}))
"""


@needs_saving
def test_a_finisher_started_from_a_hooked_program_runs_unhooked(qdq, tmp_path):
    """Under ``python -m ortmem run`` every child interpreter is hooked, but the finisher a cold start
    leaves is ortmem's own work: it must run plain (no hook installed, none of its packing sessions
    routed through ortmem), and still pack."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_RECORDER)  # runs in every interpreter, after the hook's own
    record = tmp_path / "record.jsonl"
    program = tmp_path / "program.py"
    program.write_text(_HOOKED_PROGRAM)
    cache = tmp_path / "cache"
    env = _child_env()
    env.update(ESCAPES_RECORD=str(record), PYTHONPATH=os.pathsep.join([str(site), env["PYTHONPATH"]]))
    env.pop("ORTMEM_HOOK", None)
    r = subprocess.run([sys.executable, "-m", "ortmem", "run", "--cache-dir", str(cache), "--", str(program), str(qdq)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["action"] == "converted" and result["waited"] and len(result["finishers"]) == 1
    assert_same_outputs([np.array(result["out"], dtype=np.float32)], run_plain(qdq, FEEDS))
    records = {rec["pid"]: rec for rec in map(json.loads, record.read_text().splitlines())}
    finisher = records[result["finishers"][0]]
    assert not finisher["hooked"] and finisher["sessions"] == 0, f"the finisher ran hooked: {finisher}"
    assert any(rec["hooked"] for rec in records.values())  # the program itself was (the setup works)
    assert finished_problem(_only_entry(cache).path, _stem(_only_entry(cache).path)) is None  # and the job did its work


# ---------------------------------------------------------------------- 6: external data end of file
def test_external_data_one_byte_short_is_refused_and_exactly_long_enough_loads(rng, tmp_path):
    """A data file one byte shorter than its last tensor needs is refused before ORT sees it, naming
    that tensor and file; one exactly long enough loads and runs as ORT runs it."""
    path = mb.save(mb.matmul_chain(rng, [64, 128, 32]), tmp_path / "m.onnx", external=True)
    spans = {}
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if ext:
            spans[t.name] = int(ext.get("offset", 0)) + int(ext["length"])
    last, end = max(spans.items(), key=lambda kv: kv[1])
    data = tmp_path / "m.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(end)
    feeds = {"x": rng.standard_normal((2, 64), dtype=np.float32)}
    expected = run_plain(path, feeds)
    with ortmem.load(path) as model:
        assert {w.name for w in model.weights} >= set(spans)
    assert_same_outputs(ortmem.InferenceSession(path, providers=CPU, cache=False).run(None, feeds), expected)

    with open(data, "r+b") as f:
        f.truncate(end - 1)
    with pytest.raises(ExternalDataError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == last and Path(ei.value.file) == data.resolve()
    with pytest.raises(OrtmemError, match=last):
        ortmem.InferenceSession(path, providers=CPU, cache=False)


# ----------------------------------------------------------------------------- 7: block-size bound
def _ort_fuses(path: Path, folder: Path) -> bool:
    """Whether this ORT's own optimizer turns the model's DQ+MatMul into MatMulNBits."""
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(folder / "ort-optimized.onnx")
    ort.InferenceSession(str(path), so, providers=CPU)
    return any(n.op_type == "MatMulNBits" for n in onnx.load(so.optimized_model_filepath).graph.node)


@pytest.mark.parametrize("block", [8, 16, 256, 512, 2048, 4096])
def test_ortmem_converts_exactly_the_block_sizes_this_ort_fuses(block, tmp_path):
    """Each side of the rule's bounds (16 below; 256 on 1.31, none on 1.32, past which ortmem's checked
    range ends at ``convert_block_max``): the matcher predicts ORT's own fusion, ortmem converts where
    ORT fuses (and only there), and the outputs equal ORT's run of the QDQ model."""
    m = dq_matmul_model("int4", "float", block, False, seed=block, n=16)
    path = tmp_path / "qdq.onnx"
    onnx.save(m, path)
    try:
        fused = _ort_fuses(path, tmp_path)
    except Exception as exc:  # noqa: BLE001 - 1.28 fuses a 512+ block into a kernel that refuses it
        # ORT fails on its own model: ortmem converts nothing and fails the same way (validity unchanged)
        with pytest.raises(type(exc)):
            ortmem.InferenceSession(path, providers=CPU, cache=tmp_path / "cache")
        return
    cands, _ = dq_matmul_match(m)
    predicted = [c for c in cands if c.ort_outcome in ("converted", "converted_wrong", "fused_by_ort")]
    assert bool(predicted) == fused, f"block {block}: ORT fuses: {fused}, the matcher predicted {predicted}"

    feeds = {"A": np.random.default_rng(block).standard_normal((2, 2 * block)).astype(np.float32)}
    sess = ortmem.InferenceSession(path, providers=CPU, cache=tmp_path / "cache")
    converted = sess.ortmem_report is not None and sess.ortmem_report.converted == 1
    assert converted == (fused and block <= capabilities().convert_block_max), (block, fused, sess.ortmem_report)
    if fused and block > capabilities().convert_block_max:
        # past the range where the probe showed ORT's fused kernel right (1.25: 512+ reads garbage, its
        # own run differs from run to run): left to ORT, and ORT's output is no reference to compare with
        return
    assert_same_outputs(sess.run(None, feeds), run_plain(path, feeds))


# ------------------------------------------------------------------- owner checks, without root
def _owned_by_someone_else(folder: Path):
    """``os.lstat`` as it would read if another user owned ``folder`` and everything in it: a fake owner,
    so the owner check runs whether or not the suite may ``chown`` (root)."""
    real = os.lstat
    prefix = str(folder)

    def lstat(path, *args, **kwargs):
        st = real(path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(prefix):
            seq = (*st[:4], st.st_uid + 4242, *st[5:10])
            extra = {k: getattr(st, k) for k in ("st_atime", "st_mtime", "st_ctime", "st_atime_ns",
                                                 "st_mtime_ns", "st_ctime_ns", "st_blksize", "st_blocks", "st_rdev")}
            return os.stat_result(seq, extra)
        return st

    return lstat


def test_an_entry_owned_by_another_user_is_never_used(qdq, tmp_path, monkeypatch):
    """Another user's entry under this model's key (mode 0700/0600, digests intact) could hold anything:
    a start must not take it for a hit. Its owner is faked, so this runs without root too."""
    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)
    ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    entry = _only_entry(cache)
    assert ortmem.InferenceSession(qdq, providers=CPU, cache=cache).ortmem_cache_hit  # trusted: a hit
    monkeypatch.setattr(os, "lstat", _owned_by_someone_else(entry.path))
    s = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    assert not s.ortmem_cache_hit, "an entry owned by another user was used"
    assert_same_outputs(s.run(None, FEEDS), expected)


# ----------------------------------------------------------------------- publishing: temp + rename
_BUILDER = """
import json, sys
import numpy as np
import ortmem
paused = []
def progress(done, total, name):  # called as converted weights are written, before the entry exists
    if done >= total and not paused:
        paused.append(1)
        print("written", flush=True)
        sys.stdin.readline()
s = ortmem.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"], cache=sys.argv[2], progress=progress)
out = s.run(None, {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)})[0]
print(json.dumps({"paused": bool(paused), "action": s.ortmem_action, "out": out.tolist()}))
"""


def _paused_builder(model: Path, cache: Path) -> subprocess.Popen:
    """A cold start in another process, stopped after writing its converted weights, before publishing."""
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, str(model), str(cache)], env=_child_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "written":
        proc.kill()
        raise AssertionError(f"the builder did not pause: {line!r} {proc.stderr.read()[-2000:]}")
    return proc


def _look(model: Path, cache: Path):
    """What every start does first, without any lock: look the model's entry up."""
    return start(Cache(cache), model, settings=session_settings(None)).entry


def test_a_reader_never_sees_an_entry_while_it_is_built(qdq, tmp_path, caplog):
    """While another process writes an entry, a start looking it up finds nothing (and disturbs
    nothing); once the builder publishes, the next start is a hit with ORT's outputs."""
    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)
    builder = _paused_builder(qdq, cache)
    try:
        with caplog.at_level(logging.INFO, logger="ortmem"):
            assert _look(qdq, cache) is None
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        out, err = builder.communicate("\n", timeout=300)
    assert builder.returncode == 0, err[-2000:]
    built = json.loads(out.strip().splitlines()[-1])
    assert built["paused"] and built["action"] == "converted", built
    assert_same_outputs([np.array(built["out"], dtype=np.float32)], expected)
    hit = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    assert hit.ortmem_cache_hit
    assert_same_outputs(hit.run(None, FEEDS), expected)


def test_a_builder_killed_before_publishing_leaves_nothing_a_reader_sees(qdq, tmp_path, caplog):
    """kill -9 between writing and publishing: later starts find no entry (no half entry to trip
    over and throw away), convert afresh and run as ORT does."""
    cache = tmp_path / "cache"
    expected = run_plain(qdq, FEEDS)
    builder = _paused_builder(qdq, cache)
    builder.send_signal(signal.SIGKILL)
    builder.communicate(timeout=60)
    with caplog.at_level(logging.INFO, logger="ortmem"):
        assert _look(qdq, cache) is None
        cold = ortmem.InferenceSession(qdq, providers=CPU, cache=cache)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not cold.ortmem_cache_hit and cold.ortmem_action == "converted"
    assert_same_outputs(cold.run(None, FEEDS), expected)
    assert ortmem.InferenceSession(qdq, providers=CPU, cache=cache).ortmem_cache_hit
