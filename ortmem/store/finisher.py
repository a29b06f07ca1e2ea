"""Finish a cache entry in a background process after a session's first run, so later starts are warm.

Why
---
A warm start maps what ORT finished: ORT's finished model of the entry (the optimized graph, every
weight its optimizers made and its pre-packed buffers, :mod:`ortmem.store.finished`), which a throw-away
session saves and a second one checks. Where that work runs decides which start pays for it:

- in the cold start, before or during its session: it would stack on the session's creation peak
  (a session that saves keeps every initializer and every packed buffer alive at once) and compete
  with ORT for this machine's cores, and the cold start would miss "never slower than ORT";
- in a later start: that start would be slow, and only the one after it warm.

So the session hands the work to a separate, niced process (``python -m ortmem.store.finisher``) once
it has finished its **first run** (the first request answered; the first run allocates the session's
activations, later runs reuse them). A cold start leaves it for its new converted entry; a hit on a
converted entry not finished yet for the caller's settings leaves it too (``kind="converted"``,
:func:`ortmem.store.finished_entries.finish_converted`); a model ortmem does not convert, started from
its path on the CPU EP, gets its finished entry built the same way (``kind="finished"``,
:mod:`ortmem.store.finished_entries`; its key is computed by the starter and checked again by the job
from the source as it is then: a source changed in between gets no entry under the old key).

One job per entry, whatever the process layout: the process whose session ran takes the entry's
creator lock (:meth:`ortmem.store.cache.Cache.creating`) without waiting *before* it starts the job and
hands the locked descriptor to it, so the job holds the lock from its first instruction to its exit.
Workers forked after ``--preload`` inherit the pending job, and each one's first run tries that lock:
one wins, the others find it taken (or the work published) and start nothing. Separate servers on
one cache meet at the same lock. A start that arrives while the job works never waits for it: it
loads the converted entry at once. If the job fails or is killed, nothing is published (the finished
model's manifest goes last), the kernel releases its lock, and a later first run tries again. Its
memory is its own process's, returned whole when it exits: on the demo model (onnxruntime 1.32.0,
``/usr/bin/time -v python -m ortmem.store.finisher ...``) it peaks at 746 MiB for 12 s, where the
native twin's creation peaks at 508 MiB.

Below :func:`ortmem.onnxfile.scan.min_finished_bytes` of weights no process is started: what mapping
saves there costs less than starting a Python interpreter with onnxruntime.
"""
from __future__ import annotations

import _thread
import json
import os
import sys
import time
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional

from ortmem.base import logs
from ortmem.base.records import record

from ortmem.store.cache import (
    Cache,
    LockBusyError,
    acquire_creator_lock,
    creator_lock_path,
    release_creator_lock,
)
from ortmem.base.child_env import helper_environment
from ortmem.onnxfile.scan import min_finished_bytes
from ortmem.ort.settings import OrtSettings
from ortmem.files.layout import MANIFEST, WEIGHTS_FILE
from ortmem.files.trust import RACY_SECONDS
from ortmem.store.finished import finished_for, finished_problem
from ortmem.store.finished_entries import (build_finished, finish_converted, finished_stem, finishing_settings, lookup_finished, finished_key, settings_of_record)

if TYPE_CHECKING:  # imported when a job is started or waited for: a start that leaves one imports neither
    import subprocess

#: Converted weights (``weights.bin``) below which the first cache hit packs in its own process.
#: A finisher process costs about 0.3 s of CPU and 60 MiB to start (Python, onnxruntime, onnx).
MIN_WEIGHT_BYTES = 32 * 1024 * 1024
#: Niceness added in the finisher: the user's sessions come first on a busy machine.
NICENESS = 10

_started: list[subprocess.Popen] = []
#: ``threading.Lock`` without importing :mod:`threading` (its reaper thread imports it when a job starts).
_lock = _thread.allocate_lock()


def _forget_parents_finishers() -> None:
    """In a forked child: the parent's finishers are not this process's to count or wait for, and a
    lock some other thread of the parent held at the fork would never be released here."""
    global _lock
    _lock = _thread.allocate_lock()
    _started.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_finishers)


@record
class FinishLater:
    """Work left for after a session's first run (a start's ``later``): what the finisher needs to finish
    one entry, where it is, and the options finishing depends on. A record, and this module imports
    neither :mod:`subprocess`, :mod:`threading` nor :mod:`logging` until a job starts: every first
    start that leaves one makes it during the session's creation."""

    cache_root: str
    key: str
    verify: str = "full"
    config: Mapping[str, str] = MappingProxyType({})
    intra_op_num_threads: int = 0
    #: In the finisher: the descriptor of the entry's creator lock, locked by the process that started it.
    lock_fd: Optional[int] = None
    #: "converted": ORT's finished model of a converted entry, kept in the entry
    #: (:func:`ortmem.store.finished_entries.finish_converted`); "finished": a finished entry of ``source``.
    kind: str = "converted"
    #: "finished": the model file. Both kinds: the settings the model is finished at (level, config,
    #: disabled optimizers, conversion enabled: :func:`ortmem.store.finished_entries.settings_record`); a
    #: finished entry's key is checked against the source as it is when the finisher runs.
    source: str = ""
    settings: Mapping = MappingProxyType({})

    def done(self) -> bool:
        """Whether the work is already published (the finished entry, or a converted entry's finished model
        for these settings, or the decision that none is worth mapping)."""
        entry = Path(self.cache_root) / self.key
        if self.kind == "finished":
            return (entry / MANIFEST).exists()
        settings = self.finishing()
        return finished_for(entry, finished_stem(settings), settings) is not None

    def _worth_a_process(self) -> bool:
        """A converted entry is finished only in a cache that can be written, and only where its weights
        are worth a process (:func:`ortmem.onnxfile.scan.min_finished_bytes`; a finished entry's starter
        decided both already)."""
        if self.kind == "finished":
            return True
        try:
            weights = (Path(self.cache_root) / self.key / WEIGHTS_FILE).stat().st_size
        except OSError:
            return False
        return weights >= min_finished_bytes() and os.access(self.cache_root, os.W_OK)

    def as_json(self, lock_fd: Optional[int] = None) -> str:
        """The job as the finisher process reads it (:func:`main`), handed the lock ``lock_fd``."""
        return json.dumps({**self._asdict(), "config": dict(self.config), "settings": dict(self.settings),
                           "lock_fd": lock_fd})

    def finishing(self) -> OrtSettings:
        """The settings a converted entry is finished at."""
        return finishing_settings(settings_of_record(self.settings)[0], self.config)

    def start(self) -> Optional[subprocess.Popen]:
        """Start the finisher (detached; reaped by a daemon thread) holding the entry's creator lock;
        None when the entry is already packed, another process holds the lock (packing it, or
        starting a finisher: workers forked after a ``--preload`` share this job), or the process
        cannot be started (logged: the next start packs then)."""
        if self.done() or not self._worth_a_process():
            return None
        lock = creator_lock_path(Path(self.cache_root), self.key)
        try:
            fd = acquire_creator_lock(lock, 0)  # the claim: never waits (-1: no flock on this filesystem)
        except LockBusyError:
            return None
        proc = None
        try:
            if not self.done():  # not published while we took the lock
                proc = self._spawn(fd)
        finally:
            if proc is None or fd < 0:
                release_creator_lock(lock, fd)
            else:
                os.close(fd)  # the finisher's copy holds the lock now; it removes the file when done
        if proc is not None:
            import threading

            with _lock:
                _started.append(proc)  # a process starts one per cold start: kept for wait_background
            threading.Thread(target=proc.wait, name="ortmem-prepack-reaper", daemon=True).start()
            logs.info(__name__, "ortmem: packing ORT's weights for %s in the background (pid %d)", self.key, proc.pid)
        return proc

    def _spawn(self, lock_fd: int) -> Optional[subprocess.Popen]:
        """The finisher process, given ``lock_fd`` (the locked creator lock; -1: none) under the same number."""
        import subprocess

        env = helper_environment()  # unhooked, this very ortmem; its job is the user's cache entry
        passed = (lock_fd,) if lock_fd >= 0 else ()
        try:
            return subprocess.Popen([sys.executable, "-m", __name__, self.as_json(lock_fd if passed else None)],
                                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, close_fds=True, pass_fds=passed,
                                    start_new_session=True)
        except OSError as exc:
            logs.info(__name__, "ortmem: could not start the background finisher (%s); the next start packs", exc)
            return None


def started_finishers() -> list[int]:
    """The process ids of the finishers this process has started."""
    with _lock:
        return [p.pid for p in _started]


def wait_background(timeout: Optional[float] = None) -> bool:
    """Wait for every finisher this process started; True when none is still running. For benchmarks
    and tests that must not leave one running into the next measurement (users need not call it)."""
    with _lock:
        procs = list(_started)
    if not procs:
        return True
    import subprocess

    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
    return True


def run(job: FinishLater) -> Optional[Path]:
    """The finisher's work (in the background process): under the entry's creator lock (handed over by
    its starter, else taken here without waiting), check the entry in full, then save its pre-packed
    weights unless another process already did. Another holder of the lock means another process is
    packing the entry: this one stops at once."""
    if not Path(job.cache_root).is_dir():  # cleared meanwhile (lock file and all): create nothing
        return None
    cache = Cache(Path(job.cache_root), verify=job.verify)
    try:  # an entry cleared meanwhile is seen under the lock, which is then let go and its file removed
        with cache.creating(job.key, timeout=0, inherited_fd=job.lock_fd):
            path = _build(cache, job) if job.kind == "finished" else _finish(cache, job)
    except LockBusyError as exc:
        logs.info(__name__, "ortmem: not packing %s: another process is (%s)", job.key, exc)
        return None
    if path is not None:
        cache.enforce_limit(keep=job.key)  # the entry just grew
        _check_for_next_start(cache, job)
    return path


def _check_for_next_start(cache: Cache, job: FinishLater) -> None:
    """Check the entry (and its pre-packed files) in full once what was just written is older than
    :data:`ortmem.files.trust.RACY_SECONDS`, so the stamps this leaves (:mod:`ortmem.files.stamps`)
    spare the next start reading every byte again: without them the second start digested about 3 GB
    of the 0.6 GB synthetic Llama's entry, 1-1.5 s, more than half of ORT's own creation. Niced and
    after the session's first run, like the packing itself; a check that fails changes nothing (the
    next start finds the same damage and rebuilds)."""
    if job.verify != "full":  # only "full" starts use stamps ("sampled"/"off" read less, "always" reads anyway)
        return
    entry = cache.entry(job.key)
    try:
        newest = max(f.stat(follow_symlinks=False).st_ctime_ns for f in entry.path.iterdir())
    except (OSError, ValueError):
        return
    wait = RACY_SECONDS - (time.time_ns() - newest) / 1e9
    if wait > 0:
        time.sleep(wait + 0.05)
    if cache.verify(entry, mode="full") is None and job.kind != "finished":
        finished_problem(entry.path, finished_stem(job.finishing()), mode="full")


def _finish(cache: Cache, job: FinishLater) -> Optional[Path]:
    """:func:`run`'s work for a converted entry once it holds the lock: ORT's finished model of it,
    unless the entry is gone."""
    entry = cache.entry(job.key)
    if not entry.model_path.is_file():
        return None
    return finish_converted(cache, entry, job.finishing(), threads=job.intra_op_num_threads)


def _build(cache: Cache, job: FinishLater) -> Optional[Path]:
    """:func:`run`'s work for a finished entry, under its lock: nothing when it exists, or when the
    source changed since the starter computed the key (a later start computes the new one)."""
    if lookup_finished(cache, job.key) is not None:
        return None
    settings, converting = settings_of_record(job.settings)
    source = Path(job.source)
    if finished_key(source, settings, job.config, converting) != job.key:
        logs.info(__name__, "ortmem: %s changed since its start; not finishing it under the old key", source)
        return None
    entry, _ = build_finished(cache, source, job.key, packing=job.config, threads=job.intra_op_num_threads,
                              settings=settings)
    return entry.path


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ortmem.store.finisher '<FinishLater as JSON>'``."""
    args = sys.argv[1:] if argv is None else argv
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    try:
        run(FinishLater(**json.loads(args[0])))
    except Exception as exc:  # noqa: BLE001 - a failed finisher publishes nothing; the next start packs
        logs.warning(__name__, "ortmem: background packing failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
