"""Byte counts, dimension sizes and ``NAME=VALUE`` pairs as people write them on command lines and in
environment variables.

``argparse`` is imported only where an argument is refused: the hook's allocator hygiene reads the
environment's pairs with this module and loads nothing it does not need.
"""
from __future__ import annotations

import os
import re
from typing import Optional

#: The mebibyte, defined once for the modules that name it (others still write ``2**20`` inline).
MiB = 1 << 20
#: This machine's memory page: the unit ORT maps files in and the digest samples by.
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # mmap.PAGESIZE, without mmap

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
#: Compiled by ``re`` on first use and kept in its cache: compiling it at import cost 0.5 ms of every
#: hooked process, which imports this module for the allocator's settings and never parses a size.
_BYTES = r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$"


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912; ``"2GB"`` -> 2000000000; ``"1024"`` -> 1024; ``"4k"`` -> 4096.
    Integers stay exact (no float rounding of a 40-bit count)."""
    m = re.match(_BYTES, text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte count: {text!r} (examples: 1048576, 512MiB, 2GB, 1.5GiB)")
    unit = _UNITS[m.group(2).lower()]
    if "." not in m.group(1):
        return int(m.group(1)) * unit
    return int(round(float(m.group(1)) * unit))


def _usage_error(message: str) -> Exception:
    """What an ``argparse`` type function raises: a usage error, not a traceback."""
    import argparse

    return argparse.ArgumentTypeError(message)


def bytes_arg(text: str) -> int:
    """:func:`parse_bytes` for ``argparse`` (``type=bytes_arg``): a usage error, not a traceback."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise _usage_error(str(e)) from None


def split_pair(text: str, *, at_last: bool = False) -> Optional[tuple[str, str]]:
    """``"seq=512"`` -> ``("seq", "512")``: a ``NAME=VALUE`` pair split at its first ``=`` (the value may
    hold more), or at its last with ``at_last`` (the name may); None when there is no ``=``. The one
    reader of such pairs: command-line arguments, environment blocks, glibc's tunables."""
    name, sep, value = text.rpartition("=") if at_last else text.partition("=")
    return (name, value) if sep else None


def pair_arg(text: str, form: str = "NAME=VALUE", *, value_required: bool = False, at_last: bool = False) -> tuple[str, str]:
    """:func:`split_pair` for ``argparse``: a usage error ("expected ``form``") without an ``=``, without a
    name, or (``value_required``) without a value."""
    pair = split_pair(text, at_last=at_last)
    if pair is None or not pair[0] or (value_required and not pair[1]):
        raise _usage_error(f"expected {form}, got {text!r}")
    return pair


def parse_dim(text: str) -> tuple[str, int]:
    """``"seq=512"`` -> ``("seq", 512)`` for ``argparse`` (``type=parse_dim``): a usage error, not a traceback."""
    name, value = pair_arg(text)
    try:
        v = int(value)
    except ValueError:
        raise _usage_error(f"dimension {name!r} needs an integer value, got {value!r}") from None
    if v < 0:
        raise _usage_error(f"dimension {name!r} must be >= 0")
    return name, v
