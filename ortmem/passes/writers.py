"""Where converted bytes go: a file (a cache entry's or ``ortmem convert``'s weights.bin) or one
anonymous buffer (``cache=False``), and the worker pool that fills either.

Why sinks: a rule converts each of its tensors into a numpy view a sink hands out and then commits
it; the rule never knows whether the bytes end in a file or in memory, so each rule is written once.

* :class:`FileSink` converts into a per-worker scratch buffer, reused from tensor to tensor (its
  pages stay faulted in and cached), then ``pwrite``s each tensor to its final offset: writing
  through a shared mapping of a fresh file costs a page fault per 4 KiB instead, and charges every
  written page to this process's resident set.
* :class:`MemorySink` hands out views of the final buffer itself: nothing to commit.
* :class:`OrderedDigest` hashes a file's bytes while they are written, in file order (the digest
  format the cache's verifier checks: one xxh3-128 over every byte), so a new cache entry is never
  read back to digest it. Jobs then run in file order and each commit waits for the one before it.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np

from ortmem.files.digest import RunningDigest
from ortmem.errors import ConversionError
from ortmem.base.units import PAGE
from ortmem.onnxfile.weights import WeightRef, page_align
from ortmem.passes.tensors import OutTensor

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, tensor name)

#: Bytes per read when a span is copied through this process (to be hashed on the way).
COPY_CHUNK = 16 << 20
#: The most threads one conversion runs on: each holds a scratch buffer as large as the largest
#: tensor it converts (tens of MiB per thread for a 7B model).
MAX_THREADS = 16
_ZERO_PAGE = bytes(PAGE)


class Sink(Protocol):
    """What a rule writes one job's tensors through (a context manager around the job)."""

    def __enter__(self) -> "Sink": ...

    def __exit__(self, *exc: object) -> None: ...

    def views(self, outs: list[OutTensor], dtypes: list) -> list[np.ndarray]: ...

    def commit(self, outs: list[OutTensor], views: list[np.ndarray]) -> None: ...


@dataclass
class Job:
    """One unit of conversion work: ``convert(sink)`` writes ``outs`` (contiguous in the file, in
    this order). ``nbytes`` (source bytes read) weighs it for progress and scheduling."""

    nbytes: int
    name: str
    outs: list[OutTensor]
    convert: Callable[[Sink], None]

    @property
    def offset(self) -> int:
        return self.outs[0].offset if self.outs else 0


def conversion_threads(intra_op_num_threads: int = 0) -> int:
    """How many threads a conversion runs on: as many as ORT's own DQ+MatMul fusion would use for the
    session, at most :data:`MAX_THREADS`.

    Why: ORT transposes the weights it fuses on the session's intra-op thread pool
    (``MlasQDQTransposeBlockwiseQuantized`` with ``intra_op_thread_pool``, ``qdq_actions.cc``), whose
    size is the caller's ``intra_op_num_threads`` or, by default (0), one thread per physical core.
    A conversion on a fixed number of threads would make a cold start on a many-core machine slower
    than ORT's own. Physical cores are counted among the CPUs this process may run on (a container's
    CPU set, ``taskset``), one per set of hyper-thread siblings, as ORT
    sizes its default pool."""
    if intra_op_num_threads > 0:
        return min(intra_op_num_threads, MAX_THREADS)
    return max(1, min(physical_cores(), MAX_THREADS))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on: the distinct hyper-thread sibling sets
    (``/sys/devices/system/cpu/cpuN/topology/thread_siblings_list``); the CPU count where that is
    unreadable (not Linux)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    siblings = set()
    for cpu in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings.add(f.read().strip())
        except OSError:
            siblings.add(str(cpu))
    return max(1, len(siblings))


def view_shape(t: OutTensor, dt) -> tuple[int, ...]:
    """The tensor's dims, or flat bytes for a packed sub-byte tensor (a GBQ int4 zero point)."""
    return t.shape if int(np.prod(t.shape)) * np.dtype(dt).itemsize == t.nbytes else (-1,)


def pwrite_all(fd: int, data, offset: int) -> None:
    mv = memoryview(data).cast("B")
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


class OrderedDigest:
    """The full digest of a file whose regions are written by several threads: each region is
    hashed when it is committed, and commits are admitted in file order (a region waits until every
    byte before it was hashed). Regions must tile the file; the gap between a tensor's end and the
    next page (zeros in the file, which was reserved zero-filled) is hashed as zeros."""

    def __init__(self) -> None:
        self.running = RunningDigest()
        self.position = 0
        self.aborted = False
        self._turn = threading.Condition()

    def wait_for(self, offset: int, *, block: bool = True) -> None:
        """Wait until every byte before ``offset`` was hashed (``block=False``: it must be already)."""
        with self._turn:
            while self.position != offset:
                if not block:
                    raise ConversionError(f"internal: region at {offset} is not next (file hashed up to {self.position})")
                if self.aborted:
                    raise ConversionError("conversion stopped: an earlier tensor failed")
                if self.position > offset:
                    raise ConversionError(f"internal: region at {offset} committed out of order (file at {self.position})")
                self._turn.wait()

    def hash_tensor(self, t: OutTensor, data) -> None:
        """Hash ``t``'s bytes and its padding to the next page; the caller holds the turn."""
        self.running.update(data)
        pad = page_align(t.offset + t.nbytes) - (t.offset + t.nbytes)
        if pad:
            self.running.update(_ZERO_PAGE[:pad])

    def abort(self) -> None:
        """A region will never be committed: wake every waiter (each fails)."""
        with self._turn:
            self.aborted = True
            self._turn.notify_all()

    def advance(self, end: int) -> None:
        with self._turn:
            self.position = end
            self._turn.notify_all()

    def hexdigest(self, size: int) -> str:
        if self.position != size:
            raise ConversionError(f"internal: digest covers {self.position} of {size} bytes")
        return self.running.hexdigest()


class Scratch:
    """One worker's reusable output buffer: grows to the largest tensor it has converted."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, np.uint8)
        return self.buf[:nbytes]


class FileSink:
    """Outputs go to a scratch buffer, then to their offsets in the file (hashed on the way when the
    file is digested)."""

    def __init__(self, fd: int, scratch: Scratch, digest: Optional[OrderedDigest] = None):
        self.fd, self.scratch, self.digest = fd, scratch, digest

    def __enter__(self) -> "FileSink":
        self.scratch.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.scratch.lock.release()

    def views(self, outs: list[OutTensor], dtypes: list) -> list[np.ndarray]:
        buf = self.scratch.take(sum(page_align(t.nbytes) for t in outs))
        views, pos = [], 0
        for t, dt in zip(outs, dtypes):
            views.append(buf[pos : pos + t.nbytes].view(dt).reshape(view_shape(t, dt)))
            pos += page_align(t.nbytes)
        return views

    def commit(self, outs: list[OutTensor], views: list[np.ndarray]) -> None:
        if self.digest is not None and outs:
            self.digest.wait_for(outs[0].offset)
        for t, v in zip(outs, views):
            data = v.reshape(-1).view(np.uint8)
            pwrite_all(self.fd, data, t.offset)
            if self.digest is not None:
                self.digest.hash_tensor(t, data)
        if self.digest is not None and outs:
            self.digest.advance(page_align(outs[-1].offset + outs[-1].nbytes))


class MemorySink:
    """Outputs are written in place, in the final buffer."""

    def __init__(self, buffer):
        self.buffer = buffer

    def __enter__(self) -> "MemorySink":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def views(self, outs: list[OutTensor], dtypes: list) -> list[np.ndarray]:
        return [np.frombuffer(self.buffer, dtype=dt, count=t.nbytes // np.dtype(dt).itemsize, offset=t.offset)
                .reshape(view_shape(t, dt)) for t, dt in zip(outs, dtypes)]

    def commit(self, outs: list[OutTensor], views: list[np.ndarray]) -> None:
        pass


def run_jobs(jobs: list[Job], sink_for: Callable[[int], Sink], workers: int, *, in_file_order: bool = False,
             progress: Optional[Progress] = None, total: int = 0) -> int:
    """Run ``jobs`` on ``workers`` threads (numpy releases the GIL in the kernels); returns the bytes
    done. ``sink_for(slot)`` gives the sink of a worker slot. Biggest first balances the workers;
    ``in_file_order`` (a digested file) runs them by offset instead, so no commit waits long."""
    done = 0
    order = sorted(jobs, key=(lambda j: j.offset) if in_file_order else (lambda j: -j.nbytes))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # the pool takes jobs in submission order, so a commit only ever waits for a job already running
        futures = [pool.submit(job.convert, sink_for(n % workers)) for n, job in enumerate(order)]
        for job, f in zip(order, futures):
            f.result()
            done += job.nbytes
            if progress:
                progress(done, total, job.name)
    return done


def copy_span(ref: WeightRef, out_fd: int, out_offset: int, digest: Optional[OrderedDigest] = None,
              out: Optional[OutTensor] = None) -> None:
    """Copy an unchanged weight file to file. Without a digest the kernel copies it
    (``copy_file_range``: no byte passes through this process); with one, it is read in chunks and
    hashed on its way to the output (``out`` is its place there)."""
    in_fd = os.open(ref.file, os.O_RDONLY)
    try:
        remaining, src, dst = ref.length, ref.offset, out_offset
        buf: Optional[memoryview] = None  # one chunk buffer, reused (a fresh one per read faults anew)
        if digest is not None:
            assert out is not None
            digest.wait_for(out.offset, block=False)  # copies run after every job, one at a time
        while remaining:
            n = 0
            if digest is None and hasattr(os, "copy_file_range"):
                try:
                    n = os.copy_file_range(in_fd, out_fd, remaining, src, dst)
                except OSError:
                    n = 0
            if n <= 0:
                if buf is None:
                    buf = memoryview(bytearray(min(remaining, COPY_CHUNK)))
                n = os.preadv(in_fd, [buf[: min(remaining, len(buf))]], src)
                if n <= 0:
                    raise ConversionError("source ended early", tensor=ref.name, file=str(ref.file))
                pwrite_all(out_fd, buf[:n], dst)
                if digest is not None:
                    digest.running.update(buf[:n])
            remaining, src, dst = remaining - n, src + n, dst + n
        if digest is not None:
            assert out is not None
            digest.hash_tensor(out, b"")  # its bytes went in chunk by chunk: only the padding is left
            digest.advance(page_align(out.offset + out.nbytes))
    finally:
        os.close(in_fd)
