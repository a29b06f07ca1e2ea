"""Save a fresh cache entry's pre-packed weights in a background process, so the second start is warm.

Why
---
A cold start converts the model into a cache entry and creates ORT's session on it; ORT packs every
MatMulNBits ``B`` on the heap. Mapped pre-packed weights (:mod:`ortmem.store.prepacked`) need a second
packing into ``prepacked.bin``, written beside the entry. Where that packing runs decides which start
pays for it:

- in the cold start, before its session: measured on the demo model (onnxruntime 1.32.0) the first
  hit that packs takes 2.44 s against the cold start's 1.13 s and ORT's 1.59 s on the QDQ model, so
  the cold start would miss "never slower than ORT";
- in the cold session itself (``session.save_external_prepacked_constant_initializers``): ORT then
  writes every initializer again beside the blobs and keeps them all alive (1.45x the twin's peak
  on the demo model, ``ortmem.store.prepacked``);
- in the first cache hit (what ortmem did before): that start is warm in memory but slow, and only
  the third start is a fast warm one.

So the cold start hands the packing to a separate, niced process (``python -m
ortmem.store.packer``) once its session has finished its **first run**: not during creation (it
would stack on the session's creation peak and compete with ORT for this machine's cores) and not
before the first request is answered (the first run allocates the session's activations; later runs
reuse them).

One packer per entry, whatever the process layout: the process whose session ran takes the entry's
creator lock (:meth:`ortmem.store.cache.Cache.creating`) without waiting *before* it starts the packer and
hands the locked descriptor to it, so the packer holds the lock from its first instruction to its
exit. Workers forked after ``--preload`` inherit the cold start's pending packing, and each one's
first run tries that lock: one wins, the others find it taken (or ``prepacked.json`` published) and
start nothing. Separate servers on one cache meet at the same lock. A second start that arrives
while the packer works never waits for it: it loads the entry itself at once (ORT packs on its heap,
as a plain cache hit), which is faster than waiting for a niced packer; one that arrives before the
lock was taken packs itself under it, and the packer then finds the files and stops. If the packer
fails or is killed, nothing is published (``prepacked.json`` goes last), the kernel releases its lock,
and the next start packs, as before. Its memory is its own process's: the fixed cost of
Python with onnxruntime plus one group of ``B`` (``ortmem.store.prepacked.DEFAULT_GROUP_BYTES``), returned
whole when it exits: 167 MiB at its peak for 1.6 s on the demo model (onnxruntime 1.32.0,
``/usr/bin/time -v python -m ortmem.store.packer ...``), where the session itself peaks at 524 MiB.

Below :data:`MIN_WEIGHT_BYTES` of converted weights no process is started: the first hit packs so
little that its own packing costs less than starting a Python interpreter with onnxruntime.

The same process, lock and rules build a model's *prepared* entry (``kind="prepared"``,
:mod:`ortmem.store.prepared_entries`): a model ortmem does not convert, started from its path on the CPU EP,
gets ORT's pre-packed weights of every kernel saved into a cache entry of its own after its first run,
so the next start maps them. Its key is computed by the starter and checked again by the packer from
the source as it is then: a source changed in between gets no entry under the old key.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import onnxruntime as ort

from .cache import (
    Cache,
    LockBusyError,
    acquire_creator_lock,
    creator_lock_path,
    release_creator_lock,
)
from ..helper_env import helper_environment
from .layout import MANIFEST, PREPACKED_MANIFEST
from .prepacked import prepacked_model, save_prepacked, verify_prepacked
from .trust import RACY_SECONDS
from .prepared_entries import build_prepared, lookup_prepared, prepared_key, settings_of_record

log = logging.getLogger(__name__)

#: Converted weights (``weights.bin``) below which the first cache hit packs in its own process.
#: A packer process costs about 0.3 s of CPU and 60 MiB to start (Python, onnxruntime, onnx).
MIN_WEIGHT_BYTES = 32 * 1024 * 1024
#: Niceness added in the packer: the user's sessions come first on a busy machine.
NICENESS = 10

_started: list[subprocess.Popen] = []
_lock = threading.Lock()


def _forget_parents_packers() -> None:
    """In a forked child: the parent's packers are not this process's to count or wait for, and a
    lock some other thread of the parent held at the fork would never be released here."""
    global _lock
    _lock = threading.Lock()
    _started.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_packers)


@dataclass
class PrepackLater:
    """What the packer needs to pack one entry: where it is, and the options packing depends on."""

    cache_root: str
    key: str
    verify: str = "full"
    config: dict[str, str] = field(default_factory=dict)
    intra_op_num_threads: int = 0
    #: In the packer: the descriptor of the entry's creator lock, locked by the process that started it.
    lock_fd: Optional[int] = None
    #: "prepacked": a converted entry's pre-packed files; "prepared": a prepared entry of ``source``.
    kind: str = "prepacked"
    #: "prepared": the model file, and the key parts :func:`ortmem.store.prepared_entries.prepared_key` takes
    #: (level, config, disabled optimizers, conversion enabled), to check ``key`` against the source as
    #: it is when the packer runs.
    source: str = ""
    settings: dict = field(default_factory=dict)

    def done(self) -> bool:
        """Whether the work is already published (the pre-packed manifest, or the prepared entry)."""
        entry = Path(self.cache_root) / self.key
        return (entry / (MANIFEST if self.kind == "prepared" else PREPACKED_MANIFEST)).exists()

    def start(self) -> Optional[subprocess.Popen]:
        """Start the packer (detached; reaped by a daemon thread) holding the entry's creator lock;
        None when the entry is already packed, another process holds the lock (packing it, or
        starting a packer: workers forked after a ``--preload`` share this job), or the process
        cannot be started (logged: the next start packs then)."""
        if self.done():
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
                os.close(fd)  # the packer's copy holds the lock now; it removes the file when done
        if proc is not None:
            with _lock:
                _started.append(proc)  # a process starts one per cold start: kept for wait_background
            threading.Thread(target=proc.wait, name="ortmem-prepack-reaper", daemon=True).start()
            log.info("ortmem: packing ORT's weights for %s in the background (pid %d)", self.key, proc.pid)
        return proc

    def _spawn(self, lock_fd: int) -> Optional[subprocess.Popen]:
        """The packer process, given ``lock_fd`` (the locked creator lock; -1: none) under the same number."""
        env = helper_environment()  # unhooked, this very ortmem; its job is the user's cache entry
        passed = (lock_fd,) if lock_fd >= 0 else ()
        job = json.dumps({**asdict(self), "lock_fd": lock_fd if passed else None})
        try:
            return subprocess.Popen([sys.executable, "-m", __name__, job], env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                    pass_fds=passed, start_new_session=True)
        except OSError as exc:
            log.info("ortmem: could not start the background packer (%s); the next start packs", exc)
            return None


def started_packers() -> list[int]:
    """The process ids of the packers this process has started."""
    with _lock:
        return [p.pid for p in _started]


def wait_background(timeout: Optional[float] = None) -> bool:
    """Wait for every packer this process started; True when none is still running. For benchmarks
    and tests that must not leave one running into the next measurement (users need not call it)."""
    with _lock:
        procs = list(_started)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
    return True


def run(job: PrepackLater) -> Optional[Path]:
    """The packer's work (in the background process): under the entry's creator lock (handed over by
    its starter, else taken here without waiting), check the entry in full, then save its pre-packed
    weights unless another process already did. Another holder of the lock means another process is
    packing the entry: this one stops at once."""
    if not Path(job.cache_root).is_dir():  # cleared meanwhile (lock file and all): create nothing
        return None
    cache = Cache(Path(job.cache_root), verify=job.verify)
    try:  # an entry cleared meanwhile is seen under the lock, which is then let go and its file removed
        with cache.creating(job.key, timeout=0, inherited_fd=job.lock_fd):
            path = _prepare(cache, job) if job.kind == "prepared" else _pack(cache, job)
    except LockBusyError as exc:
        log.info("ortmem: not packing %s: another process is (%s)", job.key, exc)
        return None
    if path is not None:
        cache.enforce_limit(keep=job.key)  # the entry just grew
        _check_for_next_start(cache, job)
    return path


def _check_for_next_start(cache: Cache, job: PrepackLater) -> None:
    """Check the entry (and its pre-packed files) in full once what was just written is older than
    :data:`ortmem.store.trust.RACY_SECONDS`, so the stamps this leaves (:mod:`ortmem.store.stamps`)
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
    if cache.verify(entry, mode="full") is None and job.kind != "prepared":
        verify_prepacked(entry.path, "full")


def _pack(cache: Cache, job: PrepackLater) -> Optional[Path]:
    """:func:`run`'s work once it holds the lock."""
    entry = cache.entry(job.key)
    done = prepacked_model(entry.path, job.verify)
    if done is not None or not entry.path.is_dir():
        return done
    problem = cache.verify(entry, mode="full")  # nothing is derived from an entry not checked in full
    if problem is not None:
        log.warning("ortmem: not packing %s (%s)", entry.path, problem)
        return None
    so = ort.SessionOptions()
    for k, v in job.config.items():
        so.add_session_config_entry(k, v)
    if job.intra_op_num_threads:
        so.intra_op_num_threads = job.intra_op_num_threads
    return save_prepacked(entry.path, sess_options=so)


def _prepare(cache: Cache, job: PrepackLater) -> Optional[Path]:
    """:func:`run`'s work for a prepared entry, under its lock: nothing when it exists, or when the
    source changed since the starter computed the key (a later start computes the new one)."""
    if lookup_prepared(cache, job.key) is not None:
        return None
    settings, converting = settings_of_record(job.settings)
    source = Path(job.source)
    if prepared_key(source, settings, job.config, converting) != job.key:
        log.info("ortmem: %s changed since its start; not preparing it under the old key", source)
        return None
    entry, _ = build_prepared(cache, source, job.key, packing=job.config, threads=job.intra_op_num_threads,
                              settings=settings)
    return entry.path


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ortmem.store.packer '<PrepackLater as JSON>'``."""
    args = sys.argv[1:] if argv is None else argv
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    try:
        run(PrepackLater(**json.loads(args[0])))
    except Exception as exc:  # noqa: BLE001 - a failed packer publishes nothing; the next start packs
        log.warning("ortmem: background packing failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
