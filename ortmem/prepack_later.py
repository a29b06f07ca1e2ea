"""Save a fresh cache entry's pre-packed weights in a background process, so the second start is warm.

Why
---
A cold start converts the model into a cache entry and creates ORT's session on it; ORT packs every
MatMulNBits ``B`` on the heap. Mapped pre-packed weights (:mod:`ortmem.prepacked`) need a second
packing into ``prepacked.bin``, written beside the entry. Where that packing runs decides which start
pays for it:

- in the cold start, before its session: measured on the demo model (onnxruntime 1.32.0) the first
  hit that packs takes 2.44 s against the cold start's 1.13 s and ORT's 1.59 s on the QDQ model, so
  the cold start would miss "never slower than ORT";
- in the cold session itself (``session.save_external_prepacked_constant_initializers``): ORT then
  writes every initializer again beside the blobs and keeps them all alive (1.45x the twin's peak
  on the demo model, ``ortmem.prepacked``);
- in the first cache hit (what ortmem did before): that start is warm in memory but slow, and only
  the third start is a fast warm one.

So the cold start hands the packing to a separate, niced process (``python -m
ortmem.prepack_later``) once its session has finished its **first run**: not during creation (it
would stack on the session's creation peak and compete with ORT for this machine's cores) and not
before the first request is answered (the first run allocates the session's activations; later runs
reuse them). The packer holds the entry's creator lock (:meth:`ortmem.cache.Cache.creating`) while
it packs: a second start that arrives meanwhile waits for it and then maps the result instead of
packing again; one that arrives before it took the lock packs itself, and the packer then finds the
files and stops. If the packer fails or is killed, nothing is published (``prepacked.json`` goes
last) and the next start packs, as before. Its memory is its own process's: the fixed cost of
Python with onnxruntime plus one group of ``B`` (``ortmem.prepacked.DEFAULT_GROUP_BYTES``), returned
whole when it exits: 167 MiB at its peak for 1.6 s on the demo model (onnxruntime 1.32.0,
``/usr/bin/time -v python -m ortmem.prepack_later ...``), where the session itself peaks at 524 MiB.

Below :data:`MIN_WEIGHT_BYTES` of converted weights no process is started: the first hit packs so
little that its own packing costs less than starting a Python interpreter with onnxruntime.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import onnxruntime as ort

from .cache import WEIGHTS_FILE, Cache, Entry, creator_lock_path
from .prepacked import PREPACKED_MANIFEST, packing_settings, prepacked_model, save_prepacked

log = logging.getLogger(__name__)

#: Converted weights (``weights.bin``) below which the first cache hit packs in its own process.
#: A packer process costs about 0.3 s of CPU and 60 MiB to start (Python, onnxruntime, onnx).
MIN_WEIGHT_BYTES = 32 * 1024 * 1024
#: Niceness added in the packer: the user's sessions come first on a busy machine.
NICENESS = 10

_started: list[subprocess.Popen] = []
_lock = threading.Lock()


@dataclass
class PrepackLater:
    """What the packer needs to pack one entry: where it is, and the options packing depends on."""

    cache_root: str
    key: str
    verify: str = "full"
    config: dict[str, str] = field(default_factory=dict)
    intra_op_num_threads: int = 0

    def start(self) -> Optional[subprocess.Popen]:
        """Start the packer (detached; reaped by a daemon thread); None when the entry is already
        packed, another process is packing it, or the process cannot be started (logged: the next
        start packs then)."""
        if (Path(self.cache_root) / self.key / PREPACKED_MANIFEST).exists():
            return None
        if creator_lock_path(Path(self.cache_root), self.key).exists():
            return None  # another process packs it now (workers forked after a --preload share this job)
        env = dict(os.environ)
        package_parent = str(Path(__file__).resolve().parent.parent)  # the child imports this very ortmem
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
        env.pop("ORTMEM_HOOK", None)  # session_hook.ENV_SWITCH: ortmem's own process is never hooked
        try:
            proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(asdict(self))], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    close_fds=True, start_new_session=True)
        except OSError as exc:
            log.info("ortmem: could not start the background packer (%s); the next start packs", exc)
            return None
        with _lock:
            _started.append(proc)  # a process starts one per cold start: kept for wait_background
        threading.Thread(target=proc.wait, name="ortmem-prepack-reaper", daemon=True).start()
        log.info("ortmem: packing ORT's weights for %s in the background (pid %d)", self.key, proc.pid)
        return proc


def prepack_later_for(entry: Entry, cache: Cache, sess_options: Optional[object]) -> Optional[PrepackLater]:
    """The background packing of a freshly built ``entry``, or None when the first hit should pack
    (small weights) or the entry cannot be sized."""
    try:
        if (entry.path / WEIGHTS_FILE).stat().st_size < MIN_WEIGHT_BYTES:
            return None
    except OSError:
        return None
    config, threads = packing_settings(sess_options)
    return PrepackLater(str(cache.root), entry.key, cache.verify_mode, config, threads)


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
    """The packer's work (in the background process): under the entry's creator lock, check the entry
    in full, then save its pre-packed weights unless another process already did."""
    if not (Path(job.cache_root) / job.key).is_dir():  # cleared meanwhile: create nothing
        return None
    cache = Cache(Path(job.cache_root), verify=job.verify)
    entry = cache.entry(job.key)
    with cache.creating(job.key):
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
        path = save_prepacked(entry.path, sess_options=so)
    if path is not None:
        cache.enforce_limit(keep=job.key)  # the entry just grew
    return path


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ortmem.prepack_later '<PrepackLater as JSON>'``."""
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
