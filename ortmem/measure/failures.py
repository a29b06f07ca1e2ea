"""Errors raised by the measurement tools.

They subclass :class:`ortmem.errors.OrtmemError` so callers catching ortmem's hierarchy also
catch a failed or impossible measurement.
"""
from __future__ import annotations

from ortmem.errors import OrtmemError


class ProbeUnsupported(OrtmemError):
    """This platform has no ``/proc`` (or no ``VmHWM``/``RssAnon``): honest numbers are impossible.

    Raised instead of returning zeros, because a silently empty measurement would pass a memory
    budget gate that should have failed.
    """


class ProbeError(OrtmemError):
    """The measured child process failed (strategy raised, crashed, or timed out).

    ``stderr`` holds the tail of the child's standard error so the cause is visible from the parent.
    """

    def __init__(self, message: str, *, stderr: str = "", returncode: int | None = None):
        self.stderr = stderr
        self.returncode = returncode
        tail = f"\n--- child stderr (tail) ---\n{stderr}" if stderr else ""
        super().__init__(f"{message}{tail}")
