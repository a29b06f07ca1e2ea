"""One exception hierarchy for everything ortmem refuses to do.

Every error names the tensor (where there is one) and the file, because the person reading it
has a multi-GB model and needs to know exactly which initializer in which file is wrong.
"""
from __future__ import annotations

import errno
import os
import re
from typing import Hashable, Mapping, Optional


class OrtmemError(Exception):
    """Base class: ``tensor`` and ``file`` are kept as attributes so callers can act on them."""

    def __init__(self, message: str, *, tensor: str | None = None, file: str | os.PathLike | None = None):
        self.tensor = tensor
        self.file = os.fspath(file) if file is not None else None
        where = []
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if self.file is not None:
            where.append(f"file {self.file!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class CorruptModelError(OrtmemError):
    """The .onnx protobuf is truncated or malformed."""


class ExternalDataError(OrtmemError):
    """An external-data reference is missing, short, or otherwise unreadable."""


class UnsafePathError(ExternalDataError):
    """An external-data location is absolute, or escapes the model folder (``..`` or a symlink)."""


class TensorShapeError(OrtmemError):
    """The bytes present do not match dtype x shape."""


class UnsupportedDtypeError(OrtmemError):
    """A tensor data type ortmem does not know how to map."""


class WeightStateError(OrtmemError):
    """A weight was used after it was released, or released while still needed."""


class ConversionError(OrtmemError):
    """A rewrite pass could not produce a valid model."""


class CacheError(OrtmemError):
    """A cache entry could not be written or verified."""


class StageFailedError(OrtmemError):
    """A pipeline stage on another node died, timed out or could not start (``ortmem.plan.partition.ray``):
    ``stage`` (index) and ``node`` say which, so the caller knows what to restart or re-plan."""

    def __init__(self, message: str, *, stage: int, node: str | None, file: str | os.PathLike | None = None):
        self.stage = stage
        self.node = node
        super().__init__(f"stage {stage} on node {node or 'of the driver'}: {message}", file=file)


class PlanError(OrtmemError):
    """No placement fits the budgets.

    ``needed`` maps each device to the smallest budget it alone would need (the others unchanged) for
    a placement to exist, or ``None`` when raising that device's budget alone never helps.
    """

    def __init__(self, message: str, *, needed: Mapping[Hashable, Optional[int]] | None = None):
        super().__init__(message)
        self.needed = dict(needed or {})


#: What ORT's (and the C library's, and Python's) messages say when the process ran out of something
#: rather than when ORT found fault with what it was given, lower-cased: ``std::bad_alloc`` (any failed
#: C++ allocation, an address-space limit included), ``Cannot allocate memory`` (ENOMEM, as ORT words a
#: failed ``mmap``), ``Too many open files`` (EMFILE, ENFILE), ``pthread_create`` (a thread pool that
#: got no thread), ``Resource temporarily unavailable`` (EAGAIN), ``Failed to allocate`` (ORT's arena),
#: ``out of memory`` (a device's), ``can't start new thread`` (Python's own).
RESOURCE_FAILURE_PHRASES = (
    "bad_alloc",
    "cannot allocate memory",
    "too many open files",
    "pthread_create",
    "resource temporarily unavailable",
    "failed to allocate",
    "out of memory",
    "can't start new thread",
)
#: The same failures as error numbers: ``OSError.errno``, and in ORT's words, which name only the
#: number ("pthread_create failed, error code: 12", "Load model from m.onnx failed:system error number 24").
RESOURCE_ERRNOS = frozenset({errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN})
#: Compiled on first use (by ``re``'s own cache): only a failure reads it, and every start imports this module.
_ERROR_NUMBER = r"(?:error code|error number|errno)\s*[:=]?\s*(\d+)"


def resource_failure(failure: BaseException | str) -> bool:
    """Whether ``failure`` (an exception, or its text) says the process ran out of memory, address
    space, threads or file descriptors, not that ORT refused what it was given.

    Why one function: ortmem discards a cache entry only when ORT refuses it for what it holds; a
    failure of resources says nothing about the entry (a good one would be lost, and the next start
    would pay for building it again), so the entry is kept and the start retries after freeing what
    the failed attempt took. Every place that decides between those asks this. An exception's causes
    and contexts are asked too (a ``CacheError`` raised from ORT's ``bad_alloc``)."""
    seen: set[int] = set()
    pending: list[BaseException | str | None] = [failure]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, BaseException):
            if isinstance(current, MemoryError) or getattr(current, "errno", None) in RESOURCE_ERRNOS:
                return True
            pending += [current.__cause__, current.__context__]
        text = str(current)
        if any(phrase in text.lower() for phrase in RESOURCE_FAILURE_PHRASES):
            return True
        if any(int(number) in RESOURCE_ERRNOS for number in re.findall(_ERROR_NUMBER, text, re.IGNORECASE)):
            return True
    return False
