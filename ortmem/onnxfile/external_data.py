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

import os
import re
from pathlib import Path
from typing import Iterable, Optional

from ortmem.errors import ExternalDataError, OrtmemError, TensorShapeError, UnsafePathError

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


def read_entries(entries: Iterable[tuple[Optional[str], Optional[str]]]) -> dict[str, str]:
    """The ``StringStringEntryProto`` entries, as (key, value) pairs with None for a field the entry
    lacks, as ORT's parser reads them: every entry needs a key and a value; known keys with a non-empty
    value, and keys starting with ``prepacked`` (skipped), are all it accepts; a repeated key's last
    value wins. Raises :class:`EntryError` for anything else."""
    info: dict[str, str] = {}
    for key, value in entries:
        if key is None or value is None:
            raise EntryError("external data entry without a key or a value")
        if key.startswith("prepacked"):
            continue
        if key not in KNOWN_KEYS or not value:
            raise EntryError(f"external data entry {key!r}={value!r} is not one ORT accepts")
        info[key] = value
    return info


def checked_span(info: dict[str, str], data_type: int, dims: tuple[int, ...], *, tensor: str, file: str,
                 sizes: dict[tuple[int, ...], int]) -> tuple[int, int]:
    """(offset, length) of an external tensor whose entries are ``info`` (:func:`read_entries`), checked
    as ORT will read it: a known element type, no negative dimension, an offset and a length ORT
    parses, a length equal to dtype x shape. Where its location resolves and whether the file holds
    the span are the caller's checks (:func:`resolve_location`, the file's size). ``sizes`` caches
    (data_type, *dims) -> bytes across the tensors of one model: models repeat a few shapes."""
    from ortmem.base.dtypes import byte_size, dtype_info  # here: a start that only checks the data files needs neither

    expected = sizes.get((data_type, *dims))
    if expected is None:
        dtype_info(data_type, tensor=tensor, file=file)
        if any(d < 0 for d in dims):
            raise TensorShapeError(f"negative dimension in {list(dims)}", tensor=tensor, file=file)
        expected = sizes[(data_type, *dims)] = byte_size(data_type, dims, tensor=tensor, file=file)
    offset = _int_key(info, "offset", 0, tensor, file)
    length = _int_key(info, "length", None, tensor, file)
    if length is None:
        length = expected
    if length != expected:
        raise TensorShapeError(
            f"external data length {length} does not match {dtype_info(data_type).name}{list(dims)} "
            f"= {expected} bytes",
            tensor=tensor,
            file=file,
        )
    return offset, length


def _int_key(info: dict[str, str], key: str, default: Optional[int], tensor: str, file: str) -> Optional[int]:
    if key not in info:
        return default
    try:
        value = parse_integer(info[key], signed=key == "offset")
    except ValueError:
        raise ExternalDataError(f"external data {key} {info[key]!r} is not an integer", tensor=tensor, file=file)
    if value < 0:
        raise ExternalDataError(f"external data {key} {value} is negative", tensor=tensor, file=file)
    return value


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


def resolve_location(base_real: Path, location: str, *, tensor: str, model_file: str) -> Path:
    """Resolve an external-data location the way ORT validates it: relative, inside the model folder
    after following symlinks, and an existing regular file."""
    if not location:
        raise ExternalDataError("external data has no location", tensor=tensor, file=model_file)
    if has_reserved_marker(location):
        raise UnsafePathError(f"location {location!r} uses ORT's reserved in-memory marker", tensor=tensor, file=model_file)
    if os.path.isabs(location) or location.startswith(("/", "\\")) or (len(location) > 1 and location[1] == ":"):
        raise UnsafePathError(f"absolute external data location {location!r} is not allowed", tensor=tensor, file=model_file)
    target = (base_real / location).resolve()
    if os.path.commonpath([str(base_real), str(target)]) != str(base_real):
        raise UnsafePathError(
            f"external data location {location!r} resolves to {str(target)!r}, outside the model folder",
            tensor=tensor,
            file=model_file,
        )
    if not target.is_file():
        raise ExternalDataError(f"external data file {location!r} not found", tensor=tensor, file=str(target))
    return target


def references_present(path: Path, ends: tuple[tuple[str, int], ...]) -> bool:
    """Whether every data file ``ends`` names (location, end of its furthest span) resolves inside
    ``path``'s folder as ORT requires and holds its spans: the checks of a reference that depend on
    files other than the model's own, made at each start (a record keeps ``ends``, and a data file
    can change without the model file changing)."""
    base_real = path.parent.resolve()
    try:
        for location, end in ends:
            target = resolve_location(base_real, location, tensor="", model_file=str(path))
            if os.stat(target).st_size < end:
                return False
    except (OrtmemError, OSError, ValueError, TypeError, RuntimeError, RecursionError):
        return False
    return True
