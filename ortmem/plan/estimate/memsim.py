"""A small model of glibc malloc, enough to say how much of ORT's freed memory stays resident.

Why simulate instead of applying a factor: whether a freed buffer is kept depends on *when* it was
allocated. glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` (given
back on ``free``) and raises that threshold to the size of any mmapped block it frees (up to 32 MiB,
trim threshold twice that). So ORT's first large frees (the protobuf copies of an embedded model)
decide that every later transient buffer lives in the heap, where a hole in the middle is never given
back and is reused only by a request that fits in it: a conv net's reordered weights freed after an
embedded load stay resident, while the same net from external data keeps nothing (its copies are
mmapped because nothing large has been freed yet). A factor cannot express
that; an address-level heap with best-fit reuse, coalescing and top trimming does.

With allocator hygiene (``ortmem.base.hygiene``: both thresholds pinned at 128 KiB, ``malloc_trim(0)``
after creation) every large block is mmapped and resident memory equals memory in use, which the
same simulator reports with ``dynamic=False``.

Sizes below 128 KiB are ignored: ORT's many small allocations are part of the calibrated
per-session constant.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MMAP_THRESHOLD_START = 128 * 1024
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
PAGE = 4096


def _page(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass
class Block:
    size: int
    kind: str  # "mmap" | "heap" | "file"
    addr: int = 0
    label: str = ""


@dataclass
class Heap:
    """glibc's main arena (addresses only), its mmapped blocks and mapped file pages."""

    dynamic: bool = True
    threshold: int = MMAP_THRESHOLD_START
    trim_threshold: int = MMAP_THRESHOLD_START
    extent: int = 0
    mmapped: int = 0
    file: int = 0
    in_use: int = 0  # bytes requested and not freed (anon), what memray would call in use
    free_by_addr: dict[int, int] = field(default_factory=dict)  # addr -> size
    _free_sorted: list[tuple[int, int]] = field(default_factory=list)  # (size, addr)
    peak_rss: int = 0
    peak_in_use: int = 0
    peak_label: str = ""

    # ------------------------------------------------------------------------------ accounting
    @property
    def rss(self) -> int:
        return self.extent + self.mmapped + self.file

    @property
    def in_use_total(self) -> int:
        return self.in_use + self.file

    def _mark(self, label: str) -> None:
        if self.rss > self.peak_rss:
            self.peak_rss = self.rss
            self.peak_label = label
        self.peak_in_use = max(self.peak_in_use, self.in_use_total)

    # ------------------------------------------------------------------------------ operations
    def alloc(self, size: int, label: str = "") -> Block:
        size = _page(size)
        self.in_use += size
        if size >= self.threshold:
            self.mmapped += size
            b = Block(size, "mmap", label=label)
        else:
            b = Block(size, "heap", self._take(size), label)
        self._mark(label)
        return b

    def map_file(self, size: int, label: str = "") -> Block:
        """Pages of a file mapping faulted in (RssFile); no heap involved."""
        size = _page(size)
        self.file += size
        self._mark(label)
        return Block(size, "file", label=label)

    def free(self, b: Block | None) -> None:
        if b is None:
            return
        if b.kind == "file":
            self.file -= b.size
            return
        self.in_use -= b.size
        if b.kind == "mmap":
            self.mmapped -= b.size
            if self.dynamic and self.threshold < b.size <= MMAP_THRESHOLD_MAX:
                self.threshold = b.size
                self.trim_threshold = 2 * b.size
            return
        self._give_back(b.addr, b.size)

    def trim(self) -> None:
        """``malloc_trim(0)``: every free whole page, anywhere in the arena, leaves the resident set."""
        self.extent = self.in_use - self.mmapped
        self.free_by_addr.clear()
        self._free_sorted.clear()

    # ------------------------------------------------------------------------------ the arena
    def _take(self, size: int) -> int:
        i = bisect.bisect_left(self._free_sorted, (size, -1))
        if i < len(self._free_sorted):  # best fit, as glibc's sorted large bins do
            fsize, addr = self._free_sorted.pop(i)
            del self.free_by_addr[addr]
            if fsize > size:
                self._add_free(addr + size, fsize - size)
            return addr
        addr = self.extent
        top = self._top_free()
        if top is not None:  # extend the free chunk at the top instead of starting past it
            taddr, tsize = top
            self._remove_free(taddr)
            addr = taddr
            self.extent = taddr + size
        else:
            self.extent += size
        return addr

    def _top_free(self) -> tuple[int, int] | None:
        for addr, size in self.free_by_addr.items():
            if addr + size == self.extent:
                return addr, size
        return None

    def _give_back(self, addr: int, size: int) -> None:
        # coalesce with free neighbours
        nxt = addr + size
        if nxt in self.free_by_addr:
            size += self._remove_free(nxt)
        for paddr, psize in list(self.free_by_addr.items()):
            if paddr + psize == addr:
                self._remove_free(paddr)
                addr, size = paddr, size + psize
                break
        if addr + size == self.extent and size >= self.trim_threshold:
            self.extent = addr  # glibc trims the top once it exceeds the trim threshold
            return
        self._add_free(addr, size)

    def _add_free(self, addr: int, size: int) -> None:
        self.free_by_addr[addr] = size
        bisect.insort(self._free_sorted, (size, addr))

    def _remove_free(self, addr: int) -> int:
        size = self.free_by_addr.pop(addr)
        self._free_sorted.remove((size, addr))
        return size
