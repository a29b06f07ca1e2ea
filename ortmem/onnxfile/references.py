"""A model file's external-data references, read and checked from its bytes (no onnx).

The loader checks every external reference before ORT reads it (:mod:`ortmem.onnxfile.external_data`
has ORT's rules), and names the tensor at fault. A model that needs nothing else of ortmem (nothing
to convert, nothing embedded to map) used to be loaded for those checks alone, importing onnx on
every first start and on every start of a model too small for a finished entry. The walk
(:mod:`ortmem.onnxfile.protowire`) hands each external tensor it meets to :class:`ExternalReferences`,
which applies the same rules to the tensor's wire fields and keeps what depends on other files: the
data files read and how far into each. :func:`ortmem.onnxfile.external_data.references_present`
checks those against the folder at decision time. Nothing here raises: a reference it cannot read plainly or that fails a rule
sends the model to the loader, which decides exactly and says why.
"""
from __future__ import annotations

from typing import Optional

from ortmem.errors import OrtmemError
from ortmem.onnxfile.external_data import EntryError, checked_span, read_entries, resolve_location
from ortmem.onnxfile.protowire import (DATA_LOCATION_EXTERNAL, LEN, TENSOR_DATA_LOCATION, TENSOR_DATA_TYPE,
                                       TENSOR_DIMS, TENSOR_EXTERNAL_DATA, TENSOR_NAME, VARINT, WireReader,
                                       read_dims)

#: The wire type protobuf expects of each tensor field read here (dims may also come packed, LEN).
_WIRE_TYPES = {TENSOR_DIMS: (VARINT, LEN), TENSOR_DATA_TYPE: (VARINT,), TENSOR_NAME: (LEN,),
               TENSOR_EXTERNAL_DATA: (LEN,), TENSOR_DATA_LOCATION: (VARINT,)}
#: StringStringEntryProto's fields.
_ENTRY_KEY, _ENTRY_VALUE = 1, 2


class ExternalReferences:
    """The external tensors of one model file, as the walk meets them: ``confirmed`` while every one
    passed the loader's rules, ``bytes`` their total length, ``ends`` the end of the furthest span
    in each data file (by location, as written)."""

    def __init__(self, file: str):
        self.file = file
        self.confirmed = True
        self.bytes = 0
        self.ends: dict[str, int] = {}
        self._sizes: dict[tuple[int, ...], int] = {}

    def tensor(self, data: bytes, i: int, j: int) -> None:
        """Check the TensorProto marked EXTERNAL in ``data[i:j]``."""
        if not self.confirmed:
            return
        try:
            location, end, length = self._span(WireReader(data, self.file), i, j)
        except (OrtmemError, EntryError, UnicodeDecodeError, IndexError):
            self.confirmed = False
            return
        self.bytes += length
        if end > self.ends.get(location, -1):
            self.ends[location] = end

    def _span(self, r: WireReader, i: int, j: int) -> tuple[str, int, int]:
        data_type = 0
        dims: list[int] = []
        entries: list[tuple[Optional[str], Optional[str]]] = []
        location = 0
        for f in r.fields(i, j):
            expected = _WIRE_TYPES.get(f.number)
            if expected is None:
                continue  # fields the loader does not read for an external tensor
            if f.wire_type not in expected:
                raise EntryError(f"field {f.number} with wire type {f.wire_type}")
            if f.number == TENSOR_DIMS:
                read_dims(r, f, dims)
            elif f.number == TENSOR_DATA_TYPE:
                data_type = f.value
            elif f.number == TENSOR_EXTERNAL_DATA:
                entries.append(_entry(r, f.payload_start, f.end))
            elif f.number == TENSOR_DATA_LOCATION:
                location = f.value
        if location != DATA_LOCATION_EXTERNAL or not -(1 << 31) <= data_type < (1 << 31):
            raise EntryError("not plainly an external tensor")
        info = read_entries(entries)
        offset, length = checked_span(info, data_type, tuple(dims), tensor="", file=self.file, sizes=self._sizes)
        return info.get("location", ""), offset + length, length


def _entry(r: WireReader, start: int, end: int) -> tuple[Optional[str], Optional[str]]:
    """One StringStringEntryProto as (key, value), None for a field it lacks (the last one wins)."""
    key = value = None
    for f in r.fields(start, end):
        if f.number in (_ENTRY_KEY, _ENTRY_VALUE):
            if f.wire_type != LEN:
                raise EntryError("an external data entry field that is not a string")
            text = bytes(r.buf[f.payload_start:f.end]).decode("utf-8")  # strict: the loader judges the rest
            if f.number == _ENTRY_KEY:
                key = text
            else:
                value = text
    return key, value
