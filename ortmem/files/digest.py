"""Content digests of cache files: a full digest (every byte) and a sampled one (a few pages).

Why a full digest: a byte flipped in the middle of a tensor changes outputs silently (ORT maps the
file as is), and page samples miss it. Why xxh3-128: the digest guards against damage (bit rot, a
partial copy, an edit), not against an attacker (the cache's ownership and mode checks do that,
see docs/cache-security.md), so a non-cryptographic hash is enough, and it is the only one fast
enough to check every byte on every warm start. Measured on this project's CI machine (64 MiB
buffer hashed 8 times, in memory): xxh3_128 0.05 s/GB, blake3 0.28, sha256 0.71, blake2b 1.50 (see
docs/cache-security.md for the command). When xxhash is not installed, sha256 is used.

A digest string names its algorithm (``"xxh3_128:<hex>"``), so an entry written with one can be
checked (or refused as unverifiable) by a process that has another.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from ortmem.base.hashing import xxhash as _xxhash  # the module, or None where it is not installed
from ortmem.base.units import PAGE
from ortmem.files import stamps

PathLike = Union[str, os.PathLike]

#: ``verify=`` values: every byte of every file on every start; every byte of every file once per boot
#: and again whenever the file changes (:mod:`ortmem.files.stamps`); the first/last page of each span
#: (plus sizes, and small files such as the skeleton in full); sizes and the skeleton only.
VERIFY_MODES = ("always", "full", "sampled", "off")
#: The modes that check every byte (the others check samples or sizes).
FULL_MODES = ("always", "full")
#: ``verify="sampled"`` digests a cache file of at most this size in full (a skeleton, a manifest): it is
#: read in one go, and it may be what says which pages of the large ones are the samples.
SAMPLED_FULL_BYTES = 1 << 20
#: Default chosen by measurement: a full check costs 0.05 s/GB of hashing plus the read from the
#: page cache (docs/cache-security.md), small beside ORT's own session creation on the same bytes.
DEFAULT_VERIFY = "full"
_CHUNK = 8 << 20


def _hasher(algorithm: str):
    if algorithm == "xxh3_128" and _xxhash is not None:
        return _xxhash.xxh3_128()
    if algorithm == "sha256":
        import hashlib  # only where xxhash is missing: hashlib loads OpenSSL (ortmem.base.hashing)

        return hashlib.sha256()
    return None


def preferred_algorithm() -> str:
    return "xxh3_128" if _xxhash is not None else "sha256"


class RunningDigest:
    """A full digest fed with a file's bytes, in file order, as they are produced: the same string
    :func:`file_digest` gives for the finished file, without reading it back (a new cache entry is
    hashed while it is written)."""

    def __init__(self, algorithm: Optional[str] = None) -> None:
        self.algorithm = algorithm or preferred_algorithm()
        self._h = _hasher(self.algorithm)
        if self._h is None:
            raise ValueError(f"digest algorithm {self.algorithm!r} is not available")

    def update(self, data) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{self.algorithm}:{self._h.hexdigest()}"


def bytes_digest(data) -> str:
    """The full digest of a file that will hold exactly ``data``."""
    running = RunningDigest()
    running.update(data)
    return running.hexdigest()


def file_digest(path: PathLike, algorithm: Optional[str] = None) -> str:
    """``"<algorithm>:<hex>"`` over every byte of ``path`` (read in chunks; symlinks refused)."""
    running = RunningDigest(algorithm)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            running.update(view[:n])
    finally:
        os.close(fd)
    return running.hexdigest()


def matches(path: PathLike, recorded: object, *, stamped: bool = True) -> bool:
    """True when ``path``'s full digest equals ``recorded`` (False when unreadable/unverifiable).

    ``stamped``: a file this process or another already found whole this boot, with the same identity,
    is not read again (:mod:`ortmem.files.stamps`); a match is stamped for the next check."""
    if not isinstance(recorded, str) or ":" not in recorded:
        return False
    algorithm = recorded.split(":", 1)[0]
    if _hasher(algorithm) is None:
        return False
    where = stamps.folder() if stamped else None
    before = stamps.identity(Path(path)) if where is not None else None
    if before is not None and stamps.is_stamped(where, Path(path), before, recorded):
        return True
    try:
        ok = file_digest(path, algorithm) == recorded
    except OSError:
        return False
    if ok and before is not None:
        stamps.stamp(where, Path(path), before, recorded)
    return ok


def matches_every_byte(path: PathLike, recorded: object) -> bool:
    """:func:`matches` reading every byte now, whatever was checked before (``verify="always"``,
    ``ortmem cache verify``)."""
    return matches(path, recorded, stamped=False)


def matcher(mode: str) -> Callable[[PathLike, object], bool]:
    """The full check a ``verify=`` mode asks for: :func:`matches_every_byte` for ``"always"``, else
    :func:`matches` (stamped)."""
    return matches_every_byte if mode == "always" else matches


def sample_hasher():
    """The hasher of sampled digests (this module's and the pre-packed files'): xxh3-128, 32 hex
    characters; blake2b-128 where xxhash is missing (hashlib, which loads OpenSSL, is imported only
    then: :mod:`ortmem.base.hashing`). Entries record it, so a change of hasher goes with new keys."""
    if _xxhash is not None:
        return _xxhash.xxh3_128()
    import hashlib

    return hashlib.blake2b(digest_size=16)


def sampled_digest(path: PathLike, spans: Iterable[tuple[int, int]]) -> str:
    """Hash the first and last page of every span: catches truncation, zeroed or swapped tensors
    without reading gigabytes (``verify="sampled"``)."""
    h = sample_hasher()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        for offset, length in spans:
            h.update(os.pread(fd, min(length, PAGE), offset))
            if length > PAGE:
                h.update(os.pread(fd, PAGE, offset + length - PAGE))
    finally:
        os.close(fd)
    return h.hexdigest()


def check_mode(verify: str) -> str:
    """``verify`` validated (a clear error for a typo, not a silent default)."""
    if verify not in VERIFY_MODES:
        from ortmem.errors import OrtmemError

        raise OrtmemError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
    return verify


