"""Every measured process starts from the same machine state: writes flushed, no earlier helper running.

Why flush (``os.sync``) right before each measured process: a cold start writes its cache entry
(about the model's size) and the kernel writes those pages back over the next seconds
(``vm.dirty_expire_centisecs``, 30 s by default), on the same cores and disk a later probe uses.
Without a flush, whichever strategy runs after a writer pays for the writer's I/O (a warm start right
after a cold one can take twice as long). The flush is made after any preparation
step, which may itself write (``ortmem-start2`` prepares with a whole cold start).

Why wait for leftovers, and how they are found: a strategy may leave processes running after its
measured process exits; ortmem's cold start leaves its background finisher (``ortmem.store.finisher``),
niced and in a session of its own (``start_new_session``), so neither the measured process's exit nor
a kill of its process group ends it, and once its parent exits it is re-parented away from the bench.
While a :class:`Leftovers` scope is open this process is a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``, Linux >= 3.4): every orphan from the trees started meanwhile is
re-parented to it instead of to init, whatever sessions or double forks it went through. After the
measured process exits, :meth:`Leftovers.wait` waits for (and reaps) every such process, so the next
measurement never shares the machine with an earlier one's background work. Where ``prctl`` is
unavailable nothing is found and nothing is waited for (``Leftovers.active`` says so).
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass, field

from ortmem.base import procfs

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
#: How often the wait looks at its re-parented children again (seconds).
POLL_S = 0.01


def flush_writes() -> None:
    """Write every dirty page back before a measured process starts (see the module docstring)."""
    if hasattr(os, "sync"):
        os.sync()


def _prctl(option: int, arg: object) -> bool:
    """``prctl(option, arg)``; False where the call is unavailable or refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    return _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) and bool(flag.value)


@dataclass
class LeftoverReport:
    """What :meth:`Leftovers.wait` found: the processes it waited for, how long, and any it had to kill."""

    pids: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    killed: list[int] = field(default_factory=list)


class Leftovers:
    """Scope within which processes orphaned by the trees this process starts come back to it.

    ``with Leftovers() as lo: start and wait for the measured process; lo.wait(timeout)``.
    Children this process already had when the scope opened are never touched.
    """

    def __init__(self) -> None:
        self.active = False
        self._was = False
        self._before: set[int] = set()

    def __enter__(self) -> "Leftovers":
        self._was = _is_subreaper()
        self.active = self._was or _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self._before = set(procfs.children(os.getpid()))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active and not self._was:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)

    def _new_children(self, exclude: set[int]) -> set[int]:
        return set(procfs.children(os.getpid())) - self._before - exclude

    def wait(self, timeout: float, exclude: tuple[int, ...] = ()) -> LeftoverReport:
        """Wait until no process started within the scope is alive (except ``exclude``: children the
        caller still owns, e.g. a ``Popen`` it has not waited for); past ``timeout`` seconds kill them."""
        report = LeftoverReport()
        if not self.active:
            return report
        skip = set(exclude)
        t0 = time.monotonic()
        while True:
            alive = self._new_children(skip)
            for pid in alive:
                if pid not in report.pids:
                    report.pids.append(pid)
                if _reap(pid):
                    skip.add(pid)
            alive -= skip
            if not alive:
                break
            if time.monotonic() - t0 > timeout:
                for pid in alive:
                    _kill(pid)
                    report.killed.append(pid)
                timeout = float("inf")  # now only reap what was killed
            time.sleep(POLL_S)
        report.wait_s = time.monotonic() - t0 if report.pids else 0.0
        return report


def _reap(pid: int) -> bool:
    """True when ``pid`` (a child of this process) has exited and is now reaped."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere meanwhile (e.g. by a Popen's own wait)
        return True
    return done == pid


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
