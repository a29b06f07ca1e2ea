"""A content-addressed cache of converted models, safe under concurrent creators.

An entry is a folder ``<root>/<key>/`` holding ``model.onnx`` (a skeleton whose large tensors are
external data), ``weights.bin`` (every weight, page-aligned, so ORT maps each tensor straight from the
page cache) and ``manifest.json`` (what the entry claims, checked before use).

Publishing is atomic: an entry is built in ``<root>/.tmp-<random>/`` and renamed into place; a
rename onto an existing entry fails, so of two concurrent creators the first wins and the second
throws its copy away and uses the winner's. A reader therefore never sees a half-written entry; an
entry that fails verification (truncated, edited, from another ortmem/ORT version) is moved aside
and rebuilt. Creators of one key also take a lock (:meth:`Cache.creating`, an ``flock`` on
``<root>/.lock-<key>``, removed by its holder): when N server workers start at once on an empty cache, one converts and the
others wait, then read its entry, instead of N conversions racing (N times the peak, the disk
traffic and the time). The rename rule above still guards filesystems without ``flock``.
Space for ``weights.bin`` is reserved with ``posix_fallocate`` before anything is
written through a mapping, so a full disk is a clean ``CacheError``, never a SIGBUS.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import platformdirs

from .errors import CacheError
from .weights import PAGE

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "weights.bin"
FORMAT = 1


def cache_root() -> Path:
    """``$ORTMEM_CACHE_DIR``, else the platform's user cache dir; created on first use."""
    root = os.environ.get("ORTMEM_CACHE_DIR")
    path = Path(root) if root else Path(platformdirs.user_cache_dir("ortmem"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_key(parts: dict[str, Any]) -> str:
    """A stable hex key over everything the cached bytes depend on (sources, options, versions)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def file_identity(path: Path) -> dict[str, Any]:
    """Cheap identity of a source file: a replaced or rewritten file gets a new key."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


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
        return json.loads((self.path / MANIFEST).read_text())

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def owned_bytes(self) -> int:
        """Disk this entry alone holds: files with no other link (a hard-linked source file stays
        on disk after the entry goes, so removing the entry would not free it)."""
        total = 0
        for f in self.path.iterdir():
            st = f.stat()
            if f.is_file() and st.st_nlink == 1:
                total += st.st_blocks * 512
        return total

    def last_used(self) -> float:
        """When a lookup last returned this entry (its manifest's mtime, touched on every hit)."""
        return (self.path / MANIFEST).stat().st_mtime


def spot_digest(path: Path, spans: list[tuple[int, int]]) -> str:
    """Hash the first and last page of every span: catches truncation, zeroed or swapped tensors
    without reading gigabytes on every warm start."""
    h = hashlib.blake2b(digest_size=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in spans:
            h.update(os.pread(fd, min(length, PAGE), offset))
            if length > PAGE:
                h.update(os.pread(fd, PAGE, offset + length - PAGE))
    finally:
        os.close(fd)
    return h.hexdigest()


class Cache:
    """Converted models, under ``<cache root>/converted`` unless another folder is given."""

    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else cache_root() / "converted"
        self.root.mkdir(parents=True, exist_ok=True)

    def entry(self, key: str) -> Entry:
        return Entry(key, self.root / key)

    def lookup(self, key: str) -> Optional[Entry]:
        """The verified entry for ``key``, or None (a broken one is moved aside for rebuilding)."""
        e = self.entry(key)
        if not e.path.exists():
            return None
        problem = self.verify(e)
        if problem is None:
            try:
                os.utime(e.path / MANIFEST)  # recency for prune(): least recently used goes first
            except OSError:
                pass
            return e
        log.info("ortmem: cache entry %s is unusable (%s); rebuilding", e.path, problem)
        self._discard(e.path)
        return None

    def discard(self, e: Entry) -> None:
        """Remove an entry (a reader that already opened its files keeps them)."""
        self._discard(e.path)

    def verify(self, e: Entry) -> Optional[str]:
        """None when the entry is whole and what its manifest says; else what is wrong."""
        try:
            m = e.manifest()
        except (OSError, ValueError) as exc:
            return f"manifest unreadable: {exc}"
        if m.get("format") != FORMAT or m.get("key") != e.key:
            return "manifest from another format or key"
        for name, size in m.get("files", {}).items():
            p = e.path / name
            if not p.is_file() or p.stat().st_size != size:
                return f"{name} missing or of the wrong size"
        if hashlib.sha256(e.model_path.read_bytes()).hexdigest() != m.get("model_sha256"):
            return "model.onnx changed"
        spans = [tuple(s) for s in m.get("spans", [])]
        if spans and spot_digest(e.weights_path, spans) != m.get("spot_digest"):
            return "weights.bin content changed"
        return None

    def build(self, key: str, builder: Callable[[Path], dict[str, Any]]) -> Entry:
        """Build an entry with ``builder(tmpdir) -> manifest extras`` and publish it atomically.

        ``builder`` writes ``model.onnx`` and ``weights.bin`` into ``tmpdir`` and returns
        ``{"spans": [(offset, length), ...], ...}``; the manifest is completed here.
        """
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            extras = builder(tmp)
            files = {f.name: f.stat().st_size for f in tmp.iterdir() if f.is_file()}
            manifest = {
                "format": FORMAT,
                "key": key,
                "created": time.time(),
                "files": files,
                "model_sha256": hashlib.sha256((tmp / MODEL_FILE).read_bytes()).hexdigest(),
                **extras,
            }
            spans = [tuple(s) for s in manifest.get("spans", [])]
            if spans:
                manifest["spot_digest"] = spot_digest(tmp / WEIGHTS_FILE, spans)
            _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
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
            _fsync_dir(self.root)
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
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
            if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists():
                yield Entry(p.name, p)

    def clear(self) -> int:
        """Remove every entry and leftover temporary folder; returns bytes freed."""
        freed = 0
        for p in list(self.root.iterdir()):
            if p.is_dir():
                freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                self._discard(p)
        return freed

    def prune(self, max_bytes: int, *, keep: Optional[str] = None) -> int:
        """Discard least recently used entries until what the entries own on disk is at most
        ``max_bytes`` (``keep``, e.g. the entry just built, is never discarded); returns bytes freed.

        Safe beside live sessions: a discarded entry is renamed away before it is deleted, and a
        process that already mapped its files keeps them until it is done.
        """
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
        trash = self.root / f".trash-{uuid.uuid4().hex}"
        try:
            os.rename(path, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)


def reserve(path: Path, size: int) -> int:
    """Create ``path`` with ``size`` bytes of disk actually allocated; returns an open fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
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
