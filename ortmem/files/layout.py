"""The store's folder format: the one place its entries' file names are defined (the handoff records'
are defined in :mod:`ortmem.store.handoff_records`, which the hook imports without this module's json
and named tuples).

A converted entry ``<root>/<key>/`` holds ``model.onnx`` (a skeleton whose large tensors are external
data), ``weights.bin`` (every converted weight, page-aligned), hard links to unchanged source files
(``source-<i>.<ext>``) and ``manifest.json`` (what the entry claims, checked before use); once ORT
finished it, also ``finished-<hash>.onnx``, ``.data`` and ``.json`` for each settings it was finished at
(:data:`FINISHED_STEM`, :func:`ortmem.store.finished_entries.finished_stem`).
A finished entry holds ``model.onnx``, ``model.data`` and ``model.json`` under the same manifest
(:mod:`ortmem.store.finished_entries`). ``ortmem convert`` writes the same ``model.onnx`` +
``weights.bin`` pair into a folder of the user's. Names starting with "." are a writer's temporaries
(``trust.TMP_PREFIX``, ``trust.TRASH_PREFIX``), which no reader opens, or the handoff records' folder,
which no entry lookup opens.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Iterable

from ortmem.base.records import record
from ortmem.files.trust import read_nofollow, replace_private

#: What an entry claims (format, key, files, digests, sources), written last when it is published.
MANIFEST = "manifest.json"
#: The model ORT loads by path.
MODEL_FILE = "model.onnx"
#: Every converted weight, page-aligned, so ORT maps each tensor straight from the page cache.
WEIGHTS_FILE = "weights.bin"
#: Prefix of files an entry links from the model's own folder (another owner's, checked by identity).
SOURCE_LINK_PREFIX = "source-"
#: The stem of ORT's finished model ``ortmem convert`` writes into a user's folder, and the prefix of those
#: a converted entry keeps, one per settings (``<stem>.onnx``, ``.data``, and ``.json``, which is written
#: last and vouches for the other two: :mod:`ortmem.store.finished`).
FINISHED_STEM = "finished"


@record
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
        """Bytes of this entry's files, each once (:func:`disk_use`; hard-linked sources included)."""
        return disk_use([self.path])[0].bytes

    def owned_bytes(self) -> int:
        """Disk this entry alone holds (:func:`reclaimable_bytes`)."""
        return reclaimable_bytes(self.path)

    def last_used(self) -> float:
        """When a lookup last returned this entry (its manifest's mtime, touched on every hit)."""
        return (self.path / MANIFEST).lstat().st_mtime

    def rewrite_manifest(self, manifest: dict[str, Any]) -> None:
        """Replace the manifest atomically (a private temporary file renamed over it)."""
        replace_private(self.path / MANIFEST, json.dumps(manifest, indent=1).encode())


def reclaimable_bytes(path: Path) -> int:
    """Disk that removing ``path`` (a file, or a folder and all in it) gives back: the allocated
    blocks of files with no other hard link. Not apparent sizes (a preallocated or sparse file
    differs) and not hard-linked sources, which stay on disk after the entry goes."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISDIR(st.st_mode):
        try:
            children = [Path(c.path) for c in os.scandir(path)]
        except OSError:
            return 0
        return sum(reclaimable_bytes(c) for c in children)
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


@record
class DiskUse:
    """What entries hold on disk: each file's bytes once however many hard links it has (``bytes``),
    and of those the bytes of files also linked from outside the entries counted (``shared``): a
    source an entry hard-links stays the user's model file, its bytes were on disk before the entry."""

    bytes: int = 0
    shared: int = 0

    def text(self) -> str:
        """``1706.0 MiB, 822.0 MiB of it shared with your model files`` (the second part only when shared)."""
        size = f"{self.bytes / 2**20:.1f} MiB"
        return f"{size}, {self.shared / 2**20:.1f} MiB of it shared with your model files" if self.shared else size


def disk_use(folders: Iterable[Path]) -> tuple[DiskUse, dict[Path, DiskUse]]:
    """(all ``folders`` together, each folder): apparent sizes of their regular files (symbolic links
    not followed), a file linked more than once counted once; ``shared``: files whose link count
    is higher than the links found in all ``folders`` (a link outside them: the user's model file)."""
    files: dict[Path, dict[tuple[int, int], os.stat_result]] = {}
    seen: dict[tuple[int, int], int] = {}
    for folder in folders:
        inodes: dict[tuple[int, int], os.stat_result] = {}
        for root, _, names in os.walk(folder):
            for name in names:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    ident = (st.st_dev, st.st_ino)
                    seen[ident] = seen.get(ident, 0) + 1
                    inodes[ident] = st
        files[Path(folder)] = inodes

    def use(inodes: dict[tuple[int, int], os.stat_result]) -> DiskUse:
        return DiskUse(sum(st.st_size for st in inodes.values()),
                       sum(st.st_size for ident, st in inodes.items() if st.st_nlink > seen[ident]))

    every = {ident: st for inodes in files.values() for ident, st in inodes.items()}
    return use(every), {folder: use(inodes) for folder, inodes in files.items()}
