"""What ortmem needs to know about ONNX tensor element types.

ONNX stores sub-byte types (int4, uint4, int2, uint2, float4) packed, two or four elements a byte,
low bits first. The byte length of a tensor is therefore ``ceil(numel * bits / 8)``, not
``numel * itemsize``; every size check in ortmem goes through :func:`byte_size`.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from ortmem.base.records import record
from ortmem.errors import UnsupportedDtypeError


#: The numpy scalar type of each ORT value type string (``NodeArg.type``) a feed can have.
ORT_NUMPY_TYPES: dict[str, Any] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint64)": np.uint64,
    "tensor(uint32)": np.uint32,
    "tensor(uint16)": np.uint16,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
    "tensor(string)": np.str_,
}


@record
class DtypeInfo:
    """An ONNX element type as ortmem handles it (a named tuple: the hook imports this module into every
    hooked process, where dataclasses cost start time)."""

    onnx_type: int
    name: str
    bits: int
    numpy: np.dtype  # storage dtype of one *byte-addressable* element (uint8 for packed types)

    @property
    def packed(self) -> bool:
        return self.bits < 8


def _info(code: int, name: str, bits: int, np_dtype) -> DtypeInfo:
    return DtypeInfo(code, name, bits, np.dtype(np_dtype))


#: Keyed by ``TensorProto.DataType`` numbers (fixed by onnx.proto), written as numbers so that the
#: wire reader (:mod:`ortmem.onnxfile.protowire`) and the hook's decision from a file's bytes need no onnx import.
_TABLE: dict[int, DtypeInfo] = {
    i.onnx_type: i
    for i in (
        _info(1, "float32", 32, np.float32),
        _info(2, "uint8", 8, np.uint8),
        _info(3, "int8", 8, np.int8),
        _info(4, "uint16", 16, np.uint16),
        _info(5, "int16", 16, np.int16),
        _info(6, "int32", 32, np.int32),
        _info(7, "int64", 64, np.int64),
        _info(9, "bool", 8, np.bool_),
        _info(10, "float16", 16, np.float16),
        _info(11, "float64", 64, np.float64),
        _info(12, "uint32", 32, np.uint32),
        _info(13, "uint64", 64, np.uint64),
        _info(14, "complex64", 64, np.complex64),
        _info(15, "complex128", 128, np.complex128),
        # bfloat16 and float8 have no numpy dtype: their bytes are exposed as unsigned integers
        _info(16, "bfloat16", 16, np.uint16),
        _info(17, "float8e4m3fn", 8, np.uint8),
        _info(18, "float8e4m3fnuz", 8, np.uint8),
        _info(19, "float8e5m2", 8, np.uint8),
        _info(20, "float8e5m2fnuz", 8, np.uint8),
        _info(21, "uint4", 4, np.uint8),
        _info(22, "int4", 4, np.uint8),
        _info(23, "float4e2m1", 4, np.uint8),
        _info(24, "float8e8m0", 8, np.uint8),
        _info(25, "uint2", 2, np.uint8),
        _info(26, "int2", 2, np.uint8),
    )
}


def dtype_info(onnx_type: int, *, tensor: str | None = None, file: str | None = None) -> DtypeInfo:
    """Look up an ONNX element type; unknown types (including STRING, which has no fixed size) raise."""
    try:
        return _TABLE[onnx_type]
    except KeyError:
        raise UnsupportedDtypeError(
            f"unsupported tensor data type {onnx_type} ({_onnx_name(onnx_type)})", tensor=tensor, file=file
        ) from None


def _onnx_name(onnx_type: int) -> str:
    from onnx import TensorProto  # only to name an unsupported type in an error (see _TABLE)

    try:
        return TensorProto.DataType.Name(onnx_type)
    except ValueError:
        return "unknown"


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def byte_size(onnx_type: int, shape: Sequence[int], *, tensor: str | None = None, file: str | None = None) -> int:
    """Bytes a tensor of this type and shape occupies in raw_data / external data (packed for sub-byte)."""
    info = dtype_info(onnx_type, tensor=tensor, file=file)
    return (numel(shape) * info.bits + 7) // 8
