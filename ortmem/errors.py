"""One exception hierarchy for everything ortmem refuses to do.

Every error names the tensor (where there is one) and the file, because the person reading it
has a multi-GB model and needs to know exactly which initializer in which file is wrong.
"""
from __future__ import annotations

import os
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
    """A pipeline stage on another node died, timed out or could not start (``ortmem.distributed``):
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
