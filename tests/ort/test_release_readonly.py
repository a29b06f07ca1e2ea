"""A cache deployed read-only meets an onnxruntime upgrade: ``ortmem prepare`` ran with the previous
release, the cache folder was then mounted read-only (or belongs to a user the serving process is not),
and the serving processes run a release nobody has probed into it yet.

Each start must still be a session with plain ORT's outputs; the probe runs once per release and boot
(its answers kept in a private runtime folder when the cache's probe folder cannot take them), with
one notice; the entry the upgrade made stale is named once per process with the command that
rebuilds it; and no ``OSError`` reaches the caller.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import onnxruntime as ort
import pytest

from ortmem.ort import release as rel
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.compare import assert_same_outputs
from tests.support.reference import run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
#: The release the cache was prepared with: a pre-release of the installed one (same table row, so
#: nothing but the upgrade differs).
PREVIOUS = f"{ort.__version__}.dev0"
NOBODY = 65534

#: `ortmem prepare MODEL` with the previous onnxruntime. Its probe's answers are this build's (read
#: from a file: the probe's questions do not depend on the version string), so no second probe runs.
PREPARE = r"""
import json, sys
import onnxruntime as ort
ort.__version__ = sys.argv[2]
from ortmem.ort import release as rel
with open(sys.argv[3]) as f:
    answers = json.load(f)
rel.run_probe = lambda *a, **k: answers
from ortmem.cli import main
sys.exit(main(["prepare", sys.argv[1]]))
"""

#: A serving process: two sessions of the model, their outputs saved; each real probe it runs is
#: counted on stderr.
SERVE = r"""
import json, sys
import numpy as np
from ortmem.ort import release as rel
real = rel.run_probe
def counted(*args, **kwargs):
    print("test: the probe ran", file=sys.stderr, flush=True)
    return real(*args, **kwargs)
rel.run_probe = counted
import ortmem
feeds = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
sessions = [ortmem.InferenceSession(sys.argv[1]) for _ in range(2)]
np.savez(sys.argv[2], *[out for s in sessions for out in s.run(None, feeds)])
print(json.dumps([s.ortmem_action for s in sessions]))
"""


def _read_only_mount(folder: Path) -> Optional[list[str]]:
    """A command prefix that runs a child with ``folder`` mounted read-only in a private mount
    namespace (even root gets EROFS), or None where this machine cannot."""
    if shutil.which("unshare") is None:
        return None
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    prefix = ["unshare", "-m"] + ([] if os.geteuid() == 0 else ["-r"]) + ["sh", "-c", script, str(folder)]
    probe = subprocess.run(prefix + ["touch", str(folder / ".w")], capture_output=True)
    written = (folder / ".w").exists()
    (folder / ".w").unlink(missing_ok=True)
    return None if written or b"Read-only" not in probe.stderr else prefix


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setgroups([])
    os.setuid(NOBODY)


def _nobody_can_run_python(base: Path) -> bool:
    """Whether a process switched to uid 65534 can import ortmem and start this interpreter (it must,
    for the probe): not where the interpreter lives in root's private home."""
    check = "import subprocess, sys, ortmem.session.inference; subprocess.run([sys.executable, '-c', 'import json'], check=True)"
    try:
        r = subprocess.run([sys.executable, "-c", check], capture_output=True, cwd=base, preexec_fn=_as_nobody,
                           env={**os.environ, "HOME": str(base)})
    except OSError:  # the interpreter itself cannot be started by that user
        return False
    return r.returncode == 0


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder another user may be given (not under the test run's private temporary folder)."""
    folder = Path(tempfile.mkdtemp(prefix="ortmem-readonly-"))
    yield folder
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o700)
    shutil.rmtree(folder)


def _read_only(how: str, base: Path, cache: Path) -> tuple[list[str], Optional[Callable[[], None]]]:
    """(command prefix, preexec function) that run a child for which ``cache`` is read-only, made so
    by ``how``; skips where this machine cannot."""
    if how == "read-only mount":
        prefix = _read_only_mount(cache)
        if prefix is None:
            pytest.skip("no read-only bind mount here (unshare -m and mount need CAP_SYS_ADMIN or a user namespace)")
        return prefix, None
    # permissions: the cache's owner has no write permission, and the child is not root
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(cache)], check=True)
        return [], None
    for p in [base, *base.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    subprocess.run(["chmod", "-R", "a-w", str(cache)], check=True)
    if not _nobody_can_run_python(base):
        pytest.skip("as root the cache is read-only only to another user, and uid 65534 cannot run this interpreter")
    return [], _as_nobody


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("how", ["read-only mount", "permissions"])
def test_an_upgrade_under_a_read_only_cache_probes_once_per_boot_and_names_the_stale_entry(base, how):
    (base / "m").mkdir()
    model = write_model(SynthConfig.tiny(storage="external"), base / "m" / "model.onnx")
    cache, tmp = base / "cache", base / "tmp"
    tmp.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("ORTMEM_PROBE_DIR", "XDG_RUNTIME_DIR")}
    env.update(ORTMEM_CACHE_DIR=str(cache), TMPDIR=str(tmp), HOME=str(base))
    rel.capabilities()  # this build's answers, in the test run's probe folder
    answers = base / "answers.json"
    shutil.copyfile(rel.probe_dir() / f"{rel.installed().key()}.json", answers)
    prepared = subprocess.run([sys.executable, "-c", PREPARE, str(model), PREVIOUS, str(answers)], env=env,
                              capture_output=True, text=True)
    assert prepared.returncode == 0, prepared.stderr
    kept = sorted(p.name for p in (cache / ".release-probes").iterdir())
    # the previous release's answers and its config keys (ortmem prepare reads them for serving processes)
    assert len(list((cache / "converted").iterdir())) == 1 and len(kept) == 2, kept
    assert len([n for n in kept if n.endswith(rel.CONFIG_KEYS_SUFFIX)]) == 1, kept

    prefix, preexec = _read_only(how, base, cache)
    before = _tree(cache)
    expected = run_plain(model, FEEDS)
    runs, stamps = [], []
    for i in range(2):
        out = tmp / f"out-{i}.npz"
        r = subprocess.run(prefix + [sys.executable, "-c", SERVE, str(model), str(out)], env=env, cwd=base,
                           capture_output=True, text=True, preexec_fn=preexec)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        with np.load(out) as saved:
            got = [saved[f"arr_{k}"] for k in range(len(saved.files))]
        assert_same_outputs(got[:len(expected)], expected, "first session")
        assert_same_outputs(got[len(expected):], expected, "second session")
        runs.append(r.stderr)
        stamps.append({str(p): p.stat().st_mtime_ns for p in tmp.glob(f"{rel.RUNTIME_PROBE_FOLDER}-*/*.json")})
    first, second = runs
    # the first process probes the new release once and says once where its answers went
    assert first.count("test: the probe ran") == 1, first
    assert first.count("could not be kept") == 1 and "until the machine restarts" in first, first
    assert len([p for p in stamps[0] if not p.endswith(rel.CONFIG_KEYS_SUFFIX)]) == 1, stamps  # and the build's keys
    # the second process on the same release and boot reads them: no probe, no notice, file untouched
    assert second.count("test: the probe ran") == 0 and "could not be kept" not in second, second
    assert stamps[1] == stamps[0]
    # each process names the entry the upgrade made stale once, with the command that rebuilds it
    for stderr in runs:
        assert stderr.count(f"made with onnxruntime {PREVIOUS}, not {ort.__version__}") == 1, stderr
        assert f"`ortmem prepare {model}`" in stderr, stderr
    assert _tree(cache) == before


def test_answers_with_nowhere_to_go_last_the_process_with_one_notice(tmp_path, monkeypatch, fresh_capabilities):
    """No probe folder can be made (its place is a file) and no runtime folder either (the system temp
    folder is another user's in the real case; none here): the start still works, one notice says the
    answers last this process, and the process does not probe again."""
    rel.capabilities()
    answers = json.loads((rel.probe_dir() / f"{rel.installed().key()}.json").read_text())
    rel._current = None
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ORTMEM_PROBE_DIR", str(tmp_path / "a-file" / "probes"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    calls = []
    monkeypatch.setattr(rel, "run_probe", lambda *a, **k: calls.append(1) or answers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = rel.capabilities()
        second = rel.capabilities()
    notices = [str(w.message) for w in seen if "could not be kept" in str(w.message)]
    assert len(notices) == 1 and "in this process only" in notices[0], notices
    assert calls == [1] and first is second and first.convert


def test_the_runtime_folder_is_private_and_refused_when_others_may_write_it(tmp_path, monkeypatch):
    """The runtime folder is created 0700; one that exists writable by others is not used."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = rel.runtime_probe_dir()
    assert folder == tmp_path / f"{rel.RUNTIME_PROBE_FOLDER}-{os.geteuid()}"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    os.chmod(folder, 0o777)
    assert rel.runtime_probe_dir() is None
    # answers of this release are named by the boot: a restart never reads a previous boot's
    from ortmem.files.stamps import boot_id

    if boot_id():
        name = rel.runtime_answers_path(folder, rel.installed()).name
        monkeypatch.setattr(rel, "boot_id", lambda: "another boot")
        assert rel.runtime_answers_path(folder, rel.installed()).name != name
