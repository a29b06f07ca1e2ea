"""The cache trusts no one but its owner, serves no stale or damaged entry, and degrades instead of
failing. Attacks run as a second local user (``nobody`` through
``setpriv``) where the machine allows it, and are skipped with the reason otherwise.

Every session's outputs are compared with plain ORT on the same (possibly edited) model, and every
test that expects a conversion asserts one happened (``ortmem_report`` / the entry's ops).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.ort.settings import OrtSettings
from ortmem.store.finished_entries import finished_stem, finishing_settings
from ortmem.onnxfile import scan
from ortmem.files import layout
from ortmem.store import finisher
from ortmem.store.finished import finished_problem
from ortmem.files import trust
from ortmem.store.cache import SOURCE_LINK_PREFIX, Cache, UntrustedCacheError, creator_lock_path
from ortmem.cli import main as cli_main
from ortmem.files.trust import open_new, untrusted_reason, write_new
from ortmem.onnxfile.loader import load
from ortmem.measure.synth import SynthConfig, write_model
from ortmem.ort.release import capabilities
from tests.support.builders import tiny_decoder
from tests.support.compare import assert_same_outputs
from tests.support.reference import run_plain

#: finished models exist only on releases that save pre-packed weights (not 1.25): ortmem.ort.release
needs_saving = pytest.mark.skipif(not capabilities().prepacked_save,
                                  reason=f"onnxruntime {ort.__version__} saves no pre-packed MatMulNBits weights")

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
#: The stem of the finished model a default session's first run leaves in its converted entry (one per
#: settings: :func:`ortmem.store.finished_entries.finished_stem`).
DEFAULT_STEM = finished_stem(finishing_settings(OrtSettings(), {}))


def _entry_dir(sess) -> Path:
    return Path(sess.ortmem_handoff.model).parent


def _flip(path: Path, offset: int) -> None:
    """Flip one byte in place, keeping the file's mtime (what an edit that restores it looks like)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _as_nobody_available() -> str | None:
    """Why attacks as a second user cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "not root: cannot switch to a second local user"
    if shutil.which("setpriv") is None:
        return "setpriv not installed"
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "true"], capture_output=True)
    if r.returncode != 0:
        return f"setpriv refused: {r.stderr.decode(errors='replace').strip()}"
    return None


def _as_nobody(code: str, *args: str, probes: Path) -> subprocess.CompletedProcess:
    """Run ``code`` as ``nobody``, with a private copy of this run's ORT release-probe answers in
    ``probes`` (the probe is a subprocess, which ``nobody`` cannot start from this venv here)."""
    shutil.copytree(os.environ["ORTMEM_PROBE_DIR"], probes)  # set for the whole run by conftest.py
    for f in [probes, *probes.iterdir()]:
        os.chown(f, 65534, 65534)
    os.chmod(probes, 0o700)
    cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", code, *args]
    env = {**os.environ, "HOME": "/tmp", "ORTMEM_PROBE_DIR": str(probes)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def world_dir():
    """A folder outside pytest's private tmp (which ``nobody`` cannot enter), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="ortmem-sec-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------ privacy
def test_cache_folders_and_files_are_private(tmp_path):
    path = tiny_decoder(tmp_path / "m", storage="external")
    os.chmod(path, 0o644)
    sess = ortmem.InferenceSession(path, cache=tmp_path / "cache")
    assert sess.ortmem_report is not None
    entry = _entry_dir(sess)
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.stat().st_mode) == 0o700
    for name in ("model.onnx", "weights.bin", "manifest.json"):
        assert stat.S_IMODE((entry / name).stat().st_mode) == 0o600, name


def test_a_stricter_source_mode_is_kept(tmp_path):
    path = tiny_decoder(tmp_path / "m", storage="external")
    os.chmod(path, 0o400)
    sess = ortmem.InferenceSession(path, cache=tmp_path / "cache")
    entry = _entry_dir(sess)
    assert stat.S_IMODE((entry / "weights.bin").stat().st_mode) == 0o400
    assert stat.S_IMODE((entry / "model.onnx").stat().st_mode) == 0o400
    assert_same_outputs(ortmem.InferenceSession(path, cache=tmp_path / "cache").run(None, FEEDS), run_plain(path, FEEDS))


def test_default_cache_root_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "a" / "b"))
    path = tiny_decoder(tmp_path / "m", storage="external")
    ortmem.InferenceSession(path)
    for d in (tmp_path / "a" / "b", tmp_path / "a" / "b" / "converted"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_new_files_refuse_planted_links(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "planted"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_new(link, b"overwritten")
    with pytest.raises(FileExistsError):
        open_new(link)
    assert victim.read_bytes() == b"precious"
    assert "symbolic link" in untrusted_reason(link)


@needs_saving
def test_finishing_temp_files_never_write_through_a_planted_link(tmp_path, monkeypatch):
    """ORT's finishing of an entry writes its work folder and its manifest's temporary under names
    derived from a token: each is created exclusively, so a link planted under that name is never
    written through (the finishing fails instead, and nothing it made is trusted)."""
    import uuid

    from ortmem.store.finished import finish_model

    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    entry = _entry_dir(ortmem.InferenceSession(path, cache=cache))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")

    class FixedUUID:
        hex = "0123456789abcdef0123456789abcdef"

    monkeypatch.setattr(uuid, "uuid4", lambda: FixedUUID())
    for name in (f".prepare-{os.getpid()}-{FixedUUID.hex[:12]}", f".{DEFAULT_STEM}.json.{os.getpid()}-{FixedUUID.hex[:8]}"):
        (entry / name).symlink_to(victim)
        with pytest.raises(OSError):
            finish_model(entry / layout.MODEL_FILE, entry, DEFAULT_STEM)
        assert victim.read_bytes() == b"precious"
        assert finished_problem(entry, DEFAULT_STEM) is not None
        (entry / name).unlink(missing_ok=True)


# ------------------------------------------------------------------- another user's entries
def test_entry_owned_by_another_user_is_never_read(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("needs root to give an entry to another user")
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    entry = _entry_dir(ortmem.InferenceSession(path, cache=cache))
    for f in [entry, *entry.iterdir()]:
        os.chown(f, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(path, cache=cache)
    assert not sess.ortmem_cache_hit and sess.ortmem_report is not None
    assert any("owned by uid 65534" in r.getMessage() for r in caplog.records)
    assert_same_outputs(sess.run(None, FEEDS), run_plain(path, FEEDS))


def test_group_writable_entry_file_is_refused(tmp_path):
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    entry = _entry_dir(ortmem.InferenceSession(path, cache=cache))
    os.chmod(entry / "weights.bin", 0o620)
    sess = ortmem.InferenceSession(path, cache=cache)
    assert not sess.ortmem_cache_hit and sess.ortmem_report is not None
    assert_same_outputs(sess.run(None, FEEDS), run_plain(path, FEEDS))


def test_shared_cache_poisoned_by_a_second_user_is_not_used(world_dir, caplog):
    """Finding 1 as an attack: ``nobody`` plants a complete entry, under the victim's key, of a
    model with other outputs in a shared cache folder. The victim must get its own model's outputs."""
    reason = _as_nobody_available()
    if reason:
        pytest.skip(reason)
    shared = world_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim_model = tiny_decoder(world_dir / "victim", storage="external", seed=1)
    attacker_model = tiny_decoder(world_dir / "attacker", storage="external", seed=2)
    for p in (world_dir / "victim", world_dir / "attacker"):
        for f in [p, *p.iterdir()]:
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
    expected = run_plain(victim_model, FEEDS)
    assert not np.array_equal(expected[0], run_plain(attacker_model, FEEDS)[0])
    # The attacker builds an entry for *their* model under the key of the victim's (the key is computable).
    code = r"""
import os, shutil, sys
from pathlib import Path
os.umask(0)
from ortmem.store.cache import Cache
from ortmem.session.convert import convert_cached
from ortmem.files.sources import converted_key
from ortmem.ort.settings import session_settings
from ortmem.onnxfile.loader import load
shared, victim, attacker = map(Path, sys.argv[1:4])
root = shared / "converted"
cache = Cache(root)
entry, hit, report = convert_cached(load(attacker), session_settings(None), cache)
key = converted_key(victim, session_settings(None), {"fp16_in_fp32": None})
os.rename(entry.path, root / key)
for f in [root / key, *(root / key).iterdir()]:
    os.chmod(f, 0o777 if f.is_dir() else 0o666)
print(key)
"""
    ortmem.InferenceSession(attacker_model, cache=world_dir / "warmup")  # probe answers for this run
    r = _as_nobody(code, str(shared), str(victim_model), str(attacker_model), probes=world_dir / "probes")
    assert r.returncode == 0, r.stderr
    planted = shared / "converted" / r.stdout.split()[-1]
    assert planted.is_dir() and planted.stat().st_uid == 65534
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(victim_model, cache=shared / "converted")
    assert any("not used" in r.getMessage() for r in caplog.records)
    assert not sess.ortmem_cache_hit and sess.ortmem_report is not None  # converted privately, in memory
    assert_same_outputs(sess.run(None, FEEDS), expected)


def test_read_only_cache_folder_degrades_with_one_warning(world_dir, caplog):
    """An unwritable cache folder never fails a session: every session converts without it, and a
    folder that cannot be created is named in one warning."""
    reason = _as_nobody_available()
    if reason:
        pytest.skip(reason)
    model = tiny_decoder(world_dir / "m", storage="external")
    for f in [world_dir / "m", *(world_dir / "m").iterdir()]:
        os.chmod(f, 0o755 if f.is_dir() else 0o644)
    ro = world_dir / "ro"
    ro.mkdir()
    os.chown(ro, 65534, 65534)
    os.chmod(ro, 0o500)
    code = r"""
import logging, sys
import numpy as np
import onnxruntime as ort
import ortmem
logging.basicConfig(level=logging.WARNING)
feeds = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
model, cache = sys.argv[1], sys.argv[2]
want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
for c in (cache, cache + "/sub/deeper"):
    s = ortmem.InferenceSession(model, cache=c)
    got = s.run(None, feeds)
    assert s.ortmem_report is not None, "nothing converted"
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
print("OK")
"""
    ortmem.InferenceSession(model, cache=False)  # probe answers for this run
    r = _as_nobody(code, str(model), str(ro), probes=world_dir / "probes")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    # A read-only cache is a supported deployment (ortmem prepare, then a read-only mount): no warning; a
    # cache folder that cannot even be created is named once.
    assert r.stderr.count("WARNING") == 1 and r.stderr.count("converting without it") == 1, r.stderr
    assert "sub/deeper" in r.stderr


def test_uncreatable_cache_path_degrades(tmp_path, caplog):
    path = tiny_decoder(tmp_path / "m", storage="external")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(path, cache=blocker / "cache")
    assert sess.ortmem_report is not None
    assert len([r for r in caplog.records if "not using the cache" in r.getMessage()]) == 1
    assert_same_outputs(sess.run(None, FEEDS), run_plain(path, FEEDS))


def test_cache_folder_writable_by_others_is_refused(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)
    with pytest.raises(UntrustedCacheError):
        Cache(root)


# ----------------------------------------------------------------- identity and integrity
def _dq_weight(path: Path):
    """The largest integer DequantizeLinear input of the model, as (file, offset, length)."""
    m = load(path)
    try:
        w = max((w for w in m.weights if w.data_type in (2, 3, 21, 22)), key=lambda w: w.length)
        return w.file, w.offset, w.length
    finally:
        m.close()


def test_in_place_edit_with_restored_mtime_is_a_miss(tmp_path):
    """Finding 2: editing a weight in place and restoring the mtime served the old conversion."""
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    first = ortmem.InferenceSession(path, cache=cache)
    assert_same_outputs(first.run(None, FEEDS), run_plain(path, FEEDS))
    file, offset, length = _dq_weight(path)
    _flip(file, offset + length // 2)
    _flip(file, offset + length // 3)
    again = ortmem.InferenceSession(path, cache=cache)
    assert not again.ortmem_cache_hit and again.ortmem_report is not None
    expected = run_plain(path, FEEDS)
    assert_same_outputs(again.run(None, FEEDS), expected)


def test_another_entry_linking_and_dropping_the_source_keeps_the_hit(tmp_path):
    """Every entry hard-links its sources: another cache's entry made then cleared moves the source's
    ctime but leaves the link count where it was. That is no edit (the content digest says so): still a
    hit, and the identity is recorded anew so the next start needs no digest."""
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    ortmem.InferenceSession(path, cache=cache)
    data = next(p for p in path.parent.iterdir() if p != path)  # the external data file entries link
    before = os.stat(data)
    other = tmp_path / "other"
    ortmem.InferenceSession(path, cache=other)  # links the source
    Cache(other).clear()  # drops the link again
    after = os.stat(data)
    assert after.st_nlink == before.st_nlink and after.st_ctime_ns != before.st_ctime_ns
    again = ortmem.InferenceSession(path, cache=cache)
    assert again.ortmem_cache_hit
    assert_same_outputs(again.run(None, FEEDS), run_plain(path, FEEDS))


def _entry_with_a_flipped_weight(tmp_path: Path) -> tuple[Path, Path]:
    """(model, cache): the model's entry built, then one byte flipped mid-span in its largest tensor."""
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    entry = _entry_dir(ortmem.InferenceSession(path, cache=cache))
    offset, length = max(json.loads((entry / "manifest.json").read_text())["spans"], key=lambda s: s[1])
    _flip(entry / "weights.bin", offset + length // 2 + 1)
    return path, cache


def test_weights_byte_flip_mid_span_is_detected_and_rebuilt(tmp_path, caplog):
    """Finding 3: one byte flipped in the middle of a tensor in weights.bin gave wrong outputs."""
    path, cache = _entry_with_a_flipped_weight(tmp_path)
    expected = run_plain(path, FEEDS)
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(path, cache=cache, prepacked=False)
    assert not sess.ortmem_cache_hit and sess.ortmem_report is not None
    assert any("weights.bin content changed" in r.getMessage() for r in caplog.records)
    assert_same_outputs(sess.run(None, FEEDS), expected)


def _finish(session: ortmem.InferenceSession) -> None:
    """Run ``session`` once and wait for the background job its first run leaves (ORT's finishing)."""
    session.run(None, FEEDS)
    assert finisher.wait_background(120)


@needs_saving
def test_sampled_verify_still_checks_in_full_before_finishing(tmp_path, monkeypatch):
    """A flip before ORT finishes an entry would be baked into the finished model for every later
    session: the background job checks the entry in full first, whatever ``verify`` says."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    path, cache = _entry_with_a_flipped_weight(tmp_path)
    expected = run_plain(path, FEEDS)
    sess = ortmem.InferenceSession(path, cache=cache, verify="sampled")  # its sampled pages miss the flip
    sess.run(None, FEEDS)
    assert finisher.wait_background(120)  # the job's full check finds it: the entry is discarded, not finished
    rebuilt = ortmem.InferenceSession(path, cache=cache, verify="sampled")
    assert not rebuilt.ortmem_cache_hit
    _finish(rebuilt)
    warm = ortmem.InferenceSession(path, cache=cache, verify="sampled")
    assert warm.ortmem_cache_hit and Path(warm.ortmem_handoff.model).name == f"{DEFAULT_STEM}.onnx"
    assert_same_outputs(warm.run(None, FEEDS), expected)


@needs_saving
def test_a_byte_flip_in_the_finished_data_is_detected(tmp_path, monkeypatch):
    """A flip in ORT's finished data file (here inside a pre-packed blob) would be wrong in every later
    session: the next start refuses the finished model, loads the entry, and the job its first run
    leaves finishes it afresh."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    expected = run_plain(path, FEEDS)
    _finish(ortmem.InferenceSession(path, cache=cache))
    warm = ortmem.InferenceSession(path, cache=cache)
    entry = _entry_dir(warm)
    assert Path(warm.ortmem_handoff.model).name == f"{DEFAULT_STEM}.onnx"
    offset, length = json.loads((entry / f"{DEFAULT_STEM}.json").read_text())["spot_spans"][-1]  # a blob
    _flip(entry / f"{DEFAULT_STEM}.data", offset + length // 2 + 7)
    assert "content changed" in finished_problem(entry, DEFAULT_STEM, mode="full")
    again = ortmem.InferenceSession(path, cache=cache)
    assert again.ortmem_cache_hit and again.ortmem_action == "cache-hit"
    assert_same_outputs(again.run(None, FEEDS), expected)
    assert finisher.wait_background(120)
    assert finished_problem(entry, DEFAULT_STEM, mode="full") is None  # finished afresh


def test_verify_rejects_unknown_modes(tmp_path):
    with pytest.raises(ortmem.OrtmemError, match="verify must be one of"):
        ortmem.InferenceSession(tiny_decoder(tmp_path / "m", storage="external"), cache=tmp_path / "c", verify="fast")


# ---------------------------------------------------------------------------- leftovers
def test_crash_leftovers_are_reclaimed_by_the_next_writer_and_prune(tmp_path):
    """Finding 8: after kill -9, .tmp-* folders and pre-pack temp files stayed forever."""
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache_dir = tmp_path / "cache"
    entry = _entry_dir(ortmem.InferenceSession(path, cache=cache_dir))
    dead = 2**22 + 12345  # above pid_max's default: no such process
    old = time.time() - 3600
    leftovers = [cache_dir / f".tmp-{dead}-ab12", cache_dir / ".trash-deadbeef", entry / f".prepare-{dead}-cd34"]
    for d in leftovers:
        d.mkdir()
        (d / "weights.bin").write_bytes(b"x" * 4096)
    files = [entry / f".{layout.FINISHED_STEM}.json.{dead}-ef56", entry / f".{layout.MANIFEST}.{dead}-ef56"]
    for f in files:
        f.write_bytes(b"y")
    live = cache_dir / f".tmp-{os.getpid()}-live"  # a live writer's folder is kept, however old
    live.mkdir()
    fresh = cache_dir / f".tmp-{dead}-fresh"  # a young one may be another container's live writer
    fresh.mkdir()
    for p in [*leftovers, *files, live]:
        for q in [p, *(p.rglob("*") if p.is_dir() else [])]:
            os.utime(q, (old, old))
    Cache(cache_dir).prune(2**40)
    assert not any(p.exists() for p in [*leftovers, *files])
    assert live.exists() and fresh.exists()
    # and the next writer reclaims too
    (cache_dir / f".tmp-{dead}-again").mkdir()
    os.utime(cache_dir / f".tmp-{dead}-again", (old, old))
    ortmem.InferenceSession(tiny_decoder(tmp_path / "m2", storage="external", seed=3), cache=cache_dir)
    assert not (cache_dir / f".tmp-{dead}-again").exists()


def test_cache_verify_cli_checks_every_entry_in_full(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "root"))
    path = tiny_decoder(tmp_path / "m", storage="external")
    entry = _entry_dir(ortmem.InferenceSession(path))
    assert cli_main(["cache", "verify"]) == 0
    assert "1 entry, 0 damaged" in capsys.readouterr().out
    offset, length = max(json.loads((entry / "manifest.json").read_text())["spans"], key=lambda s: s[1])
    _flip(entry / "weights.bin", offset + length // 2)
    assert cli_main(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert "weights.bin content changed" in out and "1 damaged" in out
    assert not entry.exists()  # removed: the next session rebuilds it


def test_racy_source_is_checked_by_content(tmp_path, monkeypatch):
    """A same-size rewrite inside one timestamp tick is invisible to stat ("racy"): an entry built
    from a source written moments ago records the source's digest and checks it until the source
    is old enough for stat to tell."""
    from ortmem.files import sources

    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    entry = _entry_dir(ortmem.InferenceSession(path, cache=cache))
    assert "source_digests" in json.loads((entry / "manifest.json").read_text())
    file, offset, length = _dq_weight(path)
    _flip(file, offset + length // 2)
    monkeypatch.setattr(sources, "same_source", lambda recorded, current: True)  # stat sees nothing
    again = ortmem.InferenceSession(path, cache=cache)
    assert not again.ortmem_cache_hit and again.ortmem_report is not None
    assert_same_outputs(again.run(None, FEEDS), run_plain(path, FEEDS))
    monkeypatch.setattr(sources, "RACY_SECONDS", 0.0)  # the source is now "old": one last check, then stat
    assert ortmem.InferenceSession(path, cache=cache).ortmem_cache_hit
    entry = next(Cache(cache).entries()).path
    assert "source_digests" not in json.loads((entry / "manifest.json").read_text())


def test_a_writer_killed_mid_conversion_leaves_a_folder_the_next_writer_removes(tmp_path, monkeypatch):
    """Finding 8 with a real crash: kill -9 while the entry is being written."""
    import signal

    from ortmem.store import cache as cache_module

    path = tiny_decoder(tmp_path / "m", storage="external")
    cache_dir = tmp_path / "cache"
    marker = tmp_path / "converting"
    child = subprocess.Popen([sys.executable, "-c", r"""
import sys, time
import ortmem
def progress(done, total, name):
    open(sys.argv[3], "w").close()
    time.sleep(120)
ortmem.InferenceSession(sys.argv[1], cache=sys.argv[2], progress=progress)
""", str(path), str(cache_dir), str(marker)])
    try:
        deadline = time.time() + 60
        while not marker.exists() and child.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the child never started converting"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    leftovers = [p for p in cache_dir.iterdir() if p.name.startswith(f".tmp-{child.pid}-")]
    assert leftovers and any(f.stat().st_size for f in leftovers[0].iterdir())
    monkeypatch.setattr(cache_module, "STALE_IDLE_SECONDS", 0.0)  # instead of waiting 10 minutes
    sess = ortmem.InferenceSession(path, cache=cache_dir)  # the next writer
    assert not any(p.exists() for p in leftovers)
    assert sess.ortmem_report is not None
    assert_same_outputs(sess.run(None, FEEDS), run_plain(path, FEEDS))


# ------------------------------------------- every cache file checked, smaller faults
#: Every file a warm start reads from an entry ORT finished (besides ``source-*`` links).
#: ``test_every_entry_file_is_in_the_trust_matrix`` fails when an entry gains a file not listed here.
ENTRY_FILES = ("manifest.json", "model.onnx", "weights.bin", f"{DEFAULT_STEM}.onnx",
               f"{DEFAULT_STEM}.data", f"{DEFAULT_STEM}.json")
_OWNER_WAYS = ["fake", pytest.param("chown", marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root"))]
#: Another user's uid (``nobody``, unless the tests run as ``nobody``).
OTHER_UID = 65534 if os.geteuid() != 65534 else 65533


def _prepacked_entry(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(model, cache, entry): the entry built, finished by ORT in the background and used once."""
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(scan.MIN_BYTES_ENV, "0")
        _finish(ortmem.InferenceSession(path, cache=cache))
    warm = ortmem.InferenceSession(path, cache=cache)
    assert warm.ortmem_cache_hit and Path(warm.ortmem_handoff.model).name == f"{DEFAULT_STEM}.onnx"
    return path, cache, _entry_dir(warm)


def _refused_then_rebuilt(path: Path, cache: Path, name: str, why: str, caplog) -> None:
    """The next start refuses the tampered entry (one warning naming the file and why), converts
    afresh with ORT's outputs, and the start after it is warm again on private files."""
    expected = run_plain(path, FEEDS)
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(path, cache=cache)
    assert not sess.ortmem_cache_hit and sess.ortmem_report is not None, f"a tampered {name} was used"
    assert any(f"{name} {why}" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert_same_outputs(sess.run(None, FEEDS), expected)


def _warm_again(path: Path, cache: Path) -> None:
    """The start after a rebuild loads the new entry, whose first run has it finished; the start after
    that is warm on ORT's finished model, every file private."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(scan.MIN_BYTES_ENV, "0")
        warm = ortmem.InferenceSession(path, cache=cache)
        if Path(warm.ortmem_handoff.model).name != f"{DEFAULT_STEM}.onnx":
            _finish(warm)
            warm = ortmem.InferenceSession(path, cache=cache)
    entry = _entry_dir(warm)
    assert warm.ortmem_cache_hit and Path(warm.ortmem_handoff.model).name == f"{DEFAULT_STEM}.onnx"
    for name in ENTRY_FILES:
        assert untrusted_reason(entry / name) is None, name
    assert_same_outputs(warm.run(None, FEEDS), run_plain(path, FEEDS))


@needs_saving
def test_every_entry_file_is_in_the_trust_matrix(tmp_path):
    """A new kind of file in an entry must be added to ENTRY_FILES, and so to the tests below."""
    _, _, entry = _prepacked_entry(tmp_path)
    names = {p.name for p in entry.iterdir() if not p.name.startswith(SOURCE_LINK_PREFIX)}
    assert names == set(ENTRY_FILES)


@needs_saving
@pytest.mark.parametrize("name", ENTRY_FILES)
@pytest.mark.parametrize("way", _OWNER_WAYS)
def test_an_entry_file_of_another_owner_is_refused(tmp_path, monkeypatch, caplog, name, way):
    """Issue 20, finding 5: pre-packed files owned by another user were used. Without root, the file
    gets a fake owner through the one function every trust check reads owners with."""
    path, cache, entry = _prepacked_entry(tmp_path)
    target = entry / name
    with monkeypatch.context() as m:
        if way == "chown":
            os.chown(target, OTHER_UID, OTHER_UID)
        else:
            st = target.lstat()
            m.setattr(trust, "owner_uid",
                      lambda s: OTHER_UID if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino) else s.st_uid)
        _refused_then_rebuilt(path, cache, name, f"is owned by uid {OTHER_UID}", caplog)
    _warm_again(path, cache)


def _writable_by_others(target: Path, spare: Path) -> str:
    os.chmod(target, 0o666)
    return "is writable by group or others"


def _symlink_to_a_copy(target: Path, spare: Path) -> str:
    """``target`` replaced by a symbolic link to an identical copy: only the link gives it away."""
    shutil.copy2(target, spare / target.name)
    target.unlink()
    target.symlink_to(spare / target.name)
    return "is a symbolic link"


@needs_saving
@pytest.mark.parametrize("name", ENTRY_FILES + ("source-",))
@pytest.mark.parametrize("tamper", [_writable_by_others, _symlink_to_a_copy], ids=["mode-0666", "symlink"])
def test_an_entry_file_others_may_write_or_a_symlink_is_refused(tmp_path, caplog, name, tamper):
    """Issue 20, finding 5: pre-packed files with mode 0666 were used."""
    path, cache, entry = _prepacked_entry(tmp_path)
    target = next(p for p in sorted(entry.iterdir()) if p.name.startswith(name))
    data = next(p for p in path.parent.iterdir() if p != path)  # what source-* links are
    before = stat.S_IMODE(data.stat().st_mode)
    (tmp_path / "spare").mkdir()
    why = tamper(target, tmp_path / "spare")
    try:
        _refused_then_rebuilt(path, cache, target.name, why, caplog)
    finally:
        os.chmod(data, before)  # a source-* link is the user's own model file
    _warm_again(path, cache)


def test_a_users_world_writable_cache_dir_is_left_alone_and_not_used(tmp_path, monkeypatch, caplog):
    """Issue 20, finding 8: a user's own 0777 ORTMEM_CACHE_DIR was silently made 0700. It keeps its
    mode; without the sticky bit others could swap what is in it, so it is not used: one warning,
    conversion in memory, nothing created in it."""
    root = tmp_path / "mine"
    root.mkdir()
    os.chmod(root, 0o777)
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(root))
    path = tiny_decoder(tmp_path / "m", storage="external")
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(path)
    assert stat.S_IMODE(root.stat().st_mode) == 0o777
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "without the sticky bit" in warnings[0], warnings
    assert sess.ortmem_report is not None and not sess.ortmem_cache_hit
    assert list(root.iterdir()) == []
    assert_same_outputs(sess.run(None, FEEDS), run_plain(path, FEEDS))


def test_a_sticky_world_writable_cache_dir_is_used_through_a_private_folder(tmp_path, monkeypatch):
    """With the sticky bit (as /tmp has) nobody can rename or remove another's files: ortmem keeps its
    entries in the private folder it creates there, and leaves the folder's own mode alone."""
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(root))
    path = tiny_decoder(tmp_path / "m", storage="external")
    ortmem.InferenceSession(path)
    assert stat.S_IMODE(root.stat().st_mode) == 0o1777
    assert stat.S_IMODE((root / "converted").stat().st_mode) == 0o700
    again = ortmem.InferenceSession(path)
    assert again.ortmem_cache_hit and _entry_dir(again).parent == root / "converted"
    assert_same_outputs(again.run(None, FEEDS), run_plain(path, FEEDS))


@pytest.mark.parametrize("mode", [0o757, 0o775], ids=oct)
def test_a_cache_dir_others_or_group_may_write_without_the_sticky_bit_is_not_used(mode, tmp_path, monkeypatch, caplog):
    """Others (0o757: not the group) or the group alone (0o775) may rename what is in the folder: it is
    not used, one warning names the sticky bit, and the session converts without it."""
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(root))
    path = tiny_decoder(tmp_path / "m", storage="external")
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "without the sticky bit" in warnings[0], warnings
    assert not sess.ortmem_cache_hit and list(root.iterdir()) == []
    assert_same_outputs(sess.run(None, FEEDS), run_plain(path, FEEDS))
    with pytest.raises(UntrustedCacheError, match="sticky"):
        Cache(root / "converted")


def test_a_sticky_cache_dir_others_may_write_is_used(tmp_path, monkeypatch):
    """0o1757: others may write, the sticky bit keeps them from renaming ortmem's folder."""
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1757)
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(root))
    path = tiny_decoder(tmp_path / "m", storage="external")
    ortmem.InferenceSession(path)
    again = ortmem.InferenceSession(path)
    assert again.ortmem_cache_hit and _entry_dir(again).parent == root / "converted"
    assert_same_outputs(again.run(None, FEEDS), run_plain(path, FEEDS))


def _hold_lock(cache_dir: Path, key: str) -> subprocess.Popen:
    """A process that takes ``key``'s creator lock as a creator does and keeps it until stopped."""
    Cache(cache_dir)
    child = subprocess.Popen([sys.executable, "-c", r"""
import sys, time
from pathlib import Path
from ortmem.store.cache import Cache
with Cache(Path(sys.argv[1])).creating(sys.argv[2]):
    print("locked", flush=True)
    time.sleep(120)
""", str(cache_dir), key], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(timeout=30)


def test_a_lock_left_by_a_killed_creator_is_pruned(tmp_path):
    """Issue 20, finding 8: a creator killed after publishing left ``.lock-<key>`` for good (and with
    it, later's sign that packing is under way): prune removes a lock file nobody holds."""
    cache_dir = tmp_path / "cache"
    lock = creator_lock_path(cache_dir, "k" * 32)
    child = _hold_lock(cache_dir, "k" * 32)
    try:
        os.kill(child.pid, 9)
    finally:
        _stop(child)
    assert lock.exists()  # what the kill leaves
    Cache(cache_dir).prune(2**40)
    assert not lock.exists()


def test_a_lock_a_live_process_holds_survives_prune_and_clear(tmp_path):
    """Removing a held lock's file would let a second creator in beside the first."""
    cache_dir = tmp_path / "cache"
    lock = creator_lock_path(cache_dir, "k" * 32)
    child = _hold_lock(cache_dir, "k" * 32)
    try:
        Cache(cache_dir).prune(2**40)
        Cache(cache_dir).clear()
        assert lock.exists(), "a live creator's lock was removed"
    finally:
        _stop(child)


def test_prune_reports_the_crash_leftovers_it_frees(tmp_path, monkeypatch, capsys):
    """Issue 20, finding 8: prune said "0.0 MiB freed" after removing 200 MiB of crash leftovers."""
    import re

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "root"))
    entry = _entry_dir(ortmem.InferenceSession(tiny_decoder(tmp_path / "m", storage="external")))
    dead = 2**22 + 12345  # above pid_max's default: no such process
    old = time.time() - 3600
    leftovers = {entry.parent / f".tmp-{dead}-ab12" / "weights.bin": 8 << 20,
                 entry / f".{layout.FINISHED_STEM}.json.{dead}-ef56": 4 << 20}
    for f, size in leftovers.items():
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"\x01" * size)
        os.utime(f, (old, old))
        os.utime(f.parent, (old, old))
    assert cli_main(["cache", "prune", "--max-size", "1GiB"]) == 0
    freed = float(re.search(r"\(([\d.]+) MiB freed\)", capsys.readouterr().out).group(1))
    assert not any(f.exists() for f in leftovers) and entry.exists()
    assert 12.0 <= freed < 12.5
