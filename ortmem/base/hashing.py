"""Short names derived from content: cache keys, stamp names, release-probe ids.

Why not ``hashlib``: importing it loads OpenSSL's libcrypto, a few MiB of resident memory that
every start would pay for a 32-character name. xxhash, already the full digests' hash (:mod:`ortmem.files.digest`)
and a dependency, names them as well: a name identifies content, it guards nothing (the cache's
ownership and mode checks do, docs/cache-security.md). Where xxhash is missing, sha256 names them
(hashlib imported then), so the names differ between such environments, never within one.
"""
from __future__ import annotations

try:  # pragma: no cover - exercised whichever way the environment is
    import xxhash  # also ortmem.files.digest's: the one place that asks whether it is installed
except ImportError:  # pragma: no cover
    xxhash = None

#: The most hex characters a name can have (xxh3-128's digest).
MAX_LENGTH = 32


def short_hash(blob: bytes, length: int = MAX_LENGTH) -> str:
    """The first ``length`` (at most :data:`MAX_LENGTH`) hex characters of ``blob``'s hash."""
    if not 0 < length <= MAX_LENGTH:
        raise ValueError(f"a short hash has 1 to {MAX_LENGTH} hex characters, not {length}")
    if xxhash is not None:
        return xxhash.xxh3_128_hexdigest(blob)[:length]
    import hashlib

    return hashlib.sha256(blob).hexdigest()[:length]
