"""Weight references and the store that owns their memory maps.

A weight is never a copy: it is a span (file, offset, length) plus what the bytes mean (dtype,
logical shape). Its life has explicit states so that the cost of every stage is visible and every
byte can be given back as soon as the next stage no longer needs it::

    MAPPED ──► HANDED ──► RELEASED
      │     (ORT reads it)   (pages dropped; views
      │                        must not be used)
      └─────────────────────►

A weight a pass converts is released once its new form is written (``passes.dq_matmul``); the new
form is not a weight of this store but a tensor of the output (``passes.sources.OutTensor``: a place
in a cache entry's weights.bin or in the in-memory buffer), which ORT then owns.

One ``mmap`` is kept per file, not per tensor: Python's ``mmap`` duplicates the file descriptor, so a
mapping per tensor would run a model with thousands of initializers into the descriptor limit.
Releasing a span therefore means ``madvise(MADV_DONTNEED)`` on the whole pages inside it (the pages
leave this process's resident set, nothing is written back because the mapping is read-only) and
the file mapping itself is closed once every span in it is released.
"""
from __future__ import annotations

import enum
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ortmem.base.dtypes import dtype_info
from ortmem.base.units import PAGE
from ortmem.errors import WeightStateError

#: Where tensors start in the weights files ortmem lays out at a fixed offset grid (a partition's shared
#: weights.bin, synthetic models' external data): 4096 bytes, the page of x86-64 and of most ARM
#: builds, fixed rather than this machine's page so that a file's bytes do not depend on where it was made.
FILE_ALIGN = 4096


def page_align(n: int) -> int:
    """``n`` rounded up to a whole page: every tensor ortmem writes or hands over starts on a page, so
    ORT can map it, and borrow it as naturally aligned for any dtype."""
    return -(-n // PAGE) * PAGE


class WeightState(str, enum.Enum):
    MAPPED = "mapped"
    HANDED = "handed"
    RELEASED = "released"


class MappedFile:
    """A read-only mapping of one file, shared by every weight stored in it."""

    def __init__(self, path: Path):
        self.path = path
        self._mm: Optional[mmap.mmap] = None  # mapped on first view: handing a model to ORT needs none
        self.size = os.path.getsize(path)
        self.live_spans = 0

    @property
    def mm(self) -> mmap.mmap:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    @property
    def is_mapped(self) -> bool:
        return self._mm is not None

    def drop_pages(self, offset: int, length: int) -> int:
        """Drop the whole pages inside [offset, offset+length) from the resident set; returns bytes advised."""
        if self._mm is None:
            return 0
        start = -(-offset // PAGE) * PAGE
        end = ((offset + length) // PAGE) * PAGE
        if end <= start:
            return 0
        self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        return end - start

    def close(self) -> bool:
        """Unmap if no numpy view still points into the mapping; True when unmapped."""
        if self._mm is None:
            return True
        try:
            self._mm.close()
        except BufferError:
            return False
        self._mm = None
        return True


@dataclass(eq=False)
class WeightRef:
    """One initializer's bytes: where they are, what they mean, and where they are in their life."""

    name: str
    graph: str  # "" for the main graph, else the subgraph path (see onnx_walk)
    kind: str  # initializer | sparse_values | sparse_indices | attribute
    data_type: int  # ONNX TensorProto.DataType
    shape: tuple[int, ...]  # logical shape (element count, also for packed sub-byte types)
    file: Path
    offset: int
    length: int
    embedded: bool  # True when the bytes sit inside the .onnx file itself
    state: WeightState = WeightState.MAPPED
    _mapped: Optional[MappedFile] = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.graph, self.kind, self.name)

    @property
    def nbytes(self) -> int:
        return self.length

    @property
    def dtype_name(self) -> str:
        return dtype_info(self.data_type).name

    def raw(self) -> np.ndarray:
        """The bytes as a flat uint8 view, zero copy."""
        self._check_usable()
        assert self._mapped is not None
        return np.frombuffer(self._mapped.mm, dtype=np.uint8, count=self.length, offset=self.offset)

    def array(self) -> np.ndarray:
        """A zero-copy numpy view of the tensor.

        Sub-byte types (int4, uint4, int2, ...) stay packed: the view is the flat uint8 bytes and the
        logical shape is ``self.shape``; unpacking would multiply the memory by 2-4x, which is what
        ortmem exists to avoid. Types without a numpy dtype (bfloat16, float8) come back as the
        unsigned integers of their width.
        """
        info = dtype_info(self.data_type, tensor=self.name, file=str(self.file))
        raw = self.raw()
        if info.packed:
            return raw
        return raw.view(info.numpy).reshape(self.shape)

    def _check_usable(self) -> None:
        if self.state is WeightState.RELEASED:
            raise WeightStateError("weight was released and can no longer be read", tensor=self.name, file=self.file)


class WeightStore:
    """Owns the file mappings behind a model's weights and hands out zero-copy views."""

    def __init__(self) -> None:
        self._files: dict[Path, MappedFile] = {}
        self._refs: dict[tuple[str, str, str], WeightRef] = {}

    def mapped_file(self, path: Path) -> MappedFile:
        mf = self._files.get(path)
        if mf is None:
            mf = self._files[path] = MappedFile(path)
        return mf

    def add(self, ref: WeightRef) -> WeightRef:
        ref._mapped = self.mapped_file(ref.file)
        ref._mapped.live_spans += 1
        self._refs[ref.key] = ref
        return ref

    def __iter__(self) -> Iterator[WeightRef]:
        return iter(self._refs.values())

    def __len__(self) -> int:
        return len(self._refs)

    def get(self, name: str, graph: str = "", kind: str = "initializer") -> WeightRef:
        try:
            return self._refs[(graph, kind, name)]
        except KeyError:
            raise KeyError(f"no weight {name!r} in graph {graph!r} ({kind})") from None

    def find(self, name: str, graph: str = "", kind: str = "initializer") -> Optional[WeightRef]:
        return self._refs.get((graph, kind, name))

    @property
    def files(self) -> list[MappedFile]:
        return list(self._files.values())

    def mark_handed(self, refs: Optional[list[WeightRef]] = None) -> None:
        for ref in refs if refs is not None else self:
            if ref.state is not WeightState.RELEASED:
                ref.state = WeightState.HANDED

    def release(self, ref: WeightRef) -> int:
        """Give back a weight's pages; returns the bytes advised away. Idempotent."""
        if ref.state is WeightState.RELEASED:
            return 0
        freed = 0
        if ref._mapped is not None:
            mf = ref._mapped
            freed = mf.drop_pages(ref.offset, ref.length)
            mf.live_spans -= 1
            if mf.live_spans == 0:
                mf.close()
        ref.state = WeightState.RELEASED
        return freed

    def release_all(self) -> int:
        return sum(self.release(r) for r in list(self))

    def close(self) -> None:
        """Unmap every file; views that are still alive keep their own mapping alive."""
        for mf in self._files.values():
            mf.close()

