"""Where converted bytes go: a file (a cache entry's or ``ortmem convert``'s weights.bin) or one
anonymous buffer (``cache=False``), and the worker pool that fills either.

Why sinks: a rule converts each of its tensors into a numpy view a sink hands out and then commits
it; the rule never knows whether the bytes end in a file or in memory, so each rule is written once.

* :class:`FileSink` converts into a per-worker scratch buffer, reused from tensor to tensor (its
  pages stay faulted in and cached), then ``pwrite``s each tensor to its final offset: writing
  through a shared mapping of a fresh file costs a page fault per 4 KiB instead, and charges every
  written page to this process's resident set.
* :class:`MemorySink` hands out views of the final buffer itself: nothing to commit.
* :class:`FollowingDigest` hashes a file while it is written, in file order (the digest format the
  cache's verifier checks: one xxh3-128 over every byte): a thread of its own reads each region back
  from the page cache once it is written and every region before it was hashed. The workers never
  wait for one another's turn and take the largest jobs first. (Before session 14 the workers
  hashed their own bytes in file order: jobs ran by offset, each commit waited for the one before,
  and the last, often largest, tensor, a Llama's ``lm_head``, was converted by one worker while the
  others had nothing left to do.)
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np

from ..store.digest import RunningDigest
from ..errors import ConversionError
from ..weights import PAGE, WeightRef, page_align
from .sources import OutTensor

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, tensor name)

#: Bytes per read when a span is copied through this process (no ``copy_file_range``).
COPY_CHUNK = 16 << 20
#: Bytes :class:`FollowingDigest` hashes before it unmaps them (page aligned).
DIGEST_CHUNK = 4 << 20
#: The most threads one conversion runs on: each holds a scratch buffer as large as the largest
#: tensor it converts (tens of MiB per thread for a 7B model).
MAX_THREADS = 16


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
    A conversion on a fixed two threads (ortmem before session 14) would make a cold start on a
    many-core machine slower than ORT's own. Physical cores are counted among the CPUs this process
    may run on (a container's CPU set, ``taskset``), one per set of hyper-thread siblings. On the
    2-core dev VM that is 2, as before; a third thread converted the 0.6 GB model no faster
    (``python -m bench.cold_entry --repeat 10 --size 0.6 --threads 2,3``: fastest 0.779 s against
    0.784, medians 1.20 against 1.15 on a noisy sitting). Many-core machines are not measured here."""
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


class FollowingDigest:
    """The full digest of the file open as ``fd`` (``size`` bytes), whose regions several threads
    write in any order and report with :meth:`written`. A thread of its own reads the file back in
    file order, each region as soon as it and every region before it were written, and hashes it.

    Regions must tile the file. The gap between a tensor's end and the next page is read back as
    the zeros the file was reserved with. The thread hashes the page cache's pages in place, through
    a read-only mapping of the file, and unmaps each chunk once hashed: no copy, and no more than a
    chunk of the file in this process's resident set. Hashing in each worker's own scratch instead
    made every commit wait for the one before it.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.running = RunningDigest()
        self.position = 0
        self.size = size
        self._written: dict[int, int] = {}  # region start -> end, reported but not yet hashed
        self._stopped = False  # aborted, or every writer done
        self._error: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        self._thread = threading.Thread(target=self._follow, name="ortmem-digest", daemon=True)
        self._thread.start()

    def written(self, start: int, end: int) -> None:
        """Bytes ``start..end`` (page aligned, padding included) are in the file."""
        with self._cond:
            self._written[start] = end
            self._cond.notify_all()

    def stop(self) -> None:
        """Nothing more will be written (done, or failed): the thread hashes what it can and ends."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()
        if self._map is not None:
            self._map.close()
            self._map = None

    def hexdigest(self) -> str:
        """The file's digest, once every region was written (call after the last :meth:`written`)."""
        self.stop()
        if self._error is not None:
            raise ConversionError(f"could not read back the file to digest it: {self._error}")
        if self.position != self.size:
            raise ConversionError(f"internal: digest covers {self.position} of {self.size} bytes")
        return self.running.hexdigest()

    def _follow(self) -> None:
        try:
            while True:
                with self._cond:
                    while self.position not in self._written and not self._stopped:
                        self._cond.wait()
                    end = self._written.pop(self.position, None)
                    if end is None:  # stopped, and the next region never came
                        return
                pos = self.position
                assert self._map is not None
                with memoryview(self._map) as whole:
                    while pos < end:
                        n = min(end - pos, DIGEST_CHUNK)
                        self.running.update(whole[pos : pos + n])
                        self._map.madvise(mmap.MADV_DONTNEED, pos, n)  # out of this process's RSS
                        pos += n
                self.position = end  # only this thread moves it
        except BaseException as exc:  # noqa: BLE001 - reported by hexdigest
            self._error = exc


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

    def __init__(self, fd: int, scratch: Scratch, digest: Optional[FollowingDigest] = None):
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
        for t, v in zip(outs, views):
            pwrite_all(self.fd, v.reshape(-1).view(np.uint8), t.offset)
        if self.digest is not None and outs:
            self.digest.written(outs[0].offset, page_align(outs[-1].offset + outs[-1].nbytes))


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


def run_jobs(jobs: list[Job], sink_for: Callable[[int], Sink], workers: int, *,
             progress: Optional[Progress] = None, total: int = 0) -> int:
    """Run ``jobs`` on ``workers`` threads (numpy releases the GIL in the kernels), biggest first,
    which balances the workers; returns the bytes done. ``sink_for(slot)`` gives the sink of a worker
    slot."""
    done = 0
    order = sorted(jobs, key=lambda j: -j.nbytes)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(job.convert, sink_for(n % workers)) for n, job in enumerate(order)]
        for job, f in zip(order, futures):
            f.result()
            done += job.nbytes
            if progress:
                progress(done, total, job.name)
    return done


def copy_span(ref: WeightRef, out_fd: int, out_offset: int) -> None:
    """Copy an unchanged weight file to file: the kernel copies it (``copy_file_range``: no byte
    passes through this process), or, where it cannot, this process in chunks."""
    in_fd = os.open(ref.file, os.O_RDONLY)
    try:
        remaining, src, dst = ref.length, ref.offset, out_offset
        buf: Optional[memoryview] = None  # one chunk buffer, reused (a fresh one per read faults anew)
        while remaining:
            n = 0
            if hasattr(os, "copy_file_range"):
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
            remaining, src, dst = remaining - n, src + n, dst + n
    finally:
        os.close(in_fd)
