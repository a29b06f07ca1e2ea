"""Linux ``/proc`` readers and the process-tree sampler.

Why ``/proc`` and not ``resource.getrusage``: ``ru_maxrss`` cannot be reset, so it always includes
the interpreter and imports, and it cannot split anonymous from file-backed memory. ``VmHWM`` can be
reset (write ``5`` to ``/proc/self/clear_refs``) and ``RssAnon``/``RssFile`` separate the heap (not
reclaimable) from mapped files (reclaimable page cache).

Why the sampler lives in the *parent*: a sampler thread inside the measured process would allocate
(its own stack, Python objects, GIL hand-offs) in the very heap being measured, and it could not see
helper processes that exit before the child reports. Sampling ``/proc/<pid>/status`` from outside
costs the child nothing and sees every descendant found through ``/proc/<pid>/task/*/children``.
"""
from __future__ import annotations

import glob
import os
import sys
import threading
import time
from dataclasses import dataclass, field

_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def unsupported_reason() -> str | None:
    """Return why memory cannot be measured here, or ``None`` when ``/proc`` has what we need."""
    if not sys.platform.startswith("linux"):
        return f"ortmem.measure needs Linux /proc (VmHWM, RssAnon, RssFile); this is {sys.platform}"
    status = read_status("self")
    if status is None or not all(k in status for k in ("VmHWM", "RssAnon", "RssFile")):
        return "/proc/self/status lacks VmHWM/RssAnon/RssFile (kernel older than 4.5?)"
    return None


def read_status(pid: int | str) -> dict[str, int] | None:
    """Memory fields of ``/proc/<pid>/status`` in bytes, or ``None`` if the process is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out: dict[str, int] = {}
    for line in data.split(b"\n"):
        key, _, rest = line.partition(b":")
        k = key.decode("ascii", "replace")
        if k in _KEYS:
            parts = rest.split()
            if parts:
                out[k] = int(parts[0]) * 1024  # always kB in /proc/<pid>/status
    return out or None


def reset_hwm() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS; ``False`` if the kernel refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' children), by ``/proc`` scan as a fallback."""
    paths = glob.glob(f"/proc/{pid}/task/*/children")
    if paths:
        kids: list[int] = []
        for p in paths:
            try:
                with open(p, "rb") as f:
                    kids.extend(int(x) for x in f.read().split())
            except OSError:
                continue
        return kids
    return _children_by_scan(pid)


def _children_by_scan(pid: int) -> list[int]:
    """Slow path for kernels without CONFIG_PROC_CHILDREN: read every ``/proc/<n>/stat``."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: the ppid is the 2nd field after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """All descendants of ``pid`` (breadth first), excluding ``pid`` itself."""
    seen: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for c in children(p):
                if c not in seen and c != pid:
                    seen.append(c)
                    nxt.append(c)
        frontier = nxt
    return seen


@dataclass
class ProcSample:
    """One process at one instant, bytes. ``anon`` includes ``RssShmem`` (not reclaimable either)."""

    anon: int
    file: int
    hwm: int


@dataclass
class TreeSample:
    """Every process of the tree at time ``t`` (``time.monotonic()``, comparable across processes)."""

    t: float
    procs: dict[int, ProcSample] = field(default_factory=dict)


class TreeSampler:
    """Samples a process and its descendants every ``interval`` seconds from a background thread.

    ``time.monotonic()`` is CLOCK_MONOTONIC, system wide on Linux, so the child's event timestamps
    and these samples share one clock and can be aligned afterwards.
    """

    def __init__(self, root_pid: int, interval: float = 0.01):
        self.root_pid = root_pid
        self.interval = interval
        self.samples: list[TreeSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ortmem-sampler", daemon=True)

    def start(self) -> "TreeSampler":
        self._thread.start()
        return self

    def stop(self) -> list[TreeSample]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def sample_once(self) -> TreeSample | None:
        t = time.monotonic()
        s = TreeSample(t)
        for pid in [self.root_pid, *descendants(self.root_pid)]:
            st = read_status(pid)
            if st is None or "RssAnon" not in st:
                continue  # exited between listing and reading, or a zombie
            s.procs[pid] = ProcSample(
                anon=st.get("RssAnon", 0) + st.get("RssShmem", 0),
                file=st.get("RssFile", 0),
                hwm=st.get("VmHWM", 0),
            )
        if not s.procs:
            return None
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            nxt += self.interval
            delay = nxt - time.monotonic()
            if delay < 0:  # fell behind (busy machine): don't try to catch up in a burst
                nxt = time.monotonic()
                delay = 0
            self._stop.wait(delay)


def read_smaps_rollup(pid: int | str) -> dict[str, int] | None:
    """``/proc/<pid>/smaps_rollup`` in bytes (``Pss``, ``Pss_Anon``, ``Pss_File``, ``Pss_Shmem``,
    ``Rss``, ``Private_Dirty``, ...), or ``None`` if the process is gone or the kernel lacks it (< 4.14).

    Why PSS: a page mapped by N processes counts 1/N in each, so summing PSS over workers counts
    shared weights once, which RSS (counting them N times) cannot."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out: dict[str, int] = {}
    for line in data.split(b"\n")[1:]:  # the first line names the address range
        key, _, rest = line.partition(b":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == b"kB":
            out[key.decode("ascii", "replace")] = int(parts[0]) * 1024
    return out or None


def read_meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); empty if unreadable."""
    try:
        with open("/proc/meminfo", "rb") as f:
            return {k.decode(): int(v.split()[0]) * 1024 for k, _, v in (line.partition(b":") for line in f)
                    if v.strip()}
    except OSError:
        return {}


def machine_used_bytes() -> int | None:
    """Memory in use on the machine, ``MemTotal - MemAvailable`` (bytes): what processes hold that the
    kernel cannot reclaim; reclaimable page cache is not counted."""
    info = read_meminfo()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return None
    return info["MemTotal"] - info["MemAvailable"]


def machine_available_bytes() -> int | None:
    """``MemAvailable`` (bytes): what a new process can still get."""
    return read_meminfo().get("MemAvailable")
