"""A content-addressed cache of converted models, safe under concurrent creators and other users.

An entry is a folder ``<root>/<key>/`` holding ``model.onnx`` (a skeleton whose large tensors are
external data), ``weights.bin`` (every weight, page-aligned, so ORT maps each tensor straight from the
page cache) and ``manifest.json`` (what the entry claims, checked before use).

Publishing is atomic: an entry is built in ``<root>/.tmp-<pid>-<random>/`` and renamed into place; a
rename onto an existing entry fails, so of two concurrent creators the first wins and the second
throws its copy away and uses the winner's. A reader therefore never sees a half-written entry; an
entry that fails verification (truncated, edited, from another ortmem/ORT version) is moved aside
and rebuilt. Creators of one key also take a lock (:meth:`Cache.creating`, an ``flock`` on
``<root>/.lock-<key>``, removed by its holder): when N server workers start at once on an empty cache, one converts and the
others wait, then read its entry, instead of N conversions racing (N times the peak, the disk
traffic and the time). The rename rule above still guards filesystems without ``flock``.
Space for ``weights.bin`` is reserved with ``posix_fallocate`` before anything is
written through a mapping, so a full disk is a clean ``CacheError``, never a SIGBUS.

Trust (docs/cache-security.md): the root, every entry and every file in it are created private
(0700/0600, or the source's mode where stricter) and are read only when this user owns them, they
are not symbolic links, and neither group nor others may write them (:mod:`ortmem.filetrust`).
Integrity: the manifest records a full digest of every file (:mod:`ortmem.digest`), checked on
every lookup in full, sampled or not at all (``verify=``), and in full before anything is derived
from the entry (pre-packing) and by ``ortmem cache verify``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import platformdirs

from . import digest
from .errors import CacheError
from .filetrust import (PRIVATE_FILE_MODE, make_private_dir, open_new, parent_untrusted_reason, read_nofollow,
                        untrusted_reason, write_new)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "weights.bin"
#: 2: identities with ctime, a full digest of every file, private modes.
FORMAT = 2
#: Prefix of files an entry links from the model's own folder (another owner's, checked by identity).
SOURCE_LINK_PREFIX = "source-"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
#: A temporary folder or file nobody has written for this long, whose writer is not a live process
#: on this machine, is a crash leftover (a writer touches its files continuously; another container's
#: pids are invisible here, hence the idle time too). After a day it is stale whatever the pid says.
STALE_IDLE_SECONDS = 600.0
STALE_ANY_SECONDS = 86400.0


class UntrustedCacheError(CacheError):
    """The cache folder could be written by someone else: it is not used at all."""


def cache_root() -> Path:
    """``$ORTMEM_CACHE_DIR``, else the platform's user cache dir; created private on first use."""
    root = os.environ.get("ORTMEM_CACHE_DIR")
    path = Path(root) if root else Path(platformdirs.user_cache_dir("ortmem"))
    make_private_dir(path, parents=True)
    return path


def make_key(parts: dict[str, Any]) -> str:
    """A stable hex key over everything the cached bytes depend on (sources, options, versions)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def file_identity(path: Path) -> dict[str, Any]:
    """Identity of a source file: everything ``stat`` gives that a replacement or an in-place write
    must change. ``ctime_ns`` cannot be set back by the writer (unlike mtime); it also moves when
    the link count does, so ``nlink`` is kept to tell a cache entry's hard link from an edit
    (:func:`same_source`)."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "dev": st.st_dev, "ctime_ns": st.st_ctime_ns, "nlink": st.st_nlink}


def key_identity(path: Path) -> dict[str, Any]:
    """The part of :func:`file_identity` that goes into a cache key (not ctime/nlink, which other
    entries' hard links move; those are checked against the entry's manifest instead)."""
    ident = file_identity(path)
    return {k: ident[k] for k in ("path", "size", "mtime_ns", "inode", "dev")}


def same_source(recorded: dict[str, Any], current: dict[str, Any]) -> Optional[bool]:
    """True: unchanged. False: replaced, resized or rewritten with a new mtime. None: only ctime (and
    maybe the link count) moved: either another entry linked or dropped the file (every cache entry
    hard-links its sources, and a link then an unlink leaves the count where it was) or the file was
    edited in place with its mtime set back; the caller tells the two apart by content."""
    if recorded == current:
        return True
    stable = ("path", "size", "mtime_ns", "inode", "dev")
    if all(recorded.get(k) == current.get(k) for k in stable):
        return None
    return False


@dataclass
class Entry:
    key: str
    path: Path

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE

    def manifest(self) -> dict[str, Any]:
        return json.loads(read_nofollow(self.path / MANIFEST))

    def size_bytes(self) -> int:
        return sum(f.lstat().st_size for f in self.path.iterdir() if f.is_file() and not f.is_symlink())

    def owned_bytes(self) -> int:
        """Disk this entry alone holds: files with no other link (a hard-linked source file stays
        on disk after the entry goes, so removing the entry would not free it)."""
        total = 0
        for f in self.path.iterdir():
            st = f.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                total += st.st_blocks * 512
        return total

    def last_used(self) -> float:
        """When a lookup last returned this entry (its manifest's mtime, touched on every hit)."""
        return (self.path / MANIFEST).lstat().st_mtime

    def rewrite_manifest(self, manifest: dict[str, Any]) -> None:
        """Replace the manifest atomically (a private temporary file renamed over it)."""
        tmp = self.path / f".{MANIFEST}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        write_new(tmp, json.dumps(manifest, indent=1).encode(), sync=True)
        os.replace(tmp, self.path / MANIFEST)


def spot_digest(path: Path, spans: list[tuple[int, int]]) -> str:
    """Sampled digest of ``spans`` (:func:`ortmem.digest.sampled_digest`)."""
    return digest.sampled_digest(path, spans)


class Cache:
    """Converted models, under ``<cache root>/converted`` unless another folder is given.

    Raises :class:`CacheError` when the folder cannot be created, and :class:`UntrustedCacheError`
    when someone else could write it; :func:`open_cache` turns both into one warning and None.
    """

    def __init__(self, root: Optional[Path] = None, *, verify: str = digest.DEFAULT_VERIFY):
        self.verify_mode = digest.check_mode(verify)
        try:
            self.root = Path(root) if root is not None else cache_root() / "converted"
            make_private_dir(self.root, parents=True)
        except OSError as exc:
            raise CacheError(f"cache folder cannot be created: {exc.strerror or exc}",
                             file=str(root if root is not None else "<cache root>")) from exc
        problem = untrusted_reason(self.root) or parent_untrusted_reason(self.root)
        if problem:
            raise UntrustedCacheError(f"cache folder {problem}; it is not used", file=str(self.root))

    def entry(self, key: str) -> Entry:
        return Entry(key, self.root / key)

    def lookup(self, key: str, *, verify: Optional[str] = None) -> Optional[Entry]:
        """The verified entry for ``key``, or None (a broken one is moved aside for rebuilding)."""
        e = self.entry(key)
        if not os.path.lexists(e.path):
            return None
        problem = self.verify(e, mode=verify)
        if problem is None:
            try:
                os.utime(e.path / MANIFEST, follow_symlinks=False)  # recency for prune()
            except OSError:
                pass
            return e
        log.warning("ortmem: cache entry %s is unusable (%s); rebuilding", e.path, problem)
        self._discard(e.path)
        return None

    def discard(self, e: Entry) -> None:
        """Remove an entry (a reader that already opened its files keeps them)."""
        self._discard(e.path)

    def verify(self, e: Entry, *, mode: Optional[str] = None) -> Optional[str]:
        """None when the entry is whole, private and what its manifest says; else what is wrong.

        ``mode`` (default: the cache's ``verify``): "full" digests every byte of every file,
        "sampled" the first and last page of every weight span, "off" checks sizes and the skeleton.
        """
        mode = digest.check_mode(mode or self.verify_mode)
        for what, path in (("entry folder", e.path), (MANIFEST, e.path / MANIFEST)):
            problem = untrusted_reason(path)
            if problem:
                return f"{what} {problem}"
        try:
            m = e.manifest()
        except (OSError, ValueError) as exc:
            return f"manifest unreadable: {exc}"
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("key") != e.key:
            return "manifest from another format or key"
        files = m.get("files")
        digests = m.get("digests")
        if not isinstance(files, dict) or not isinstance(digests, dict) or MODEL_FILE not in files:
            return "manifest lists no files"
        for name, size in files.items():
            p = e.path / str(name)
            if os.sep in str(name) or str(name).startswith("."):
                return f"manifest names {name!r}"
            problem = untrusted_reason(p, owner_only=not str(name).startswith(SOURCE_LINK_PREFIX))
            if problem:
                return f"{name} {problem}"
            try:
                st = p.lstat()
            except OSError:
                return f"{name} missing"
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return f"{name} missing or of the wrong size"
        full = [MODEL_FILE] if mode != "full" else list(files)
        for name in full:
            if not digest.matches(e.path / name, digests.get(name)):
                return f"{name} content changed (full digest)"
        spans = [tuple(s) for s in m.get("spans", [])]
        if mode == "sampled" and spans and spot_digest(e.weights_path, spans) != m.get("spot_digest"):
            return f"{WEIGHTS_FILE} content changed (sampled digest)"
        return None

    def build(self, key: str, builder: Callable[[Path], dict[str, Any]], *, file_mode: int = PRIVATE_FILE_MODE) -> Entry:
        """Build an entry with ``builder(tmpdir) -> manifest extras`` and publish it atomically.

        ``builder`` writes ``model.onnx`` and ``weights.bin`` into ``tmpdir`` (a private folder)
        and returns ``{"spans": [(offset, length), ...], ...}``; the manifest is completed here.
        Its ``"digests"`` (file name -> full digest) are the digests it computed while writing those
        files; every other file is digested here, by reading it.
        Files the builder created are given ``file_mode`` (0600 or stricter); hard links it made
        (``source-*``) keep their own owner and mode.
        """
        self.reclaim_stale()
        tmp = self.root / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            make_private_dir(tmp)
        except OSError as exc:
            raise CacheError(f"cache entry could not be written: {exc}", file=str(tmp)) from exc
        try:
            extras = builder(tmp)
            known: dict[str, str] = extras.pop("digests", None) or {}
            files: dict[str, int] = {}
            digests: dict[str, str] = {}
            for f in sorted(tmp.iterdir()):
                st = f.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue
                if not f.name.startswith(SOURCE_LINK_PREFIX):
                    os.chmod(f, file_mode)
                files[f.name] = st.st_size
                digests[f.name] = known.get(f.name) or digest.file_digest(f)
            manifest = {"format": FORMAT, "key": key, "created": time.time(), "files": files, "digests": digests,
                        **extras}
            spans = [tuple(s) for s in manifest.get("spans", [])]
            if spans:
                manifest["spot_digest"] = spot_digest(tmp / WEIGHTS_FILE, spans)
            write_new(tmp / MANIFEST, json.dumps(manifest, indent=1).encode(), mode=file_mode | 0o200, sync=True)
            fsync_dir(tmp)
            final = self.root / key
            try:
                os.rename(tmp, final)
            except OSError:
                # Another creator published first (rename onto a non-empty folder fails): use theirs.
                winner = self.lookup(key)
                if winner is None:
                    raise CacheError("could not publish cache entry", file=str(final)) from None
                shutil.rmtree(tmp, ignore_errors=True)
                return winner
            fsync_dir(self.root)
            self.enforce_limit(keep=key)
            return Entry(key, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CacheError(f"cache entry could not be written: {exc}", file=str(tmp)) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @contextlib.contextmanager
    def creating(self, key: str) -> Iterator[None]:
        """Hold the creator lock of ``key`` (blocking): whoever holds it builds or adds to the entry;
        others wait and then look again.

        The lock is an ``flock`` on ``<root>/.lock-<key>``, removed by its holder before it lets go,
        so nothing is left behind; a waiter that then holds a removed file (its inode is no longer
        the path's) opens the path again. A lock that cannot be taken (no ``flock`` on this
        filesystem) is skipped, which only costs duplicated work: the atomic rename still decides.
        """
        path = self.root / f".lock-{key}"
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except OSError as exc:
                log.debug("ortmem: no creator lock for %s (%s)", key, exc)
                fd = -1
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                log.debug("ortmem: flock refused for %s (%s)", key, exc)
                os.close(fd)
                fd = -1
                break
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break  # locked the file that is still at the path
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder removed it while we waited: lock the current one
        try:
            yield
        finally:
            if fd >= 0:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                os.close(fd)  # releases the lock

    def get_or_build(self, key: str, builder: Callable[[Path], dict[str, Any]]) -> tuple[Entry, bool]:
        """(entry, hit): a verified existing entry, or a freshly built one."""
        e = self.lookup(key)
        if e is not None:
            return e, True
        return self.build(key, builder), False

    def entries(self) -> Iterator[Entry]:
        for p in sorted(self.root.iterdir()):
            if not p.is_symlink() and p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists():
                yield Entry(p.name, p)

    def clear(self) -> int:
        """Remove every entry and leftover temporary folder; returns bytes freed."""
        freed = 0
        for p in list(self.root.iterdir()):
            if p.is_dir() and not p.is_symlink():
                freed += sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
                self._discard(p)
            elif p.name.startswith(".") or p.is_symlink():
                _unlink_quiet(p)
        return freed

    def reclaim_stale(self, *, now: Optional[float] = None) -> int:
        """Remove crash leftovers: temporary and trash folders at the root and temporary files and
        folders inside entries (pre-packing), whose writer is gone (see ``STALE_IDLE_SECONDS``).
        Called by every writer and by prune/clear; returns how many were removed."""
        now = time.time() if now is None else now
        removed = 0
        candidates: list[Path] = []
        try:
            top = list(self.root.iterdir())
        except OSError:
            return 0
        for p in top:
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                candidates.append(p)
            elif not p.name.startswith(".") and p.is_dir() and not p.is_symlink():
                try:
                    candidates.extend(c for c in p.iterdir() if c.name.startswith("."))
                except OSError:
                    continue
        for c in candidates:
            if _is_stale(c, now):
                if c.is_dir() and not c.is_symlink():
                    shutil.rmtree(c, ignore_errors=True)
                else:
                    _unlink_quiet(c)
                removed += 1
        return removed

    def prune(self, max_bytes: int, *, keep: Optional[str] = None) -> int:
        """Discard least recently used entries until what the entries own on disk is at most
        ``max_bytes`` (``keep``, e.g. the entry just built, is never discarded); returns bytes freed.
        Crash leftovers are removed first.

        Safe beside live sessions: a discarded entry is renamed away before it is deleted, and a
        process that already mapped its files keeps them until it is done.
        """
        self.reclaim_stale()
        known: list[tuple[float, Entry, int]] = []
        for e in self.entries():
            try:
                known.append((e.last_used(), e, e.owned_bytes()))
            except OSError:  # discarded meanwhile by another process
                continue
        entries = [e for _, e, _ in sorted(known, key=lambda k: k[0])]
        owned = {e.key: n for _, e, n in known}
        total, freed = sum(owned.values()), 0
        for e in entries:
            if total <= max_bytes:
                break
            if e.key == keep:
                continue
            self.discard(e)
            total -= owned[e.key]
            freed += owned[e.key]
        return freed

    def enforce_limit(self, *, keep: Optional[str] = None) -> int:
        """:meth:`prune` to ``$ORTMEM_CACHE_MAX_SIZE`` (e.g. ``20GiB``) when it is set; else nothing."""
        limit = os.environ.get("ORTMEM_CACHE_MAX_SIZE")
        if not limit:
            return 0
        from .units import parse_bytes

        freed = self.prune(parse_bytes(limit), keep=keep)
        if freed:
            log.info("ortmem: cache over ORTMEM_CACHE_MAX_SIZE=%s; removed %.1f MiB of least recently used "
                     "entries", limit, freed / 2**20)
        return freed

    def _discard(self, path: Path) -> None:
        # Rename first so a concurrent reader never sees a half-deleted entry under the key.
        trash = self.root / f"{TRASH_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            os.rename(path, trash)
        except OSError:
            return
        if trash.is_symlink():
            _unlink_quiet(trash)
        else:
            shutil.rmtree(trash, ignore_errors=True)


def open_cache(root: Optional[Path] = None, *, verify: str = digest.DEFAULT_VERIFY) -> Optional[Cache]:
    """The cache at ``root`` (default: the user's), or None with one warning when it cannot be
    used (read-only, uncreatable, or writable by someone else): the caller converts in memory."""
    try:
        return Cache(root, verify=verify)
    except CacheError as exc:
        log.warning("ortmem: not using the cache (%s); converting in memory instead", exc)
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _writer_pid(name: str) -> Optional[int]:
    """The pid in ``.tmp-<pid>-<hex>`` / ``.prepack-<pid>-<hex>`` style names (None when absent)."""
    for part in name.lstrip(".").replace(".", "-").split("-"):
        if part.isdigit():
            return int(part)
    return None


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for f in path.rglob("*"):
            try:
                newest = max(newest, f.lstat().st_mtime)
            except OSError:
                continue
    return newest


def _is_stale(path: Path, now: float) -> bool:
    try:
        idle = now - _newest_mtime(path)
    except OSError:
        return False
    if path.name.startswith(TRASH_PREFIX):
        pid = _writer_pid(path.name[len(TRASH_PREFIX):])
        return pid is None or not _pid_alive(pid) or idle > STALE_IDLE_SECONDS
    if idle > STALE_ANY_SECONDS:
        return True
    pid = _writer_pid(path.name)
    return idle > STALE_IDLE_SECONDS and (pid is None or not _pid_alive(pid))


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def reserve(path: Path, size: int, mode: int = PRIVATE_FILE_MODE) -> int:
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


def fsync_dir(path: Path) -> None:
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
