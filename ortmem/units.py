"""Byte counts and dimension sizes as people write them on command lines and in environment variables."""
from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_BYTES = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912; ``"2GB"`` -> 2000000000; ``"1024"`` -> 1024; ``"4k"`` -> 4096.
    Integers stay exact (no float rounding of a 40-bit count)."""
    m = _BYTES.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte count: {text!r} (examples: 1048576, 512MiB, 2GB, 1.5GiB)")
    unit = _UNITS[m.group(2).lower()]
    if "." not in m.group(1):
        return int(m.group(1)) * unit
    return int(round(float(m.group(1)) * unit))


def bytes_arg(text: str) -> int:
    """:func:`parse_bytes` for ``argparse`` (``type=bytes_arg``): a usage error, not a traceback."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_dim(text: str) -> tuple[str, int]:
    """``"seq=512"`` -> ``("seq", 512)`` for ``argparse`` (``type=parse_dim``): a usage error, not a traceback."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"dimension {name!r} needs an integer value, got {value!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"dimension {name!r} must be >= 0")
    return name, v
