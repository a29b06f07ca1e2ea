"""Entry keys and what an entry records of the files it was made from.

A key is a stable hex digest over everything an entry's bytes depend on (the source's identity, the
settings, the versions that shape the output: :func:`make_key`), so a lookup needs no parsing of the
model at all. A source's identity is what ``stat`` gives that a replacement or an in-place write must
change (:func:`file_identity`); the parts other entries' hard links move (ctime, link count) are kept
out of keys (:func:`key_identity`). Every entry kind (converted, finished) records its sources in its
manifest, so its external data files and the edits ``stat`` cannot see (an in-place write with the
mtime set back, a rewrite within one timestamp tick) are checked on every lookup: :func:`source_record`
writes that record, :func:`sources_problem` judges it
(:meth:`ortmem.store.cache.Cache.lookup_sourced` discards an entry whose source changed).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ortmem import __version__
from ortmem.base.hashing import short_hash
from ortmem.files import digest
from ortmem.files.layout import SOURCE_LINK_PREFIX
from ortmem.files.trust import RACY_SECONDS
from ortmem.files.trust import PRIVATE_FILE_MODE

if TYPE_CHECKING:
    from ortmem.ort.settings import OrtSettings

#: Bumped whenever the converted graph for the same input changes (new rewrites, different layouts),
#: so entries written by an older conversion are never taken for hits.
CONVERSION_FORMAT = 3


def make_key(parts: dict[str, Any]) -> str:
    """A stable hex key over everything the cached bytes depend on (sources, options, versions)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return short_hash(blob)


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


def entry_key(source: Path, parts: Mapping[str, Any]) -> str:
    """The key of an entry made from the model file ``source``: its identity (:func:`key_identity`) and
    ``parts``, everything else the entry's bytes depend on (what it is, the options, the versions). A
    lookup needs no parsing of the model at all."""
    return make_key({**parts, "model": key_identity(Path(source))})


def onnx_version() -> str:
    """``onnx.__version__`` without importing onnx (0.07 s and ~5 MiB a warm start would pay only for
    its key): the one ``onnx-<version>.dist-info`` folder beside the package, which is what onnx's own
    ``__version__`` reads (``importlib.metadata``, itself another 0.04 s); onnx imported as the fallback
    where the folder is not found or not alone (an editable or unusual install)."""
    loaded = sys.modules.get("onnx")
    if loaded is not None:
        return loaded.__version__
    import importlib.util

    spec = importlib.util.find_spec("onnx")
    if spec is not None and spec.origin:
        try:
            found = [m.group(1) for m in map(_DIST_INFO.fullmatch, os.listdir(Path(spec.origin).parent.parent)) if m]
        except OSError:
            found = []
        if len(found) == 1:
            return found[0]
    import onnx

    return onnx.__version__


_DIST_INFO = re.compile(r"onnx-([^-]+)\.dist-info")


def converted_key(model_path: Path, settings: "OrtSettings", extra: Optional[Mapping[str, Any]] = None) -> str:
    """The key of a model's conversion: the .onnx file's identity, the options the result depends
    on, and the versions that shape it. External data files are checked at lookup (their identities
    are in the manifest), so a warm start finds its entry without parsing the model at all."""
    import onnxruntime as ort

    return entry_key(Path(model_path), {
        "what": "dq-matmulnbits",
        "format": CONVERSION_FORMAT,
        "settings": {"level": settings.graph_optimization_level, "config": dict(settings.session_config),
                     "disabled": sorted(settings.disabled_optimizers)},
        "ortmem": __version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx_version(),  # the version that shapes the converted skeleton
        **(extra or {}),
    })


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


# A source modified within RACY_SECONDS (ortmem.files.trust) may be rewritten again within the same
# filesystem timestamp tick with the same size, which ``stat`` cannot see (git's "racy" files). Such an
# entry records a full digest of its sources, checked on lookups until the source is older than that.


def private_mode(source: Path) -> int:
    """0600, or the source model's mode where that is stricter (a 0400 model gives 0400 files)."""
    try:
        return (PRIVATE_FILE_MODE & os.stat(source).st_mode) | 0o400
    except OSError:
        return PRIVATE_FILE_MODE


def sources_problem(manifest: dict[str, Any]) -> tuple[Optional[str], dict[str, Any]]:
    """(why the sources recorded by :func:`source_record` no longer hold, or None; the manifest fields
    to rewrite so the next check needs no digest, a value None meaning "drop the field")."""
    try:
        recorded = manifest.get("sources", [])
        current = [file_identity(Path(s["path"])) for s in recorded]
        verdicts = [same_source(r, c) for r, c in zip(recorded, current)]
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        verdicts = [False]
    if not recorded or False in verdicts:
        return "a source was edited (even with its mtime restored) or replaced", {}
    pinned = manifest.get("source_digests")
    if pinned is not None:
        if not isinstance(pinned, list) or len(pinned) != len(recorded) or not all(
                digest.matches(Path(s["path"]), d) for s, d in zip(recorded, pinned)):
            return "a source changed within its timestamp tick", {}
    update: dict[str, Any] = {}
    if None in verdicts:  # only ctime moved: another entry's link/unlink, or an in-place edit? Ask the content.
        content = manifest.get("source_content")
        if not (isinstance(content, list) and len(content) == len(recorded)
                and all(digest.matches(Path(s["path"]), d) for s, d, v in zip(recorded, content, verdicts) if v is None)):
            return "a source changed in place", {}
        update["sources"] = current  # same bytes: record the new identity so the next start needs no digest
    if pinned is not None and not racy(current):  # content confirmed and now stat can tell any later edit
        update["source_digests"] = None
    return None, update


def source_content(paths: list[Path]) -> list[str]:
    """The full digest of each source file (:func:`ortmem.files.digest.file_digest`), in order."""
    return [digest.file_digest(Path(p).resolve()) for p in paths]


def source_record(paths: list[Path], content: Optional[list[str]] = None) -> dict[str, Any]:
    """What an entry records of the files it was made from, for :func:`sources_problem`: their
    identities, taken now (after the builder has hard-linked any of them, which moves their ctime);
    a content digest of each (``content`` when the caller took it already, see
    :meth:`ortmem.store.cache.Cache.build_sourced`), kept for good and checked only when a source's
    ctime moved with everything else equal (another entry's hard link, or an edit with mtime set
    back; ~0.1 s/GB from the page cache); and for a source written just now the same digests as
    ``source_digests``, checked on every lookup until stat alone can vouch for it."""
    sources = [file_identity(Path(p)) for p in paths]
    record: dict[str, Any] = {"sources": sources,
                              "source_content": source_content(paths) if content is None else list(content)}
    if racy(sources):
        record["source_digests"] = record["source_content"]
    return record


def racy(identities: list[dict[str, Any]]) -> bool:
    """Whether any of these source identities was modified within :data:`RACY_SECONDS`."""
    now = time.time_ns()
    return any(now - int(s["mtime_ns"]) < RACY_SECONDS * 1e9 for s in identities)


def linked_digests(folder: Path, sources: list[dict[str, Any]], content: list[str]) -> dict[str, str]:
    """The digests of an entry's hard-linked sources: a link is its source's inode, whose digest was
    just taken (so each source is read once for both)."""
    by_inode = {(s["dev"], s["inode"]): d for s, d in zip(sources, content)}
    out: dict[str, str] = {}
    for f in folder.iterdir():
        if f.name.startswith(SOURCE_LINK_PREFIX):
            st = f.lstat()
            d = by_inode.get((st.st_dev, st.st_ino))
            if d is not None:
                out[f.name] = d
    return out
