"""Files only their owner could have written: private creation and the checks before a read.

Why: the cache holds models ORT will run. Anyone who can write into it can make a victim's session
return their outputs (a planted entry, a swapped file, a symlink that turns a write into an
overwrite elsewhere). So the cache trusts a file or folder only when the current user owns it, it
is not a symbolic link, and neither group nor others may write it; and everything the cache creates
is private (0700 folders, 0600 files, ``O_EXCL|O_NOFOLLOW``), so an attacker cannot pre-create,
replace or redirect it. A folder that already exists is never re-moded: it may be the user's own
(``ORTMEM_CACHE_DIR``), and whether it can be trusted is for :func:`untrusted_reason` and
:func:`parent_untrusted_reason` to say. See docs/cache-security.md for the threat model.

:func:`cache_file_problem` is the one check every file read from the cache passes (an entry's files
and manifest, pre-packed and prepared files); it lives here, below everything that reads the cache,
so the modules that keep files in an entry ask it directly and never the cache itself.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Optional, Union

PathLike = Union[str, os.PathLike]

PRIVATE_DIR_MODE = 0o700
#: A folder being built (an entry at the cache root, a handoff record), renamed into place when done.
TMP_PREFIX = ".tmp-"
#: A folder renamed away before it is deleted (a reader never sees it half removed).
TRASH_PREFIX = ".trash-"
#: A file changed this recently may change again within the same timestamp tick, which ``stat`` cannot
#: see (git's "racy" files): it is not stamped (:mod:`ortmem.files.stamps`), sources changed this
#: recently are digested again (:mod:`ortmem.files.sources`), and no handoff record is made of it
#: (:mod:`ortmem.store.handoff_records`).
RACY_SECONDS = 2.0
PRIVATE_FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def owner_uid(st: os.stat_result) -> int:
    """The uid that owns a file, as every trust check reads it. One function, so a test that cannot
    chown (not root) can give one chosen file another owner and see it refused
    (tests/files/test_trust.py::test_an_entry_file_of_another_owner_is_refused)."""
    return st.st_uid


def stat_untrusted_reason(st: os.stat_result, *, owner_only: bool = True) -> Optional[str]:
    """:func:`untrusted_reason` for a file already ``lstat``-ed (or ``fstat``-ed through an open
    descriptor, which closes the gap between the check and the read)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if owner_only and hasattr(os, "geteuid") and owner_uid(st) != os.geteuid():
        return f"is owned by uid {owner_uid(st)}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def untrusted_reason(path: PathLike, *, owner_only: bool = True) -> Optional[str]:
    """None when ``path`` is neither a symlink nor writable by group/others and (``owner_only``)
    belongs to the current user; else why it may not be trusted. A missing path is not trusted."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be examined: {exc.strerror or exc}"
    return stat_untrusted_reason(st, owner_only=owner_only)


def parent_untrusted_reason(path: PathLike) -> Optional[str]:
    """Whether another user could rename or replace ``path`` through its parent folder: the parent
    must not be writable by others, unless it has the sticky bit (like /tmp), which forbids that."""
    parent = Path(os.path.abspath(path)).parent
    try:
        st = os.stat(parent)
    except OSError as exc:
        return f"parent {parent} cannot be examined: {exc.strerror or exc}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"parent {parent} is writable by group or others without the sticky bit"
    return None


def make_private_dir(path: PathLike, *, parents: bool = False) -> None:
    """Create ``path`` 0700 (ancestors, when created, too). A folder that is already there is left
    exactly as it is, whoever made it: ortmem never changes the mode of a folder it did not create
    (a user's 0777 ``ORTMEM_CACHE_DIR`` stays 0777); the caller's trust check then decides whether
    it may be used (a world-writable folder without the sticky bit may not)."""
    path = Path(path)
    if parents and not path.parent.exists():
        make_private_dir(path.parent, parents=True)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask; be exact


def first_private_folder(candidates: "list[Path]", *, create: bool = True) -> Optional[Path]:
    """The first of ``candidates`` that is a private folder of this user passing the trust check (and
    whose parent nobody else may rename it out of), made 0700 when missing and ``create``; None if
    none is. A candidate this process may not even examine (another user's folder) is skipped."""
    for path in candidates:
        try:
            if create and not path.is_dir() and path.parent.is_dir() and parent_untrusted_reason(path) is None:
                make_private_dir(path)
            if path.is_dir() and untrusted_reason(path) is None and parent_untrusted_reason(path) is None:
                return path
        except OSError:
            continue
    return None


def open_new(path: PathLike, mode: int = PRIVATE_FILE_MODE, *, readable: bool = False) -> int:
    """Create ``path`` exclusively without following a symlink; returns a write (or read-write) fd.

    Fails (``FileExistsError``/``OSError``) if anything is already there, so a planted file or link
    is never written through.
    """
    flags = os.O_CREAT | os.O_EXCL | _NOFOLLOW | (os.O_RDWR if readable else os.O_WRONLY)
    return os.open(path, flags, mode)


def write_new(path: PathLike, data: bytes, mode: int = PRIVATE_FILE_MODE, *, sync: bool = False) -> None:
    """Write ``data`` to a new file at ``path`` (:func:`open_new`), optionally fsynced."""
    fd = open_new(path, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_nofollow(path: PathLike) -> bytes:
    """The bytes of ``path``, refusing a symlink in its last component."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def cache_file_problem(path: Path, *, size: Optional[int] = None, recorded: Optional[str] = None,
                       owner_only: bool = True,
                       matches: Optional[Callable[[Path, str], bool]] = None) -> Optional[str]:
    """Why ``path``, a file in the cache, may not be read, or None.

    The one check every file ortmem reads from its cache passes (an entry's files and manifest,
    every other file in its folder, the pre-packed weights, their model and manifest), so no kind
    of file is read unchecked: a symbolic link, a file another user owns (``owner_only``; hard-linked
    sources keep their owner), one group or others may write, anything but a regular file, a size
    other than ``size`` (when given), or content whose full digest is not ``recorded`` (when given,
    judged by ``matches``, :func:`ortmem.files.digest.matches`, which this bottom module is handed
    rather than imports; an empty string never matches) is refused.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path.name} missing"
    except OSError as exc:
        return f"{path.name} cannot be examined: {exc.strerror or exc}"
    problem = stat_untrusted_reason(st, owner_only=owner_only)
    if problem:
        return f"{path.name} {problem}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is not a regular file"
    if size is not None and st.st_size != size:
        return f"{path.name} has the wrong size"
    if recorded is not None:
        if matches is None:
            raise TypeError("cache_file_problem: a recorded digest needs the function that checks it (matches=)")
        if not matches(path, recorded):
            return f"{path.name} content changed (full digest)"
    return None


def replace_private(path: PathLike, data: bytes) -> None:
    """Replace ``path`` atomically with ``data``: a new private temporary file beside it (a writer's
    "."-name, which no reader opens), fsynced, then renamed over it."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}"
    write_new(tmp, data, sync=True)
    os.replace(tmp, path)


def reserve(path: PathLike, size: int, mode: int = PRIVATE_FILE_MODE) -> int:
    """Create ``path`` (new: never through a planted file or link) with ``size`` bytes of disk
    actually allocated; returns an open read-write fd."""
    fd = open_new(path, mode, readable=True)
    try:
        if size:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # pragma: no cover - macOS: no fallocate; ftruncate is sparse
                os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_aside(path: Path) -> None:
    """Remove ``path`` (a folder, a file or a link) best effort: renamed first beside itself under
    :data:`TRASH_PREFIX`, so a reader never sees it half removed under its name, then deleted. A flat
    folder (a handoff record) is deleted without ``shutil``, which the hook never imports; one with
    subfolders by ``shutil.rmtree``."""
    aside = path.parent / f"{TRASH_PREFIX}{os.getpid()}-{os.urandom(8).hex()}"
    try:
        os.rename(path, aside)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(os.lstat(aside).st_mode):
            os.unlink(aside)
            return
        for entry in os.scandir(aside):
            if entry.is_dir(follow_symlinks=False):
                raise IsADirectoryError(entry.path)
            os.unlink(entry.path)
        os.rmdir(aside)
    except OSError:
        import shutil

        shutil.rmtree(aside, ignore_errors=True)


def fsync_dir(path: PathLike) -> None:
    """Make a rename or a new file in ``path`` durable (best effort: not every filesystem can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
