"""Cache files checked in full this boot: a warm start reads each file's every byte once, not every time.

Why: ``verify="full"`` digests every byte of an entry (its weights, its pre-packed weights, a source
whose link count moved). On the 0.6 GB synthetic Llama (onnxruntime 1.32.0, 2 cores) that is
about 3 GB per warm start and 1.4-2.5 s, against 1.7-2.2 s for ORT's whole creation of the same model
(``python -m bench.verify_cost``; docs/cache-security.md): the check cost more than the start it guards.

What a stamp says: "this file, with exactly this identity, was digested in full and matched this
recorded digest, during this boot". After a full digest matches, an empty file is created in a private
folder, named by a hash of the file's path, device, inode, size, mtime and ctime, the recorded digest
and the boot id. A later check of the same file finds the stamp and reads nothing. Any write to the
file moves its ctime, which no writer can set back (unlike mtime); a replacement is another inode; a
different recorded digest (an entry rebuilt) names another stamp; so each of them is read in full
again. A file whose ctime is within :data:`RACY_SECONDS` of the check is not stamped: a coarse clock
could hide a second write in the same tick (git's "racy" files).

Where: ``$ORTMEM_VERIFIED_DIR``, else ``$XDG_RUNTIME_DIR/ortmem-verified``, else
``/dev/shm/ortmem-verified-<uid>``: memory-backed folders emptied at every boot, so every file is read in
full at least once per boot (damage on disk shows when the page cache is refilled from it). The folder
is created private and used only while it is this user's and nobody else may write it (the cache's own
trust rule, :mod:`ortmem.files.trust`); otherwise there are no stamps and every check reads every byte.
``verify="always"`` (and ``ortmem cache verify``) ignores stamps.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from ortmem.base.hashing import short_hash
from ortmem.files.trust import RACY_SECONDS, first_private_folder, open_new

#: Where stamps go instead of the default folders (tests, or a deployment's own tmpfs).
FOLDER_ENV = "ORTMEM_VERIFIED_DIR"


def folder() -> Optional[Path]:
    """The private per-boot folder stamps live in, created if needed; None where there is none this
    process may trust (no memory-backed folder, another owner, writable by others)."""
    configured = os.environ.get(FOLDER_ENV)
    if configured:
        candidates = [Path(configured)]
    else:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        candidates = [Path(runtime) / "ortmem-verified"] if runtime else []
        if hasattr(os, "geteuid"):
            candidates.append(Path("/dev/shm") / f"ortmem-verified-{os.geteuid()}")
    return first_private_folder(candidates)


def identity(path: Path) -> Optional[os.stat_result]:
    """The file's identity as a stamp names it (None when it cannot be examined)."""
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


def is_stamped(where: Path, path: Path, st: os.stat_result, recorded: str) -> bool:
    """Whether ``path``, as ``st`` describes it, was digested in full this boot and matched ``recorded``."""
    return os.path.lexists(where / _name(path, st, recorded))


def stamp(where: Path, path: Path, before: os.stat_result, recorded: str) -> None:
    """Record that ``path`` matched ``recorded`` in full, if its identity did not move while it was read
    and it was not written within :data:`RACY_SECONDS`; best effort (a full folder: no stamp)."""
    after = identity(path)
    if after is None or _key(after) != _key(before) or time.time_ns() - after.st_ctime_ns < RACY_SECONDS * 1e9:
        return
    try:
        os.close(open_new(where / _name(path, after, recorded)))
    except OSError:  # already stamped by another process, or no room: the next check reads it again
        pass


def _key(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _name(path: Path, st: os.stat_result, recorded: str) -> str:
    import json  # here: a start decided from a file's bytes checks the cache's verify mode, and stamps none

    blob = json.dumps([os.path.abspath(path), *_key(st), recorded, boot_id()]).encode()
    return short_hash(blob)


def boot_id() -> str:
    """This boot's id (Linux): a stamp folder that outlived a reboot still names no file of this boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
