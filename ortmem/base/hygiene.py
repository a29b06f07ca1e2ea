"""Allocator hygiene: keep glibc from stranding ONNX Runtime's transient buffers in the heap.

Why this exists
---------------
glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes (default 128 KiB) that no free
chunk can satisfy with a private ``mmap``; ``free`` gives such a block straight back to the OS. But
glibc also *raises* that threshold, process-wide and for good, whenever a mmapped block larger than
it is freed (up to 32 MiB on 64-bit), and sets ``M_TRIM_THRESHOLD`` to twice the new value. While
ONNX Runtime creates a session it allocates and frees many multi-MiB buffers (protobuf copies,
``Initializer`` copies, transposed and pre-packed weights), so after the first few frees every later
transient buffer lands in a heap arena, and arenas return memory to the OS only from their top.
Figures: docs/hygiene.md (``pytest tests/base/test_hygiene.py -m slow -s`` checks the effect). Creation
is slightly slower under hygiene: each transient buffer is a fresh mapping instead of reused heap.

:func:`allocator_hygiene` pins both thresholds for the duration of a ``with`` block, restores the
process's configured values, then calls ``malloc_trim(0)``. :func:`trim` is the trim alone.

What "restore" means (the decision)
-----------------------------------
glibc has no getter for these parameters (``mallinfo2`` and ``malloc_info`` do not report them; the
``mp_`` struct that holds them is not exported), and *any* ``mallopt`` of either threshold switches
the dynamic adjustment off for the rest of the process; glibc offers no way to switch it back on. So
the pre-entry state of an unconfigured process cannot be restored, and pretending otherwise (probing
the threshold with test allocations perturbs it; scanning libc's data segment for ``mp_`` is a guess)
would be dishonest. What ortmem restores is the process's *configured settings*, from the only
sources that can be known:

1. values set through :func:`set_malloc_thresholds` (ortmem's record of what it was asked to set);
   use it instead of calling ``mallopt`` yourself, or ortmem cannot know your values;
2. else the values glibc read at start-up: ``GLIBC_TUNABLES`` (``glibc.malloc.mmap_threshold``,
   ``glibc.malloc.trim_threshold``; it wins over the aliases, as glibc 2.36 does) or
   ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, read from ``/proc/self/environ`` (the
   start-up environment; later changes to ``os.environ`` never reach glibc either, so they are
   ignored here too), parsed like glibc parses them. Such a process already runs without the
   dynamic adjustment, so its restore is exact;
3. else the ceiling the dynamic adjustment itself climbs to: 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX``
   on 64-bit) and 64 MiB for trimming. Session creation frees multi-MiB blocks, so this is where an
   unconfigured glibc ends up after ORT anyway; the only difference is that it stays there.

Why not glibc's starting values (128 KiB, 128 KiB) for 3: with the dynamic adjustment off they make
every later malloc/free of 128 KiB or more an ``mmap``/``munmap`` plus fresh page faults. ORT with
its CPU arena is unaffected, but ORT without its arena and numpy code on MiB-sized arrays become
several times slower (docs/hygiene.md), which is a bad default for a library. Whoever wants
the strict setting (as memory-conscious deployments do, e.g. Dask's ``MALLOC_TRIM_THRESHOLD_=65536``)
sets it once, at start-up or with ``set_malloc_thresholds(mmap_threshold=128 << 10,
trim_threshold=128 << 10)``, and that value is then what is restored, exactly. Memory freed by ORT
during creation is returned either way: by the pinned thresholds while it happens and by the
``malloc_trim(0)`` at the end.

Concurrency and nesting
-----------------------
The thresholds are process-wide, so entries are counted under one lock. While any ``with`` block is
active the applied value of each threshold is the smallest one requested by an active block (and
never above the configured value: hygiene never loosens what the user set); when the last block
exits, the configured values come back. Every exit with ``trim_after=True`` trims, outside the lock.
A ``with`` block changes nothing else: ONNX Runtime's own arena (``enable_cpu_mem_arena``) stays
whatever the caller set, and no session options are touched.

Where the C library is not glibc (musl, macOS, Windows) or glibc's malloc is not the allocator in
use (jemalloc or tcmalloc preloaded), everything here is a logged no-op (logger ``ortmem.base.hygiene``,
debug level) and nothing raises.
"""
from __future__ import annotations

import ctypes
import os
from _thread import allocate_lock  # threading.Lock itself; the threading module costs a start 1.5 ms
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import SimpleNamespace

from ortmem.base.records import record
from ortmem.base.logs import debug
from ortmem.base.units import split_pair

__all__ = ["HygieneReport", "MallocThresholds", "allocator_hygiene", "set_malloc_thresholds", "trim"]


# mallopt parameter numbers from <malloc.h>; stable since glibc 2.0.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int
#: glibc's documented starting values (mallopt(3)).
GLIBC_DEFAULT_THRESHOLD = 128 * 1024
#: What an unconfigured process is restored to: the ceiling glibc's own dynamic adjustment climbs to
#: on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX = 32 MiB, trim threshold twice that). ORT's session creation
#: frees multi-MiB blocks, so a process that never used hygiene sits at or near this point anyway.
UNCONFIGURED_RESTORE = (32 << 20, 64 << 20)


@record
class MallocThresholds:
    """A pair of glibc malloc thresholds in bytes.

    This module's records are a named tuple and a namespace, not dataclasses: the hook imports this
    module into every hooked process, where dataclasses cost start time (``bench/hook_stages.py``)."""

    mmap_threshold: int
    trim_threshold: int


class HygieneReport(SimpleNamespace):
    """What one :func:`allocator_hygiene` block did, yielded by ``with ... as report`` (and filled in
    as the block exits, hence a namespace: attributes, equality and repr by value).

    ``active`` is ``False`` where there is no glibc malloc to tune (nothing was done). ``applied`` is
    what was in force when the block was entered (the minimum over concurrent blocks), ``restored``
    what was set when this block was the last to exit (``None`` if another block was still active),
    and ``released`` the resident bytes that the exit's ``malloc_trim(0)`` gave back.
    """

    active: bool
    applied: MallocThresholds | None
    restored: MallocThresholds | None
    released: int | None

    def __init__(self, active: bool, applied: MallocThresholds | None = None,
                 restored: MallocThresholds | None = None, released: int | None = None) -> None:
        super().__init__(active=active, applied=applied, restored=restored, released=released)


# --------------------------------------------------------------------------------------- libc


class _Glibc:
    """The two glibc entry points we need, resolved once from glibc itself (not the interposer)."""

    def __init__(self, lib: ctypes.CDLL, version: str):
        self.version = version
        self._mallopt = lib.mallopt
        self._mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        self._mallopt.restype = ctypes.c_int
        self._malloc_trim = lib.malloc_trim
        self._malloc_trim.argtypes = [ctypes.c_size_t]
        self._malloc_trim.restype = ctypes.c_int

    def mallopt(self, param: int, value: int) -> int:
        return self._mallopt(param, value)

    def malloc_trim(self, pad: int) -> int:
        return self._malloc_trim(pad)


_UNSET = object()
_libc_cache: object = _UNSET


def _glibc() -> _Glibc | None:
    """glibc's malloc controls, or ``None`` (logged once at debug level) when they do not apply.

    Detection by symbol, not by ``platform.libc_ver()`` (which scans the interpreter binary and says
    nothing about the allocator actually in use): ``gnu_get_libc_version`` exists only in glibc, and
    comparing the global ``malloc`` with glibc's own spots a preloaded jemalloc/tcmalloc, for which
    glibc's ``mallopt`` would tune an allocator nobody uses.
    """
    global _libc_cache
    if _libc_cache is _UNSET:
        _libc_cache = _detect_glibc()
    return _libc_cache  # type: ignore[return-value]


def _detect_glibc() -> _Glibc | None:
    try:
        default = ctypes.CDLL(None)
        get_version = default.gnu_get_libc_version
    except (OSError, TypeError, AttributeError) as e:  # Windows: CDLL(None) raises; musl/macOS: no symbol
        debug(__name__, "allocator hygiene disabled: the C library is not glibc (%s)", e)
        return None
    get_version.restype = ctypes.c_char_p
    version = get_version().decode("ascii", "replace")
    lib = _open_libc_itself(default, ctypes.cast(get_version, ctypes.c_void_p).value)
    if lib is None or not hasattr(lib, "malloc_trim") or not hasattr(lib, "mallopt"):
        debug(__name__, "allocator hygiene disabled: glibc %s found but its malloc controls are not", version)
        return None
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    if address(default.malloc) != address(lib.malloc):
        debug(__name__, "allocator hygiene disabled: malloc is interposed (jemalloc/tcmalloc?), not glibc %s's",
                  version)
        return None
    return _Glibc(lib, version)


def _open_libc_itself(default: ctypes.CDLL, symbol_address: int | None) -> ctypes.CDLL | None:
    """Open glibc by the file that defines ``gnu_get_libc_version`` (``dladdr``), so that ``malloc``
    looked up in it is glibc's own even when another allocator is preloaded."""

    class _DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    name = "libc.so.6"
    try:
        dladdr = default.dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        if symbol_address and dladdr(symbol_address, ctypes.byref(info)) and info.dli_fname:
            name = os.fsdecode(info.dli_fname)
    except AttributeError:
        pass  # no dladdr in the global namespace (old glibc without libdl loaded): use the soname
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


# ---------------------------------------------------------------------- configured thresholds


def _parse_glibc_number(text: str) -> int:
    """Parse like glibc's tunable parser (``_dl_strtoul``): leading blanks, optional sign, ``0x`` hex,
    leading ``0`` octal, digits up to the first non-digit; no digits at all parses as 0 (glibc then
    really sets 0, which makes every allocation an mmap)."""
    s = text.lstrip(" \t")
    negative = s.startswith("-")
    if s.startswith(("+", "-")):
        s = s[1:]
    base, digits = 10, "0123456789"
    if s[:2] in ("0x", "0X"):
        base, digits, s = 16, "0123456789abcdefABCDEF", s[2:]
    elif s[:1] == "0":
        base, digits = 8, "01234567"
    n = 0
    for ch in s:
        if ch not in digits:
            break
        n = n * base + int(ch, 16)
    n = min(n, 2**64 - 1)
    return (-n) % 2**64 if negative else n


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def _configured_from_environ(environ: Mapping[str, str], glibc_version: str = "2.36") -> MallocThresholds:
    """The thresholds glibc took from this start-up environment, or its defaults where none was set.

    ``GLIBC_TUNABLES`` exists since glibc 2.26 and, when it names a threshold, wins over the
    ``MALLOC_*_`` alias (verified on 2.36 with both orders of the variables); within it the last
    occurrence of a name wins, as glibc parses left to right.
    """
    values: dict[str, int] = {}
    for alias, key in (("MALLOC_MMAP_THRESHOLD_", "mmap"), ("MALLOC_TRIM_THRESHOLD_", "trim")):
        if alias in environ:
            values[key] = _parse_glibc_number(environ[alias])
    if _version_tuple(glibc_version) >= (2, 26):
        for item in environ.get("GLIBC_TUNABLES", "").split(":"):
            pair = split_pair(item)
            if pair is None:
                continue
            name, value = pair
            if name == "glibc.malloc.mmap_threshold":
                values["mmap"] = _parse_glibc_number(value)
            elif name == "glibc.malloc.trim_threshold":
                values["trim"] = _parse_glibc_number(value)
    if not values:
        return MallocThresholds(*UNCONFIGURED_RESTORE)
    # Setting either one switches glibc's adjustment off at start-up: the other keeps its default.
    return MallocThresholds(values.get("mmap", GLIBC_DEFAULT_THRESHOLD),
                            values.get("trim", GLIBC_DEFAULT_THRESHOLD))


def _startup_environ() -> dict[str, str]:
    """The environment this process started with: what glibc read, unlike today's ``os.environ``.

    ``/proc/self/environ`` shows the start-up block, which ``os.environ`` changes never reach. One
    wrinkle: glibc up to at least 2.36 NUL-terminates each recognised ``GLIBC_TUNABLES`` value in
    that very block, so ``GLIBC_TUNABLES=a=1:b=2`` reads back as ``GLIBC_TUNABLES=a=1``, ``b=2``. The
    pieces that follow it and start with ``glibc.`` (no real variable is named so) are joined back.
    """
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)
    env: dict[str, str] = {}
    in_tunables = False
    for entry in raw.split(b"\0"):
        text = os.fsdecode(entry)
        if in_tunables and text.startswith("glibc."):
            env["GLIBC_TUNABLES"] += ":" + text
            continue
        pair = split_pair(text)
        in_tunables = (pair[0] if pair else text) == "GLIBC_TUNABLES"
        if pair is not None:
            env[pair[0]] = pair[1]
    return env


# ------------------------------------------------------------------------------- shared state

_lock = allocate_lock()
_active: Counter[MallocThresholds] = Counter()  # requests of the blocks now inside allocator_hygiene
_configured: MallocThresholds | None = None  # what is restored; resolved on first use
_applied: MallocThresholds | None = None  # what ortmem last passed to mallopt (None: never touched)
_told_dynamic_off = False


def _reinit_lock_in_child() -> None:
    """A fork while another thread held the lock would leave the child's copy locked forever."""
    global _lock
    _lock = allocate_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_lock_in_child)


def _configured_locked(libc: _Glibc) -> MallocThresholds:
    global _configured
    if _configured is None:
        _configured = _configured_from_environ(_startup_environ(), libc.version)
    return _configured


def _target_locked(configured: MallocThresholds) -> MallocThresholds:
    if not _active:
        return configured
    return MallocThresholds(
        min([configured.mmap_threshold, *(r.mmap_threshold for r in _active)]),
        min([configured.trim_threshold, *(r.trim_threshold for r in _active)]),
    )


def _apply_locked(libc: _Glibc, target: MallocThresholds) -> None:
    # Applied every time, even when unchanged: mallopt is cheap, and this re-pins values that
    # someone else's direct mallopt may have changed in between.
    global _applied, _told_dynamic_off
    if not _told_dynamic_off:
        _told_dynamic_off = True
        debug(__name__, "pinning glibc malloc thresholds: glibc's dynamic mmap-threshold adjustment is now off "
                  "for the life of this process (see ortmem.base.hygiene's docstring)")
    for param, name, value in ((_M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", target.mmap_threshold),
                               (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", target.trim_threshold)):
        if value > _INT_MAX:
            debug(__name__, "%s=%d does not fit mallopt's int argument; using %d", name, value, _INT_MAX)
            value = _INT_MAX
        if libc.mallopt(param, value) != 1:
            debug(__name__, "glibc %s refused mallopt(%s, %d)", libc.version, name, value)
    _applied = target


def _check_threshold(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _INT_MAX:
        raise ValueError(f"{name} must be an int in [1, {_INT_MAX}] bytes, got {value!r}")
    return value


# ---------------------------------------------------------------------------------- public API


@contextmanager
def allocator_hygiene(
    *, mmap_threshold: int = 128 * 1024, trim_threshold: int = 128 * 1024, trim_after: bool = True
) -> Iterator[HygieneReport]:
    """Pin glibc's mmap and trim thresholds around session creation, restore, then ``malloc_trim(0)``.

    Wrap any ``onnxruntime.InferenceSession(...)`` (or anything else that allocates and frees large
    transient buffers)::

        with allocator_hygiene():
            session = onnxruntime.InferenceSession(path, options)

    Restores the configured thresholds described in the module docstring (not glibc's dynamic
    adjustment, which no API can switch back on). Nesting and concurrent use from threads are safe.
    A no-op, never an error, without glibc's malloc; ``report.active`` tells which happened.
    """
    request = MallocThresholds(_check_threshold("mmap_threshold", mmap_threshold),
                               _check_threshold("trim_threshold", trim_threshold))
    libc = _glibc()
    if libc is None:
        debug(__name__, "allocator_hygiene: no glibc malloc to tune here; nothing done")
        yield HygieneReport(active=False)
        return
    with _lock:
        _active[request] += 1
        target = _target_locked(_configured_locked(libc))
        _apply_locked(libc, target)
    report = HygieneReport(active=True, applied=target)
    try:
        yield report
    finally:
        with _lock:
            _active[request] -= 1
            if _active[request] <= 0:
                del _active[request]
            target = _target_locked(_configured_locked(libc))
            _apply_locked(libc, target)
            if not _active:
                report.restored = target
        if trim_after:
            report.released = _trim(libc)


def allocator() -> str | None:
    """The allocator hygiene works with (``"glibc 2.36"``), or None where it is a no-op."""
    libc = _glibc()
    return f"glibc {libc.version}" if libc is not None else None


def trim() -> int | None:
    """``malloc_trim(0)``: return free heap pages to the OS, for sessions created without the context.

    Returns the resident bytes released (RSS before minus after, from ``/proc/self/statm``; clamped
    at 0 because other threads may allocate meanwhile, and 0 where statm is unreadable), or ``None``
    where the C library is not glibc and nothing was done.
    """
    libc = _glibc()
    if libc is None:
        debug(__name__, "trim: no glibc malloc here; nothing done")
        return None
    return _trim(libc)


def set_malloc_thresholds(*, mmap_threshold: int, trim_threshold: int) -> bool:
    """Set both thresholds now and make them what :func:`allocator_hygiene` restores afterwards.

    Use this instead of calling ``mallopt`` directly: glibc cannot be asked for its current values,
    so ortmem restores only what it knows (this record, else the start-up environment, else glibc's
    defaults). Like any ``mallopt``, it switches glibc's dynamic adjustment off. If blocks are active,
    the lower of these and theirs stays in force until the last one exits. Returns ``False`` (and
    does nothing) without glibc's malloc.
    """
    global _configured
    configured = MallocThresholds(_check_threshold("mmap_threshold", mmap_threshold),
                                  _check_threshold("trim_threshold", trim_threshold))
    libc = _glibc()
    if libc is None:
        debug(__name__, "set_malloc_thresholds: no glibc malloc here; nothing done")
        return False
    with _lock:
        _configured = configured
        _apply_locked(libc, _target_locked(configured))
    return True


# ---------------------------------------------------------------------------------- internals


def _trim(libc: _Glibc) -> int:
    before = _statm_resident()
    libc.malloc_trim(0)
    after = _statm_resident()
    released = max(0, before - after) if before is not None and after is not None else 0
    debug(__name__, "malloc_trim(0) released %d bytes", released)
    return released


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm_resident() -> int | None:
    """Resident bytes from ``/proc/self/statm``: one short read, cheaper than parsing ``status``."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None
