"""Harness strategies the estimator's calibration needs and ``ortmem.measure.strategies`` lacks.

Referred to by path (``bench/estimator/strategies.py:create_ort_hygiene``) so the probe's child
imports them; nothing here is part of the package.
"""
from __future__ import annotations

from typing import Any


def create_ort_hygiene(model_path: str, options: dict) -> Any:
    """Plain ORT inside ``ortmem.base.hygiene.allocator_hygiene()``: resident memory ~ memory in use,
    which is what the estimator's "with hygiene" figures predict."""
    from ortmem.base.hygiene import allocator_hygiene
    from ortmem.measure.strategies import create_ort

    with allocator_hygiene():
        return create_ort(model_path, options)


def create_ortmem_warm_hygiene(model_path: str, options: dict) -> Any:
    """``ortmem.InferenceSession`` on a cache hit, inside ``allocator_hygiene()``."""
    from ortmem.base.hygiene import allocator_hygiene
    from ortmem.measure.strategies import create_ortmem_warm

    with allocator_hygiene():
        return create_ortmem_warm(model_path, options)
