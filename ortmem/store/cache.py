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
are not symbolic links, and neither group nor others may write them (:mod:`ortmem.files.trust`).
:func:`ortmem.files.trust.cache_file_problem` is the one check every file read from the cache passes (an entry's files and
manifest, and every other file in its folder, pre-packed weights included), so a new kind of file
cannot be read unchecked. A folder that already exists is never re-moded (a user's 0777
``ORTMEM_CACHE_DIR`` stays 0777 and is then not used; with the sticky bit, as /tmp has, the private
``converted/`` folder ortmem creates in it is).
Integrity: the manifest records a full digest of every file (:mod:`ortmem.files.digest`), checked on
every lookup in full, sampled or not at all (``verify=``), and in full before anything is derived
from the entry (pre-packing) and by ``ortmem cache verify``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from ortmem.base import logs
from ortmem.files import digest
from ortmem.errors import CacheError
from ortmem.base.child_env import STORE_FOLDER, cache_folder
from ortmem.files.layout import MANIFEST, MODEL_FILE, SOURCE_LINK_PREFIX, WEIGHTS_FILE, Entry, reclaimable_bytes
from ortmem.files.sources import linked_digests, private_mode, source_content, source_record, sources_problem
from ortmem.files.trust import (PRIVATE_FILE_MODE, TMP_PREFIX, TRASH_PREFIX, cache_file_problem, fsync_dir, make_private_dir, parent_untrusted_reason, read_nofollow, remove_aside, untrusted_reason, write_new)


#: 2: identities with ctime, a full digest of every file, private modes.
FORMAT = 2
#: A temporary folder or file nobody has written for this long, whose writer is not a live process
#: on this machine, is a crash leftover (a writer touches its files continuously; another container's
#: pids are invisible here, hence the idle time too). After a day it is stale whatever the pid says.
STALE_IDLE_SECONDS = 600.0
STALE_ANY_SECONDS = 86400.0


class UntrustedCacheError(CacheError):
    """The cache folder could be written by someone else: it is not used at all."""


def cache_root() -> Path:
    """``$ORTMEM_CACHE_DIR``, else the platform's user cache dir; created private on first use."""
    path = cache_folder()
    make_private_dir(path, parents=True)
    return path


def spot_digest(path: Path, spans: list[tuple[int, int]]) -> str:
    """Sampled digest of ``spans`` (:func:`ortmem.files.digest.sampled_digest`)."""
    return digest.sampled_digest(path, spans)


class Cache:
    """Converted models, under ``<cache root>/converted`` unless another folder is given.

    Raises :class:`CacheError` when the folder cannot be created, and :class:`UntrustedCacheError`
    when someone else could write it; :func:`open_cache` turns both into one warning and None.
    """

    def __init__(self, root: Optional[Path] = None, *, verify: str = digest.DEFAULT_VERIFY):
        self.verify_mode = digest.check_mode(verify)
        problem: Optional[str] = None
        try:
            self.root = Path(root) if root is not None else cache_root() / STORE_FOLDER
            if self.root.parent.is_dir():  # an untrusted parent gets nothing created in it
                problem = parent_untrusted_reason(self.root)
            if problem is None and not self.root.is_dir():  # an existing one (read-only, say) is not touched
                make_private_dir(self.root, parents=True)
        except OSError as exc:
            raise CacheError(f"cache folder cannot be created: {exc.strerror or exc}",
                             file=str(root if root is not None else "<cache root>")) from exc
        problem = problem or untrusted_reason(self.root) or parent_untrusted_reason(self.root)
        if problem:
            raise UntrustedCacheError(f"cache folder {problem}; it is not used (ortmem changes no folder it "
                                      "did not create: make it private, or give a shared parent the sticky bit)",
                                      file=str(self.root))

    def entry(self, key: str) -> Entry:
        return Entry(key, self.root / key)

    @functools.cached_property
    def writable(self) -> bool:
        """Whether this process may create files in the cache folder. False for a cache deployed
        read-only (``ortmem prepare`` at build time, a read-only mount or another user's folder at
        run time): lookups then write nothing (no recency, no manifest update) and nothing is left
        to build in the background."""
        return os.access(self.root, os.W_OK | os.X_OK)

    def lookup(self, key: str, *, verify: Optional[str] = None) -> Optional[Entry]:
        """The verified entry for ``key``, or None (a broken one is moved aside for rebuilding)."""
        e = self.entry(key)
        if not os.path.lexists(e.path):
            return None
        problem = self.verify(e, mode=verify)
        if problem is None:
            if self.writable:  # a read-only cache (deployed by `ortmem prepare`) is never written
                try:
                    os.utime(e.path / MANIFEST, follow_symlinks=False)  # recency for prune(), best effort
                except OSError:
                    pass
            return e
        logs.warning(__name__, "ortmem: cache entry %s is unusable (%s); rebuilding", e.path, problem)
        remove_aside(e.path)
        return None

    def lookup_sourced(self, key: str) -> Optional[Entry]:
        """:meth:`lookup`, then the sources the entry's manifest records (:func:`ortmem.files.sources.source_record`):
        an entry whose source changed is discarded (None). The manifest update that follows a confirmed
        content (a source's new ctime) is best effort: a read-only cache only digests again next time."""
        entry = self.lookup(key)
        if entry is None:
            return None
        try:
            manifest = entry.manifest()
        except (OSError, ValueError):
            manifest = {}
        manifest = manifest if isinstance(manifest, dict) else {}
        problem, update = sources_problem(manifest)
        if problem is not None:
            logs.info(__name__, "ortmem: %s of cache entry %s; rebuilding", problem, entry.path)
            self.discard(entry)
            return None
        if update and self.writable:
            try:
                entry.rewrite_manifest({k: v for k, v in {**manifest, **update}.items() if v is not None})
            except OSError:
                pass
        return entry

    def discard(self, e: Entry) -> None:
        """Remove an entry (a reader that already opened its files keeps them)."""
        remove_aside(e.path)

    def verify(self, e: Entry, *, mode: Optional[str] = None) -> Optional[str]:
        """None when the entry is whole, private and what its manifest says; else what is wrong.

        ``mode`` (default: the cache's ``verify``): "always" digests every byte of every file, "full" too
        unless this boot already did with the file unchanged (:mod:`ortmem.files.stamps`),
        "sampled" the first and last page of every weight span of ``weights.bin`` and every small file
        in full (a finished entry's data file is sampled by :mod:`ortmem.store.finished_entries`, which
        knows its spans), "off" checks sizes and the skeleton.
        Every file in the entry's folder, listed in its manifest or not (pre-packed weights, and any
        file a later kind of entry adds), passes :func:`ortmem.files.trust.cache_file_problem`: one symbolic link, file of
        another user or file others may write, and the whole entry is refused. Names starting with "."
        are a writer's temporaries, which no reader opens.
        """
        mode = digest.check_mode(mode or self.verify_mode)
        problem = untrusted_reason(e.path)
        if problem:
            return f"entry folder {problem}"
        problem = cache_file_problem(e.path / MANIFEST)
        if problem:
            return problem
        try:
            m = e.manifest()
        except (OSError, ValueError) as exc:
            return f"manifest unreadable: {exc}"
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("key") != e.key:
            return "manifest from another format or key"
        files = m.get("files")
        digests = m.get("digests")
        if not isinstance(files, dict) or not isinstance(digests, dict) or (MODEL_FILE not in files
                                                                          and m.get("marker") is not True):
            return "manifest lists no files"  # only a marker (a decision, no model: ortmem.store.finished_entries) has none
        for name in files:
            if os.sep in str(name) or str(name).startswith("."):
                return f"manifest names {name!r}"
        try:
            present = sorted(n for n in os.listdir(e.path) if not n.startswith("."))
        except OSError as exc:
            return f"entry folder unreadable: {exc.strerror or exc}"
        for name in files:
            if name not in present:
                return f"{name} missing"
        for name in present:
            full = name in files and (mode in digest.FULL_MODES or name == MODEL_FILE or (
                mode == "sampled" and name != WEIGHTS_FILE and _small(files.get(name))))
            problem = cache_file_problem(e.path / name, size=files.get(name),
                                         recorded=digests.get(name, "") if full else None,
                                         owner_only=not name.startswith(SOURCE_LINK_PREFIX), matches=digest.matcher(mode))
            if problem:
                return problem
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
        import shutil
        import uuid

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
                        "onnxruntime": _ort_version(), **extras}
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

    def build_sourced(self, key: str, source: Path, sources: Sequence[Path],
                      builder: Callable[[Path], dict[str, Any]]) -> Entry:
        """:meth:`build` for an entry made from files: the model ``source`` and ``sources`` (its .onnx
        and every data file). The manifest records them (:func:`ortmem.files.sources.source_record`),
        so :meth:`lookup_sourced` discards the entry once one changes; hard-linked sources get the
        digests just taken of them (each source is read once); files are no more permissive than
        ``source`` (:func:`ortmem.files.sources.private_mode`).

        The sources' digests are taken while the builder runs, in a thread: a full digest reads every
        source byte (0.7 s for the 0.6 GB model's 1 GB of sources on 2 cores, most of it the
        read), and the builder leaves a core idle while it waits on page faults and writes. Their
        identities are taken after it, as before (its hard links move their ctime)."""

        from concurrent.futures import ThreadPoolExecutor  # here: a warm start imports this module, builds nothing

        def build(folder: Path) -> dict[str, Any]:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ortmem-source-digest") as pool:
                digesting = pool.submit(source_content, list(sources))
                made = builder(folder)
                record = source_record(list(sources), digesting.result())
            extras: dict[str, Any] = {"spans": made.get("spans", []), "source": str(source),
                                      **{k: v for k, v in made.items() if k not in ("spans", "digests")}, **record}
            extras["digests"] = {**(made.get("digests") or {}),
                                 **linked_digests(folder, record["sources"], record["source_content"])}
            return extras

        return self.build(key, build, file_mode=private_mode(source))

    @contextlib.contextmanager
    def creating(self, key: str, *, timeout: Optional[float] = None,
                 inherited_fd: Optional[int] = None) -> Iterator[None]:
        """Hold the creator lock of ``key``: whoever holds it builds or adds to the entry; others wait
        (at most ``timeout`` seconds, default :func:`lock_timeout`) and then look again.

        Raises :class:`LockBusyError` (naming the lock and its holder's pid) when another process still
        holds it after ``timeout``: a stopped or starved holder must never stall later starts, so the
        caller goes on without the entry's new work (loads the entry as it is, or converts without the cache).
        ``timeout=0`` never waits. ``inherited_fd``: a descriptor of the lock file already locked by
        the process that started this one (:mod:`ortmem.store.finisher`), adopted instead of locking anew.

        The lock is an ``flock`` on ``<root>/.lock-<key>``, whose holder writes its pid into it and
        removes it before it lets go, so nothing is left behind (:func:`acquire_creator_lock`). A lock
        that cannot be taken at all (no ``flock`` on this filesystem) is skipped, which only costs
        duplicated work: the atomic rename still decides.
        """
        path = creator_lock_path(self.root, key)
        fd = acquire_creator_lock(path, lock_timeout() if timeout is None else timeout, inherited_fd=inherited_fd)
        try:
            yield
        finally:
            release_creator_lock(path, fd)

    def entries(self) -> Iterator[Entry]:
        for p in sorted(self.root.iterdir()):
            if not p.is_symlink() and p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists():
                yield Entry(p.name, p)

    def made_for_other_release(self, source: Path) -> Optional[str]:
        """The onnxruntime version an entry of the model file ``source`` was made with, when that is
        not the installed one (None: no such entry). Such an entry was made stale by an onnxruntime
        upgrade: its key names the old release, so no lookup finds it any more. Reads every entry's
        manifest: asked once per model and process (:func:`ortmem.store.verdict.start`'s miss)."""
        here = _ort_version()
        wanted = str(Path(source).resolve())
        try:
            entries = list(self.entries())
        except OSError:
            return None
        for e in entries:
            try:
                m = e.manifest()
            except (OSError, ValueError):
                continue
            if not isinstance(m, dict) or not isinstance(m.get("onnxruntime"), str) or m["onnxruntime"] == here:
                continue
            recorded = m.get("sources")
            first = recorded[0] if isinstance(recorded, list) and recorded else None
            first = first.get("path") if isinstance(first, dict) else None
            if wanted in (first, m.get("source")):
                return m["onnxruntime"]
        return None

    def clear(self) -> int:
        """Remove every entry and leftover temporary folder, and every creator lock no live process
        holds (a held one stays: removing it would let a second creator in); returns the bytes of
        disk freed (:func:`reclaimable_bytes`)."""
        freed = 0
        for p in list(self.root.iterdir()):
            if p.is_symlink():
                _unlink_quiet(p)
            elif is_lock_file(p):
                remove_unheld_lock(p)
            elif p.is_dir():
                freed += reclaimable_bytes(p)
                remove_aside(p)
            elif p.name.startswith("."):
                freed += reclaimable_bytes(p)
                _unlink_quiet(p)
        return freed

    def reclaim_stale(self, *, now: Optional[float] = None) -> int:
        """Remove crash leftovers: temporary and trash folders at the root and temporary files and
        folders inside entries (pre-packing), whose writer is gone (see ``STALE_IDLE_SECONDS``), and
        creator lock files no live process holds (a creator killed after publishing leaves its lock
        file behind: :func:`remove_unheld_lock`). Called by every writer and by prune/clear; returns
        the bytes of disk freed (:func:`reclaimable_bytes`, counted before each removal)."""
        import shutil

        now = time.time() if now is None else now
        freed = 0
        candidates: list[Path] = []
        try:
            top = list(self.root.iterdir())
        except OSError:
            return 0
        for p in top:
            if is_lock_file(p):
                if p.is_symlink():
                    _unlink_quiet(p)
                else:
                    remove_unheld_lock(p)
            elif p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                candidates.append(p)
            elif not p.name.startswith(".") and p.is_dir() and not p.is_symlink():
                try:
                    candidates.extend(c for c in p.iterdir() if c.name.startswith("."))
                except OSError:
                    continue
        for c in candidates:
            if _is_stale(c, now):
                freed += reclaimable_bytes(c)
                if c.is_dir() and not c.is_symlink():
                    shutil.rmtree(c, ignore_errors=True)
                else:
                    _unlink_quiet(c)
        return freed

    def prune(self, max_bytes: int, *, keep: Optional[str] = None) -> int:
        """Discard least recently used entries until what the entries own on disk is at most
        ``max_bytes`` (``keep``, e.g. the entry just built, is never discarded); returns the bytes of
        disk freed, crash leftovers (removed first, :meth:`reclaim_stale`) included.

        Safe beside live sessions: a discarded entry is renamed away before it is deleted, and a
        process that already mapped its files keeps them until it is done.
        """
        freed = self.reclaim_stale()
        known: list[tuple[float, Entry, int]] = []
        for e in self.entries():
            try:
                known.append((e.last_used(), e, e.owned_bytes()))
            except OSError:  # discarded meanwhile by another process
                continue
        entries = [e for _, e, _ in sorted(known, key=lambda k: k[0])]
        owned = {e.key: n for _, e, n in known}
        total = sum(owned.values())
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
        from ortmem.base.units import parse_bytes

        freed = self.prune(parse_bytes(limit), keep=keep)
        if freed:
            logs.info(__name__, "ortmem: cache limit ORTMEM_CACHE_MAX_SIZE=%s: removed %.1f MiB (least recently used "
                     "entries, crash leftovers)", limit, freed / 2**20)
        return freed


def creator_lock_path(root: Path, key: str) -> Path:
    """The file :meth:`Cache.creating` locks for ``key``: it exists only while someone holds or waits
    for the lock (its holder removes it), so its presence says that work on the entry is under way."""
    return Path(root) / f".lock-{key}"


#: Seconds a start waits for another process's creator lock before going on without it. Long
#: enough for a multi-GB conversion on a slow disk (a 1.6 GB model converts in 5-13 s on a shared
#: 2-core machine, docs/benchmarks.md), short enough that a stopped or starved holder costs a bounded delay.
DEFAULT_LOCK_TIMEOUT = 120.0
#: Overrides :data:`DEFAULT_LOCK_TIMEOUT` (seconds; 0: never wait).
LOCK_TIMEOUT_ENV = "ORTMEM_LOCK_TIMEOUT"
#: Longest pause between two tries of a busy lock (``flock`` itself cannot time out): a waiter takes a
#: freed lock within this.
LOCK_POLL_MAX_SECONDS = 0.05


class LockBusyError(CacheError):
    """Another process held a creator lock for longer than the caller would wait."""

    def __init__(self, path: Path, holder: Optional[int], waited: float):
        self.holder = holder
        who = f"pid {holder}" if holder is not None else "another process"
        super().__init__(f"the creator lock is held by {who}; gave up after {waited:g} s "
                         f"(${LOCK_TIMEOUT_ENV} sets the limit)", file=str(path))


def lock_timeout() -> float:
    """``$ORTMEM_LOCK_TIMEOUT`` seconds, else :data:`DEFAULT_LOCK_TIMEOUT` (an unreadable value is
    logged once per call and ignored: a typo must not turn the wait into forever or into none)."""
    text = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        logs.warning(__name__, "ortmem: %s=%r is not a number of seconds; waiting at most %g s", LOCK_TIMEOUT_ENV, text,
                    DEFAULT_LOCK_TIMEOUT)
        return DEFAULT_LOCK_TIMEOUT
    return value


def lock_holder(path: Path) -> Optional[int]:
    """The pid its holder wrote into a creator lock file (None: none yet, or the file is gone)."""
    try:
        text = read_nofollow(path)[:32].decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def acquire_creator_lock(path: Path, timeout: float, *, inherited_fd: Optional[int] = None) -> int:
    """Lock ``path`` (``flock``, exclusive) within ``timeout`` seconds; returns the locked descriptor,
    or -1 where this filesystem has no ``flock`` (the caller goes on unlocked). Raises
    :class:`LockBusyError` when another process holds it past ``timeout``.

    ``flock`` has no timeout of its own, so a busy lock is tried again after pauses growing to
    :data:`LOCK_POLL_MAX_SECONDS`. The holder removes the file before it lets go, so a lock taken on
    a file that is no longer the one at ``path`` is dropped and the path opened again.
    """
    import fcntl  # only here and in _adopted_lock: a warm start takes no lock

    deadline = time.monotonic() + max(timeout, 0.0)
    pause = 0.002
    fd = _adopted_lock(path, inherited_fd)
    while fd is None:
        try:
            candidate = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            logs.debug(__name__, "ortmem: no creator lock %s (%s)", path, exc)
            return -1
        try:
            fcntl.flock(candidate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(candidate)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockBusyError(path, lock_holder(path), timeout) from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, LOCK_POLL_MAX_SECONDS)
            continue
        except OSError as exc:
            logs.debug(__name__, "ortmem: flock refused for %s (%s)", path, exc)
            os.close(candidate)
            return -1
        if _locks_path(candidate, path):
            fd = candidate
        else:
            os.close(candidate)  # its holder removed it meanwhile: lock the file now at the path
    _write_holder(fd)
    return fd


def release_creator_lock(path: Path, fd: int) -> None:
    """Remove the lock file (only while it is still the one ``fd`` locks) and let go of the lock."""
    if fd < 0:
        return
    try:
        if _locks_path(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)  # releases the lock


def _adopted_lock(path: Path, fd: Optional[int]) -> Optional[int]:
    """``fd`` when it is a lock on the file at ``path`` that this process now holds (locking again
    through a descriptor whose open file already holds the lock succeeds at once); else None."""
    if fd is None:
        return None
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _locks_path(fd, path):
            return fd
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass
    return None


def _locks_path(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file now at ``path`` (not one its holder removed)."""
    try:
        st = os.fstat(fd)
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _write_holder(fd: int) -> None:
    """Write this process's pid into the lock it now holds, for the message of whoever waits on it."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def open_cache(root: Optional[Path] = None, *, verify: str = digest.DEFAULT_VERIFY) -> Optional[Cache]:
    """The cache at ``root`` (default: the user's), or None with one warning when it cannot be
    used (read-only, uncreatable, or writable by someone else): the caller converts without a cache."""
    try:
        return Cache(root, verify=verify)
    except CacheError as exc:
        logs.warning(__name__, "ortmem: not using the cache (%s); converting without it", exc)
        return None


def _ort_version() -> str:
    """The installed onnxruntime's version, as entries record it (imported here: the store's lookups of
    a start have imported it already, and the hook's light route never asks)."""
    import onnxruntime as ort

    return ort.__version__


def _small(size: object) -> bool:
    """Whether a file of the recorded ``size`` is digested in full even by ``verify="sampled"`` (a
    manifest, the finished model's own ``model.json``: what says which pages the samples are)."""
    return isinstance(size, int) and size <= digest.SAMPLED_FULL_BYTES


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


def is_lock_file(path: Path) -> bool:
    """Whether ``path`` is named as a creator lock (:func:`creator_lock_path`, whose name it asks)."""
    return path.name.startswith(creator_lock_path(path.parent, "").name)


def remove_unheld_lock(path: Path) -> bool:
    """Remove the creator lock file ``path`` when no live process holds its lock; True if removed.

    A creator killed after publishing leaves its lock file, which no one removes otherwise (and
    whose presence tells :mod:`ortmem.store.finisher` that packing is under way). Safe beside live
    processes: the lock is taken without waiting, exactly as a creator takes it, and the file removed
    as its holder removes it (:func:`release_creator_lock`), so a holder keeps its lock and a waiter
    that opened the old file opens the path again. Where ``flock`` is missing the file stays: who
    holds it cannot be told there.
    """
    try:
        fd = acquire_creator_lock(path, 0.0)
    except CacheError:  # held by a live process
        return False
    if fd < 0:
        return False
    release_creator_lock(path, fd)
    return True


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
