"""What the installed ORT release does, for tests whose expected values depend on it.

Every answer comes from ``ortmem.ort.release`` (table + probe of this very build), never from a
constant measured on another release.
"""
from __future__ import annotations

from typing import Optional

from ortmem.ort.release import capabilities


def matmul_refusal(weight_type: str, has_zp: bool, scale_type: str, accuracy: int, block_size: int = 32) -> Optional[str]:
    """Why ortmem leaves this DQ+MatMul variant to the installed ORT (None: it converts it)."""
    scale = {"float32": "float"}.get(scale_type, scale_type)
    return capabilities().matmul_refusal(weight_type=weight_type, has_zp=has_zp, scale_type=scale,
                                         accuracy=accuracy, block_size=block_size)


def gather_refusal(weight_type: str, has_zp: bool, scale_type: str) -> Optional[str]:
    """Why ortmem writes no GatherBlockQuantized for this DQ+Gather on the installed ORT (None: it does)."""
    scale = {"float32": "float"}.get(scale_type, scale_type)
    return capabilities().gather_refusal(weight_type=weight_type, has_zp=has_zp, scale_type=scale)
