"""Just enough of the protobuf wire format to find weight bytes inside an .onnx file.

``onnx.load`` parses the whole ModelProto, so every embedded ``raw_data`` is copied into Python
memory before anything else can happen. ortmem instead walks the serialized bytes of the file
(memory-mapped, so nothing is read that is not needed), copies every field that is *not* a large
``raw_data`` verbatim, and replaces each large ``raw_data`` with an external-data reference to its
own span in the same file::

    TensorProto{name, dims, data_type, raw_data=<N bytes>}
      -> TensorProto{name, dims, data_type, data_location=EXTERNAL,
                     external_data=[location=<model file>, offset=<span start>, length=N]}

The result (the *skeleton*) is a valid ModelProto with no weight bytes that onnx can parse cheaply
and ONNX Runtime can load, memory-mapping every weight straight out of the original file.

Only the messages that can hold tensors are descended into (model -> graph/functions/training ->
node -> attribute -> tensor/graph, sparse tensors); every other field is copied as bytes, so
unknown or future fields survive unchanged. A message whose content did not change is copied as
one slice, which keeps the skeleton build linear in the size of the graph, not of the weights.

Every tensor the walk leaves inline is screened on the way (:class:`TensorScreen`): its raw_data
size against dtype x shape, and whether it is external. A clean screen lets the loader skip its
own pass over the parsed tensors; the screen never decides an error, the loader's exact check does.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Container, Iterator, Optional

from ortmem.base.records import record
from ortmem.base.dtypes import byte_size
from ortmem.errors import CorruptModelError, OrtmemError

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5

# onnx.proto field numbers, for the messages that can (transitively) contain tensors.
MODEL_GRAPH, MODEL_TRAINING_INFO, MODEL_FUNCTIONS = 7, 20, 25
TRAINING_INITIALIZATION, TRAINING_ALGORITHM = 1, 2
FUNCTION_NODE = 7
GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_SPARSE_INITIALIZER = 1, 5, 15
NODE_ATTRIBUTE = 5
NODE_INPUT, NODE_OUTPUT, NODE_OP_TYPE, NODE_DOMAIN = 1, 2, 4, 7  # read by ortmem.onnxfile.convertible
ATTR_T, ATTR_G, ATTR_TENSORS, ATTR_GRAPHS, ATTR_SPARSE_TENSOR, ATTR_SPARSE_TENSORS = 5, 6, 10, 11, 22, 23
SPARSE_VALUES, SPARSE_INDICES = 1, 2
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME, TENSOR_RAW_DATA = 1, 2, 8, 9
TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION = 13, 14
DATA_LOCATION_EXTERNAL = 1
_ONE_BYTE = [bytes((b,)) for b in range(0x80)]


def encode_varint(value: int) -> bytes:
    if 0 <= value < 0x80:  # keys and short lengths: every externalized tensor writes a dozen
        return _ONE_BYTE[value]
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field_no: int, wire_type: int) -> bytes:
    key = (field_no << 3) | wire_type
    return _ONE_BYTE[key] if key < 0x80 else encode_varint(key)


def encode_len_field(field_no: int, payload: bytes) -> bytes:
    n = len(payload)
    return _key(field_no, LEN) + (_ONE_BYTE[n] if n < 0x80 else encode_varint(n)) + payload


def encode_string_entry(field_no: int, key: str, value: str) -> bytes:
    """A StringStringEntryProto (key=1, value=2) as a length-delimited field."""
    body = encode_len_field(1, key.encode()) + encode_len_field(2, value.encode())
    return encode_len_field(field_no, body)


class FileBytes:
    """Random access to a file's bytes through ``pread``, so nothing is mapped into the process.

    Reading tensor headers through an mmap costs far more resident memory than the bytes read:
    the kernel maps whole page-cache folios (up to 2 MiB) on each fault, so walking a model with a
    few hundred tensors would transiently "use" hundreds of MiB. ``pread`` fills the page cache
    (shared, reclaimable) without charging this process for it.
    """

    def __init__(self, fd: int, size: int, window: int = 64 * 1024):
        self.fd = fd
        self.size = size
        self.window = window
        self._start = 0
        self._data = b""

    def __len__(self) -> int:
        return self.size

    def _load(self, pos: int) -> None:
        start = pos - pos % 4096
        self._data = os.pread(self.fd, self.window, start)
        self._start = start

    def chunk_at(self, pos: int, ahead: int = 20) -> tuple[bytes, int]:
        """``(data, start)``: the loaded window, moved so that it holds ``buf[pos:pos + ahead]`` (or
        up to the end of the file); lets a caller decode many small fields without a call per byte."""
        stop = self._start + len(self._data)
        if not (self._start <= pos and (pos + ahead <= stop or stop == self.size)):
            self._load(pos)
        return self._data, self._start

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.size)
            if stop <= start:
                return b""
            if self._start <= start and stop <= self._start + len(self._data):
                return self._data[start - self._start : stop - self._start]
            return os.pread(self.fd, stop - start, start)
        if not (self._start <= key < self._start + len(self._data)):
            if not 0 <= key < self.size:
                raise IndexError(key)
            self._load(key)
        return self._data[key - self._start]


@record
class Field:
    """One field of a message (a named tuple: the walk makes one per field it reads in full)."""

    number: int
    wire_type: int
    start: int  # first byte of the key
    end: int  # one past the last byte of the field
    value: int = 0  # varint / fixed value
    payload_start: int = 0  # LEN fields: where the payload begins


@record
class TensorSpan:
    """Where a TensorProto's raw_data lies in the file, with the metadata needed to describe it."""

    name: str
    data_type: int
    dims: list[int]
    offset: int
    length: int


class WireReader:
    """Reads fields from a buffer (bytes, mmap or memoryview) with bounds checks that name the file."""

    def __init__(self, buf, file: str):
        self.buf = buf
        self.file = file

    def _corrupt(self, what: str, pos: int) -> CorruptModelError:
        return CorruptModelError(f"malformed protobuf: {what} at byte {pos}", file=self.file)

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        """The varint at ``pos`` (at most 10 bytes, inside ``end``) and the position after it."""
        head = self.buf[pos : min(pos + 10, end)]
        value, i = _varint_from(head, 0)
        if value is None:
            if len(head) < 10:
                raise self._corrupt("truncated varint", pos + len(head))
            raise self._corrupt("varint longer than 10 bytes", pos + 10)
        return value, pos + i

    def fields(self, start: int, end: int):
        """Yield every field of the message occupying ``buf[start:end]``.

        The key and length varints are decoded from a small window read once per field (one
        ``buf`` slice, not one call per byte): a graph with 1e5 initializers is walked in
        a fraction of a second.
        """
        buf = self.buf
        windowed = isinstance(buf, FileBytes)
        data, base = buf, 0
        pos = start
        while pos < end:
            if windowed:
                data, base = buf.chunk_at(pos)
            key, j = _varint_from(data, pos - base)
            if key is None or base + j > end:
                key, p = self.varint(pos, end)  # truncated or over-long: the checked path names the fault
            else:
                p = base + j
            number, wire_type = key >> 3, key & 7
            if number == 0:
                raise self._corrupt("field number 0", pos)
            if wire_type == VARINT or wire_type == LEN:
                value, j = _varint_from(data, p - base)
                if value is None or base + j > end:
                    value, p = self.varint(p, end)
                else:
                    p = base + j
                if wire_type == VARINT:
                    yield Field(number, wire_type, pos, p, value)
                else:
                    if p + value > end:
                        raise self._corrupt(f"field {number} of {value} bytes runs past the end of its message", pos)
                    yield Field(number, wire_type, pos, p + value, value, p)
                    p += value
            elif wire_type == I64:
                if p + 8 > end:
                    raise self._corrupt("truncated fixed64", pos)
                yield Field(number, wire_type, pos, p + 8)
                p += 8
            elif wire_type == I32:
                if p + 4 > end:
                    raise self._corrupt("truncated fixed32", pos)
                yield Field(number, wire_type, pos, p + 4)
                p += 4
            else:
                raise self._corrupt(f"unsupported wire type {wire_type} for field {number}", pos)
            pos = p

    def scan(self, start: int, end: int, actions: "FieldActions", *, screen: Optional["TensorScreen"] = None,
             short: int = -1) -> Iterator[tuple[int, int, int, int]]:
        """Yield ``(number, field start, payload start, field end)`` for the length-delimited fields of
        the message in ``buf[start:end]`` that ``actions`` wants; every other field is checked and
        skipped without making a Python object for it. Tensor fields whose payload is at most
        ``short`` bytes are not yielded but handed to ``screen``.

        This is the loop a graph with 1e5 initializers spends its time in, so keys and lengths of up to
        two bytes are decoded inline (one index per byte), short tensors are screened in place, and
        fields nobody wants (varints, fixed-size values, length-delimited fields with two-byte keys)
        are skipped by :func:`_skipped`; anything longer, truncated or malformed goes through
        :meth:`fields`' checked decoding for that one field, which names the fault.
        """
        buf = self.buf
        windowed = isinstance(buf, FileBytes)
        direct = windowed or isinstance(buf, bytes)  # the screen compares bytes in place
        by_key, wanted, tensors = actions.by_key, actions.wanted, actions.tensors
        tensor_in = screen.tensor_in if screen is not None else None
        # Positions are relative to the loaded data (buf[base:base + size]) inside the loop.
        data, base = (b"", start) if windowed else (buf, 0)
        size = len(data)
        i, j = start - base, end - base
        while i < j:
            if windowed and i + 20 > size:  # 20: a key and a length varint, 10 bytes at most each
                data, new_base = buf.chunk_at(base + i)
                i, j, base, size = i + base - new_base, j + base - new_base, new_base, len(data)
            action = by_key[data[i]] if i + 3 <= size else None
            if action is not None:
                n = data[i + 1]
                p = i + 2
                if n >= 0x80:
                    n2 = data[i + 2]
                    n = (n & 0x7F) | (n2 << 7) if n2 < 0x80 else -1
                    p = i + 3
                if n >= 0:
                    q = p + n
                    if q > j:
                        raise self._corrupt(f"field {data[i] >> 3} of {n} bytes runs past the end of its message",
                                            base + i)
                    if action == _TENSOR and n <= short:
                        if q <= size and direct:
                            tensor_in(data, p, q)
                        else:
                            screen.tensor_at(buf, base + p, base + q)
                    elif action:
                        yield data[i] >> 3, base + i, base + p, base + q
                    i = q
                    continue
            if i + 12 <= size:  # a two-byte key and a ten-byte varint fit: skip what is not wanted inline
                q = _skipped(data, i, j, wanted)
                if q >= 0:
                    i = q
                    continue
            # Anything else (a long key or length, a group, the end of the data): checked path.
            f = next(self.fields(base + i, end))
            if f.wire_type == LEN and f.number in wanted:
                if f.value > short or f.number not in tensors:
                    yield f.number, f.start, f.payload_start, f.end
                else:
                    screen.tensor_at(buf, f.payload_start, f.end)
            i = f.end - base

    def string(self, f: Field) -> str:
        return bytes(self.buf[f.payload_start : f.end]).decode("utf-8", errors="replace")


_SKIP, _YIELD, _TENSOR = 0, 1, 2  # what WireReader.scan does with a field


def _skipped(data: bytes, i: int, j: int, wanted: Container[int]) -> int:
    """Where the field at ``data[i]`` ends when :meth:`WireReader.scan` skips it without the checked
    path: a varint, fixed64 or fixed32 field with a key of one or two bytes, or a length-delimited
    field with a two-byte key that is not ``wanted`` (a one-byte one is ``by_key``'s), whose length
    takes at most two bytes; -1 for anything else, or for a field that would end past ``j`` (the
    checked path then names the fault). The caller guarantees 12 readable bytes from ``i``.

    Why: every attribute of every node has a ``type`` (field 20, a two-byte key) and most an ``i`` or
    ``f``; on the checked path each cost a generator and a named tuple, about 60% of a walk of a
    model with many nodes (rapidocr's recognition model: 1552 messages, 9.8 ms)."""
    key, k = _short_varint(data, i)
    wire_type = key & 7
    if key < 8:  # field number 0 (or a key longer than two bytes): the checked path decides
        return -1
    if wire_type == VARINT:
        stop = k + 10
        while k < stop and data[k] >= 0x80:
            k += 1
        end = k + 1 if k < stop else -1
    elif wire_type == I64:
        end = k + 8
    elif wire_type == I32:
        end = k + 4
    elif wire_type == LEN and k == i + 2 and (key >> 3) not in wanted:
        n, k = _short_varint(data, k)
        end = k + n if n >= 0 else -1
    else:
        return -1
    return end if 0 <= end <= j else -1


def _short_varint(data: bytes, k: int) -> tuple[int, int]:
    """The varint of one or two bytes at ``data[k]`` and the position after it; (-1, k) when it is
    longer. The caller guarantees two readable bytes."""
    first = data[k]
    if first < 0x80:
        return first, k + 1
    second = data[k + 1]
    if second >= 0x80:
        return -1, k
    return (first & 0x7F) | (second << 7), k + 2


class FieldActions:
    """Which fields of one message kind :meth:`WireReader.scan` yields (``wanted``) and which of those
    are tensors it may screen in place (``tensors``), with ``by_key``: the action for each one-byte
    key of a length-delimited field (None for every other byte: the checked path decides)."""

    def __init__(self, wanted: Container[int], tensors: Container[int] = ()):
        self.wanted = wanted
        self.tensors = tensors
        self.by_key: list[Optional[int]] = [None] * 256
        for key in range(8, 0x80):
            if key & 7 == LEN:
                number = key >> 3
                self.by_key[key] = (_TENSOR if number in tensors else _YIELD) if number in wanted else _SKIP


def _varint_from(data: bytes, i: int) -> tuple[Optional[int], int]:
    """A varint of at most 10 bytes starting at ``data[i]``; (None, i) when ``data`` ends first or
    it is longer (the caller then takes the checked path, which reports the fault)."""
    result = shift = 0
    n = len(data)
    while i < n and shift <= 63:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i
        shift += 7
    return None, i


class TensorScreen:
    """What the walk learned about the tensors it leaves in the skeleton, so the loader can skip the
    per-tensor pass over the parsed skeleton when there is nothing in it to register or to check.

    ``external`` counts tensors marked EXTERNAL (the loader must check and register each one).
    ``unconfirmed`` counts inline tensors whose raw_data the screen could not confirm to match dtype x
    shape: a wrong size, an unknown or STRING type, or bytes it does not read plainly (long varints,
    groups, a truncated field). The screen never raises: when anything is unconfirmed, the loader
    checks every inline tensor itself, exactly as ORT will see it, and names the tensor at fault. The
    screen reads a superset of the tensors the loader checks, so a clean screen means a clean check.
    """

    def __init__(self, references: Optional[Any] = None) -> None:
        self.external = 0
        self.unconfirmed = 0
        #: Given each external tensor's bytes when set (:class:`ortmem.onnxfile.references.ExternalReferences`).
        self.references = references
        self._sizes: dict[tuple[int, ...], int] = {}  # (data_type, *dims) -> bytes: models repeat a few shapes
        # The last canonical header seen (the dims and data_type fields' bytes, as protobuf writes them
        # before the name) and the raw_data size it means: runs of same-shaped tensors (biases, norms,
        # scales) are confirmed by a byte comparison instead of a field-by-field read.
        self._header = b"\xff"  # no tensor starts with 0xff (a key needs a field number): matches nothing
        self._header_size = -1

    def inline(self, data_type: int, dims: list[int], raw_length: int) -> None:
        """Confirm ``raw_length`` bytes of raw_data for a tensor of ``data_type`` and ``dims`` (varint values)."""
        if not raw_length:
            return  # no raw_data (or an empty one): nothing to check, as in the loader
        key = (data_type, *dims)
        expected = self._sizes.get(key)
        if expected is None:
            expected = self._sizes[key] = _plain_byte_size(data_type, dims)
        if raw_length != expected:
            self.unconfirmed += 1

    def external_tensor(self, buf, start: int, end: int) -> None:
        """Count the TensorProto marked EXTERNAL in ``buf[start:end]`` and hand its bytes to ``references``."""
        self.external += 1
        if self.references is not None:
            if end - start > EXTERNAL_TENSOR_MAX_BYTES:
                self.references.confirmed = False  # a reference is a few dozen bytes: the loader judges this one
            else:
                self.references.tensor(bytes(buf[start:end]), 0, end - start)

    def tensor_at(self, buf, start: int, end: int) -> None:
        """Screen the short TensorProto in ``buf[start:end]`` (a :class:`FileBytes` or any buffer)."""
        if isinstance(buf, FileBytes):
            data, base = buf.chunk_at(start, end - start)
        else:  # bytes, mmap or memoryview: a copy of this one short message
            data, base = bytes(buf[start:end]), start
        if start < base or end - base > len(data):
            self.unconfirmed += 1  # longer than a window (inline_max_bytes was raised): leave it to the loader
            return
        self.tensor_in(data, start - base, end - base)

    def tensor_in(self, data: bytes, i: int, j: int) -> None:
        """Screen the TensorProto in ``data[i:j]``."""
        # Fast path: the learned header, then name (field 8) and raw_data (field 9) ending the message,
        # each with a length of one or two bytes. The same bytes parse to the same fields.
        header = self._header
        k = i + len(header)
        if data.startswith(header, i) and k + 3 < j and data[k] == _NAME_KEY:
            n = data[k + 1]
            if n < 0x80:
                k += 2 + n
            elif data[k + 2] < 0x80:
                k += 3 + ((n & 0x7F) | (data[k + 2] << 7))
            else:
                k = j  # a longer name: the general read below
            if k + 3 < j and data[k] == _RAW_DATA_KEY:
                n = data[k + 1]
                if n < 0x80:
                    k += 2
                elif data[k + 2] < 0x80:
                    n = (n & 0x7F) | (data[k + 2] << 7)
                    k += 3
                else:
                    n = j  # a longer length: k + n cannot be j
                if k + n == j:
                    if n != self._header_size:
                        self.unconfirmed += 1
                    return
        self._read_fields(data, i, j)

    def _read_fields(self, data: bytes, i: int, j: int) -> None:
        """The general screen of one tensor in ``data[i:j]``: every field read; learns the header."""
        start = i
        name_at = -1  # where the name starts, when only dims and data_type came before it
        dims: list[int] = []
        data_type = raw_length = location = 0
        while i < j:
            key = data[i]
            wire_type = key & 7
            if key >= 0x80 or key < 8 or wire_type not in (VARINT, LEN) or i + 1 >= j:  # long key, field 0, fixed, group
                self.unconfirmed += 1
                return
            if name_at == -1:
                if key == _NAME_KEY:
                    name_at = i
                elif key not in _SHAPE_KEYS:
                    name_at = -2  # something else before the name: no header to learn
            elif key in _SHAPE_KEYS:
                name_at = -2  # shape fields after the name: the header alone does not say the shape
            value = data[i + 1]
            if value < 0x80:
                i += 2
            else:
                value, i = _varint_from(data, i + 1)
                if value is None or i > j:
                    self.unconfirmed += 1
                    return
            if wire_type == LEN:
                if i + value > j:
                    self.unconfirmed += 1
                    return
                if key == _RAW_DATA_KEY:
                    raw_length = value
                elif key == _PACKED_DIMS_KEY and not _unpack_varints(data, i, i + value, dims):
                    self.unconfirmed += 1
                    return
                i += value
            elif key == _DIMS_KEY:
                dims.append(value)
            elif key == _DATA_TYPE_KEY:
                data_type = value
            elif key == _DATA_LOCATION_KEY:
                if value > DATA_LOCATION_EXTERNAL:  # not a DataLocation: protobuf keeps it aside
                    self.unconfirmed += 1
                    return
                location = value
        if location:
            self.external_tensor(data, start, j)
            return
        self.inline(data_type, dims, raw_length)
        if name_at > start and raw_length:
            # Only dims and data_type before the name, none after: the header alone says the shape.
            # The fast path checks that the rest is a name and a final raw_data on every use.
            self._header = bytes(data[start:name_at])
            self._header_size = self._sizes[(data_type, *dims)]


_DIMS_KEY = TENSOR_DIMS << 3 | VARINT
_PACKED_DIMS_KEY = TENSOR_DIMS << 3 | LEN
_DATA_TYPE_KEY = TENSOR_DATA_TYPE << 3 | VARINT
_RAW_DATA_KEY = TENSOR_RAW_DATA << 3 | LEN
_NAME_KEY = TENSOR_NAME << 3 | LEN
_SHAPE_KEYS = (_DIMS_KEY, _PACKED_DIMS_KEY, _DATA_TYPE_KEY)
_DATA_LOCATION_KEY = TENSOR_DATA_LOCATION << 3 | VARINT


def _unpack_varints(data, i: int, j: int, out: list[int]) -> bool:
    """Append the packed varints in ``data[i:j]`` to ``out``; False when they do not end exactly at j."""
    while i < j:
        value, i = _varint_from(data, i)
        if value is None or i > j:
            return False
        out.append(value)
    return True


def _plain_byte_size(data_type: int, dims: list[int]) -> int:
    """raw_data bytes for ``data_type`` x ``dims`` as varint values, or -1 (never equal to a length)
    for anything the screen leaves to the loader: an unknown or STRING type, a negative or huge dim."""
    if not 0 < data_type < 1 << 31 or any(not 0 <= d < 1 << 63 for d in dims):
        return -1
    try:
        return byte_size(data_type, dims)
    except OrtmemError:
        return -1


@record
class ExternalizeResult:
    """The walk's result: ``skeleton`` is the rewritten ModelProto, or None when nothing was rewritten
    (the buffer is its own skeleton: the caller parses the file as it is, without a copy made here).
    This module's records are named tuples (as :class:`Field`), not dataclasses: the hook imports it
    into every hooked process, where dataclasses cost start time (``bench/hook_stages.py``)."""

    skeleton: Optional[bytes]
    spans: list[TensorSpan]
    screen: TensorScreen
    #: How many of ``spans`` lie outside the main graph's initializers and its nodes' attribute
    #: tensors (in a subgraph, a function, training info, a sparse tensor).
    outside_main: int = 0
    #: The walk stopped at the first of those (``stop_outside_main``): ``skeleton`` is None, and
    #: ``spans`` and ``screen`` cover only what came before it.
    stopped: bool = False

    @property
    def changed(self) -> bool:
        return self.skeleton is not None


#: Message nesting protobuf accepts (its default recursion limit, which both onnx's Python parser and
#: ORT use: measured with nested ``If`` subgraphs, 99 levels parse and 102 fail in both). The walk
#: visits a subset of the messages, so a model it finds deeper is refused by protobuf too; the
#: bound keeps the walk off Python's own stack limit.
MAX_NESTING = 100
#: An external tensor's message longer than this is left to the loader's check (a reference is a
#: name, a type, dims and a few entries: tens of bytes).
EXTERNAL_TENSOR_MAX_BYTES = 64 * 1024
#: The message kinds above a tensor of the main graph: an initializer, or a node's attribute tensor.
_MAIN_GRAPH_PARENTS = (["model", "graph"], ["model", "graph", "node", "attribute"])


class _OutsideMainGraph(Exception):
    """Raised inside the walk at the first tensor it would externalize outside the main graph, when
    asked to stop there (:func:`externalize_embedded`)."""


class _Externalizer:
    """Rewrites a serialized ModelProto, moving large embedded raw_data to external references."""

    def __init__(self, buf, file: str, location: str, inline_max_bytes: int, stop_outside_main: bool = False,
                 references: Optional[Any] = None):
        self.r = WireReader(buf, file)
        self.buf = buf
        self.location = location
        self.inline_max_bytes = inline_max_bytes
        self.spans: list[TensorSpan] = []
        self.screen = TensorScreen(references)
        # What every externalized tensor gains first: data_location=EXTERNAL and its location entry.
        self.external_location = (_key(TENSOR_DATA_LOCATION, VARINT) + encode_varint(DATA_LOCATION_EXTERNAL)
                                  + encode_string_entry(TENSOR_EXTERNAL_DATA, "location", location))
        self.offset_key = encode_len_field(1, b"offset")  # the key half of an external_data entry
        self.length_key = encode_len_field(1, b"length")
        self.depth = 0
        self.kinds: list[str] = []  # the message kinds from the model down to the one being walked
        self.outside_main = 0
        self.stop_outside_main = stop_outside_main
        # Which child messages of each message kind can contain tensors, and their kind.
        self.children: dict[str, dict[int, Callable[[int, int], Optional[bytes]]]] = {
            "model": {MODEL_GRAPH: self.graph, MODEL_TRAINING_INFO: self.training, MODEL_FUNCTIONS: self.function},
            "training": {TRAINING_INITIALIZATION: self.graph, TRAINING_ALGORITHM: self.graph},
            "function": {FUNCTION_NODE: self.node},
            "graph": {GRAPH_NODE: self.node, GRAPH_INITIALIZER: self.tensor, GRAPH_SPARSE_INITIALIZER: self.sparse},
            "node": {NODE_ATTRIBUTE: self.attribute},
            "attribute": {
                ATTR_T: self.tensor,
                ATTR_G: self.graph,
                ATTR_TENSORS: self.tensor,
                ATTR_GRAPHS: self.graph,
                ATTR_SPARSE_TENSOR: self.sparse,
                ATTR_SPARSE_TENSORS: self.sparse,
            },
            "sparse": {SPARSE_VALUES: self.tensor, SPARSE_INDICES: self.tensor},
        }
        self.actions = {kind: FieldActions(handlers, {n for n, h in handlers.items() if h == self.tensor})
                        for kind, handlers in self.children.items()}

    def message(self, kind: str, start: int, end: int) -> Optional[bytes]:
        """Return the rewritten message, or None when it is unchanged (the caller copies the slice)."""
        self.depth += 1
        self.kinds.append(kind)
        try:
            if self.depth > MAX_NESTING:
                raise CorruptModelError(f"messages nested deeper than protobuf's limit of {MAX_NESTING}",
                                        file=self.r.file)
            return self._message(kind, start, end)
        finally:
            self.depth -= 1
            self.kinds.pop()

    def _message(self, kind: str, start: int, end: int) -> Optional[bytes]:
        handlers = self.children[kind]
        pieces: list[bytes] = []
        copy_from = start  # start of the run of fields copied verbatim
        # A tensor message no longer than inline_max_bytes cannot hold raw_data worth externalizing:
        # the scan screens it in place (see TensorScreen) instead of yielding it to self.tensor.
        fields = self.r.scan(start, end, self.actions[kind], screen=self.screen, short=self.inline_max_bytes)
        for number, field_start, payload_start, field_end in fields:
            new = handlers[number](payload_start, field_end)
            if new is None:
                continue
            pieces.append(bytes(self.buf[copy_from:field_start]))
            pieces.append(encode_len_field(number, new))
            copy_from = field_end
        if not pieces:
            return None
        pieces.append(bytes(self.buf[copy_from:end]))
        return b"".join(pieces)

    def model(self, start: int, end: int) -> Optional[bytes]:
        return self.message("model", start, end)

    def graph(self, start: int, end: int) -> Optional[bytes]:
        return self.message("graph", start, end)

    def training(self, start: int, end: int) -> Optional[bytes]:
        return self.message("training", start, end)

    def function(self, start: int, end: int) -> Optional[bytes]:
        return self.message("function", start, end)

    def node(self, start: int, end: int) -> Optional[bytes]:
        return self.message("node", start, end)

    def attribute(self, start: int, end: int) -> Optional[bytes]:
        return self.message("attribute", start, end)

    def sparse(self, start: int, end: int) -> Optional[bytes]:
        return self.message("sparse", start, end)

    def tensor(self, start: int, end: int) -> Optional[bytes]:
        raws: list[Field] = []  # every raw_data field: protobuf keeps the last, so must we
        name: Optional[Field] = None
        data_type = 0
        dims: list[int] = []
        external = False
        for f in self.r.fields(start, end):
            if f.number == TENSOR_RAW_DATA and f.wire_type == LEN:
                raws.append(f)
            elif f.number == TENSOR_NAME and f.wire_type == LEN:
                name = f
            elif f.number == TENSOR_DATA_TYPE and f.wire_type == VARINT:
                data_type = f.value
            elif f.number == TENSOR_DIMS:
                read_dims(self.r, f, dims)
            elif f.number == TENSOR_DATA_LOCATION and f.wire_type == VARINT:
                external = f.value == DATA_LOCATION_EXTERNAL
                if f.value > DATA_LOCATION_EXTERNAL:
                    self.screen.unconfirmed += 1  # not a DataLocation: the loader judges what protobuf kept
        if external:
            self.screen.external_tensor(self.buf, start, end)
            return None
        length = raws[-1].value if raws else 0
        if length <= self.inline_max_bytes:
            if raws:
                self.screen.inline(data_type, dims, length)
            return None
        if self.kinds not in _MAIN_GRAPH_PARENTS:
            if self.stop_outside_main:
                raise _OutsideMainGraph
            self.outside_main += 1
        offset = raws[-1].payload_start
        self.spans.append(TensorSpan(self.r.string(name) if name else "", data_type, dims, offset, length))
        kept_parts, pos = [], start
        for f in raws:  # every occurrence goes: an earlier one left beside EXTERNAL is an invalid tensor
            kept_parts.append(bytes(self.buf[pos : f.start]))
            pos = f.end
        kept_parts.append(bytes(self.buf[pos:end]))
        kept_parts.append(self.external_location)
        kept_parts.append(encode_len_field(TENSOR_EXTERNAL_DATA, self.offset_key + encode_len_field(2, str(offset).encode())))
        kept_parts.append(encode_len_field(TENSOR_EXTERNAL_DATA, self.length_key + encode_len_field(2, str(length).encode())))
        return b"".join(kept_parts)


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def read_dims(r: WireReader, f: Field, dims: list[int]) -> None:
    """Append the dims of a TensorProto's field 1, one varint or a packed run, as signed int64."""
    if f.wire_type == VARINT:
        dims.append(_signed64(f.value))
    elif f.wire_type == LEN:  # packed repeated int64
        p = f.payload_start
        while p < f.end:
            v, p = r.varint(p, f.end)
            dims.append(_signed64(v))


def externalize_embedded(buf, *, file: str, location: str, inline_max_bytes: int = 1023,
                         stop_outside_main: bool = False, references: Optional[Any] = None) -> ExternalizeResult:
    """Rewrite the ModelProto in ``buf`` so every embedded raw_data above ``inline_max_bytes`` becomes
    an external-data reference (``location``, absolute offset in ``buf``, length).

    ``buf`` is normally a :class:`FileBytes` over the whole file: only the non-weight bytes are read.
    Raises :class:`CorruptModelError` naming ``file`` when the bytes are not a well-formed protobuf.
    ``stop_outside_main``: stop at the first such raw_data outside the main graph (the result says
    ``stopped``), for a caller whose decision that one settles: the hook, given the caller's options,
    leaves such a model to ORT, and stopping at the first of silero-vad's ``If`` branch weights walks
    10 of its 1278 messages. ``references``: given every tensor marked EXTERNAL the walk meets
    (:class:`ortmem.onnxfile.references.ExternalReferences`).
    """
    ex = _Externalizer(buf, file, location, inline_max_bytes, stop_outside_main, references)
    try:
        skeleton = ex.model(0, len(buf))
    except _OutsideMainGraph:
        return ExternalizeResult(None, ex.spans, ex.screen, outside_main=1, stopped=True)
    return ExternalizeResult(skeleton, ex.spans, ex.screen, outside_main=ex.outside_main)
