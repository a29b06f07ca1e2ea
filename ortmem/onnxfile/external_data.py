"""How ONNX Runtime reads a tensor's ``external_data`` entries: the keys it knows, how it parses an
offset or a length, and the location prefixes it reserves for itself.

ortmem checks every external reference before ORT sees the model, so it must accept exactly what
ORT accepts: anything looser and ``ortmem.load`` says OK to a model ORT then refuses; anything
stricter and ortmem refuses a model plain ORT runs. The rules below are ORT's, read from its source
(``core/framework/tensor_external_data_info.cc``, ``ParseStringWithClassicLocale``, which is
``std::from_chars`` over the whole string) and checked by experiment against the installed release
in ``tests/onnxfile/test_external_data.py`` (CI runs it on every release it tests: 1.25.1, 1.31.1, 1.32.0).
They are per-release knowledge: a release that parses differently changes this module, nothing else.
"""
from __future__ import annotations

import re
from typing import Iterable

#: Location prefixes ORT reserves for in-memory addresses and refuses in user models.
RESERVED_LOCATION_MARKERS = ("_ORT_MEM_ADDR_", "_ORT_NATIVE_ENDIAN_MEM_ADDR_")

#: The keys ORT's parser knows; any other key (and an empty value for these) is "model format error!",
#: except keys starting with ``prepacked``, which it skips.
KNOWN_KEYS = ("location", "offset", "length", "checksum")

#: ASCII digits, a ``-`` for the signed offset only, nothing before or after. Python's ``int`` also
#: takes spaces, ``+``, ``4_096`` and non-ASCII digits, which ORT refuses.
_OFFSET = re.compile(r"-?[0-9]+", re.ASCII)
_LENGTH = re.compile(r"[0-9]+", re.ASCII)


class EntryError(ValueError):
    """An external_data entry ORT refuses; the caller names the tensor and the file."""


def read_entries(entries: Iterable) -> dict[str, str]:
    """The ``StringStringEntryProto`` entries as ORT's parser reads them: every entry needs a key and a
    value; known keys with a non-empty value, and keys starting with ``prepacked`` (skipped), are all
    it accepts; a repeated key's last value wins. Raises :class:`EntryError` for anything else."""
    info: dict[str, str] = {}
    for e in entries:
        if not e.HasField("key") or not e.HasField("value"):
            raise EntryError("external data entry without a key or a value")
        if e.key.startswith("prepacked"):
            continue
        if e.key not in KNOWN_KEYS or not e.value:
            raise EntryError(f"external data entry {e.key!r}={e.value!r} is not one ORT accepts")
        info[e.key] = e.value
    return info


def parse_integer(text: str, *, signed: bool) -> int:
    """``text`` as ORT parses an external-data offset (``signed``, an int64) or length (a size_t);
    ValueError where ORT fails."""
    if not (_OFFSET if signed else _LENGTH).fullmatch(text):
        raise ValueError(text)
    value = int(text)
    if not (-(1 << 63) <= value < (1 << 63) if signed else value < (1 << 64)):
        raise ValueError(text)
    return value


def has_reserved_marker(location: str) -> bool:
    """True when ``location`` uses a prefix ORT reserves for in-memory data (it refuses those)."""
    return any(m in location for m in RESERVED_LOCATION_MARKERS)
