"""Blockwise-quantized DequantizeLinear weights -> com.microsoft MatMulNBits inputs, in numpy.

Why this exists
---------------
ONNX Runtime fuses ``DequantizeLinear(W) -> MatMul`` into ``MatMulNBits`` itself
(``DQMatMulToMatMulNBits``, onnxruntime/core/optimizer/qdq_transformer/selectors_actions/qdq_actions.cc),
but it does so inside session creation: it copies every weight out of the proto (``Initializer``),
transposes it with ``MlasQDQTransposeBlockwiseQuantized`` (onnxruntime/core/mlas/lib/q4_dq.cpp) and keeps
the old and the new weights alive together. Doing the same transposition *ahead of time*, streaming,
into buffers the caller owns (an mmapped output file, a pre-sized arena), removes that peak. These
kernels therefore write into preallocated outputs and bound their own scratch memory.

Layouts (the contract, checked byte for byte against ORT 1.31.1 in tests/passes/nbits/test_packing.py)
-----------------------------------------------------------------------------------------------
* Input ``W``: the DQ weight, logical shape ``[K, N]``, element type int2/uint2/int4/uint4/int8/uint8.
  Sub-byte types are packed ``8/bits`` elements per byte, low bits first, in row-major order over
  ``[K, N]`` (ONNX ``raw_data`` layout). Scales ``[ceil(K/bs), N]``; optional zero points same shape
  and element type as ``W``, packed likewise. ``axis=0``, ``block_size=bs``.
* Output ``B``: uint8 ``[N, k_blocks, bs*bits/8]``: for column ``n`` the codes run along K inside a
  block, low bits first; the tail block is padded (docs/ContribOperators.md, MatMulNBits).
* Output ``scales``: ``[N, k_blocks]``, same float dtype (ORT's fusion emits it flattened to
  ``[N*k_blocks]``; the CPU kernel accepts both).
* Output ``zero_points``: uint8 ``[N, ceil(k_blocks*bits/8)]``, packed along k_blocks, low bits first.

MatMulNBits only knows *unsigned* codes and its default zero point is ``2**(bits-1)``
(onnxruntime/contrib_ops/cpu/quantization/matmul_nbits.cc). Hence:

* signed weights become ``q + 2**(bits-1)``; MLAS does it as ``(q & mask) ^ 2**(bits-1)`` on the
  packed lanes, which is the same number for every two's-complement ``q``; with no DQ zero point no
  zero-point input is emitted (the default, ``2**(bits-1)``, is exactly the re-bias);
* a signed DQ zero point is re-biased identically (``z ^ 2**(bits-1)``), so ``q - z`` is unchanged;
* unsigned weights without a DQ zero point need an explicit all-zero zero-point tensor
  (ORT's fusion adds ``fused_DQ_MatMul_zero_point_T`` filled with 0).

Padding, which never reaches a result (the kernels ignore k >= K) but which we reproduce so that our
output is byte-identical to ORT's own fusion: unsigned pads with code 0. Signed pads with code
``2**(bits-1)`` (MLAS XORs the zero it pads with) in these places: 8-bit and 2-bit, every padded code
of the tail block; 4-bit, only the nibble that shares a byte with the last real element (the rest
of the block stays 0 from ORT's memset). For zero points, signed 4-bit pads the odd nibble with 8,
signed 2-bit pads with 0.

Per-tensor and per-channel DQ weights are expanded to blocks first (:func:`expand_to_blocks`), as
``TransposeDQWeightsForMatMulNBits`` does, with the block size from
``session.qdq_matmulnbits_block_size`` (:func:`ortmem.passes.rules.dq_matmul_checks.effective_block_size`).

The byte transpose these kernels share, and how it is made fast, is :mod:`.transpose`; the
oracles the tests compare them with, and a benchmark, are :mod:`.reference`.

Known ORT defect
----------------
ORT 1.31.1's own fusion scrambles 2-bit weights when ``N % 4 != 0`` (its fused model's outputs differ
from the unfused DQ+MatMul by O(1); pinned by ``test_ort_2bit_fusion_bug_documented``). These kernels
follow the MatMulNBits spec there, so "identical to ORT's fusion" holds for 2-bit only when ``N % 4 == 0``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortmem.base.records import record
from ortmem.errors import ConversionError, TensorShapeError
from ortmem.passes.nbits.transpose import STRIP_ROWS, transpose_pack, view_as, xor_byte

__all__ = [
    "SUPPORTED_BITS",
    "DEFAULT_MAX_SCRATCH_BYTES",
    "NBitsShapes",
    "MatMulNBitsWeights",
    "matmulnbits_shapes",
    "pack_codes",
    "unpack_codes",
    "pack_B",
    "transpose_scales",
    "pack_zero_points",
    "convert_dq_weights",
    "dq_to_matmulnbits",
    "expand_to_blocks",
    "needs_zero_points",
]

SUPPORTED_BITS = (2, 4, 8)
#: Default cap on scratch memory a single kernel call allocates (inputs/outputs not counted).
DEFAULT_MAX_SCRATCH_BYTES = 32 * 1024 * 1024


# ----------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class NBitsShapes:
    """Shapes and byte sizes of the MatMulNBits inputs for one ``[K, N]`` weight."""

    K: int
    N: int
    bits: int
    block_size: int
    k_blocks: int
    blob_size: int
    B: tuple[int, int, int]
    scales: tuple[int, int]
    zero_points: tuple[int, int] | None

    @property
    def B_nbytes(self) -> int:
        return self.B[0] * self.B[1] * self.B[2]

    def scales_nbytes(self, dtype: np.dtype | type | str = np.float32) -> int:
        return self.scales[0] * self.scales[1] * np.dtype(dtype).itemsize

    @property
    def zero_points_nbytes(self) -> int:
        return 0 if self.zero_points is None else self.zero_points[0] * self.zero_points[1]


def _check_bits_bs(bits: int, block_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ConversionError(f"MatMulNBits supports bits 2, 4, 8, not {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        # MatMulNBits' schema: any power of two >= 16. Which of them the installed ORT fuses and runs
        # identically is the release's business (ortmem.ort.release: 16..256 up to 1.31, more on 1.32).
        raise ConversionError(f"block_size must be a power of two >= 16, not {block_size}")


def matmulnbits_shapes(K: int, N: int, bits: int, block_size: int, has_zp: bool) -> NBitsShapes:
    """Output shapes for a ``[K, N]`` weight. ``has_zp``: whether a zero-point input is emitted
    (a DQ zero point was given, or the weight is unsigned; see :func:`needs_zero_points`)."""
    _check_bits_bs(bits, block_size)
    if K <= 0 or N <= 0:
        raise TensorShapeError(f"K and N must be positive, got K={K} N={N}")
    k_blocks = -(-K // block_size)
    blob = block_size * bits // 8
    zp = (N, -(-k_blocks * bits // 8)) if has_zp else None
    return NBitsShapes(K, N, bits, block_size, k_blocks, blob, (N, k_blocks, blob), (N, k_blocks), zp)


def needs_zero_points(signed: bool, has_dq_zero_point: bool) -> bool:
    """MatMulNBits needs a zero-point input unless the weight is signed with an implicit 0 zero point."""
    return has_dq_zero_point or not signed


# ------------------------------------------------------------------------------------- packing helpers
def _as_bytes(a: np.ndarray | bytes | bytearray | memoryview, what: str, nbytes: int) -> np.ndarray:
    """A flat uint8 view of ``a`` (no copy for contiguous arrays, memmaps and buffers)."""
    if not isinstance(a, np.ndarray):
        a = np.frombuffer(a, dtype=np.uint8)
    if a.dtype not in (np.uint8, np.int8):
        raise TensorShapeError(f"{what}: expected packed bytes (uint8/int8), got dtype {a.dtype}")
    if a.dtype != np.uint8:
        a = a.view(np.uint8)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    a = a.reshape(-1)
    if a.size != nbytes:
        raise TensorShapeError(f"{what}: expected {nbytes} bytes, got {a.size}")
    return a


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer codes (any int dtype, signed values are taken two's complement) into ONNX's
    sub-byte layout: flattened row-major, ``8/bits`` per byte, low bits first. Returns uint8 bytes."""
    if bits not in SUPPORTED_BITS:
        raise ConversionError(f"bits must be 2, 4 or 8, not {bits}")
    flat = np.asarray(codes).reshape(-1).astype(np.uint8, casting="unsafe")
    if bits == 8:
        return flat.copy()
    per = 8 // bits
    mask = (1 << bits) - 1
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    lanes = flat.reshape(-1, per) & mask
    out = lanes[:, 0].copy()
    for i in range(1, per):
        out |= lanes[:, i] << (bits * i)
    return out


def unpack_codes(packed: np.ndarray, count: int, bits: int, signed: bool = False) -> np.ndarray:
    """Inverse of :func:`pack_codes`: the first ``count`` codes, int8 (sign-extended) or uint8."""
    if bits not in SUPPORTED_BITS:
        raise ConversionError(f"bits must be 2, 4 or 8, not {bits}")
    b = _as_bytes(packed, "packed codes", -(-count * bits // 8))
    if bits == 8:
        u = b.copy()
    else:
        per = 8 // bits
        shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
        u = ((b[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)[:count]
    if not signed:
        return u
    # sign-extend: shift the code to the top of the byte, then arithmetic shift back
    return (u << (8 - bits)).view(np.int8) >> (8 - bits)


# ------------------------------------------------------------------------------------------ kernels
def pack_B(
    w: np.ndarray,
    K: int,
    N: int,
    bits: int,
    signed: bool,
    block_size: int,
    *,
    out: np.ndarray,
    max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES,
) -> np.ndarray:
    """Write MatMulNBits ``B`` (uint8 ``[N, k_blocks, block_size*bits/8]``) for DQ weight ``w`` into ``out``.

    ``w``: the packed ONNX bytes of the ``[K, N]`` weight (any uint8/int8 array or buffer with
    ``ceil(K*N*bits/8)`` bytes, e.g. a memmap of external data; not modified). Scratch memory is at
    most about ``max_scratch_bytes`` whatever the tensor size. Signed codes are re-biased by
    ``2**(bits-1)``; the tail block is padded as ORT's fusion pads it (see module docstring).
    """
    shp = matmulnbits_shapes(K, N, bits, block_size, False)
    src = _as_bytes(w, "weight", -(-K * N * bits // 8))
    _check_out(out, shp.B, np.uint8, "B")
    out2 = view_as(out, (N, shp.k_blocks * shp.blob_size))
    per = 8 // bits
    transpose_pack(src, K, N, bits, signed, out2, pad_mid=True, max_scratch_bytes=max_scratch_bytes)
    first_pad = -(-K // per)
    if first_pad < out2.shape[1]:
        # Whole padding bytes of the tail block: ORT's memset(0), then MLAS writes XORed zeros for
        # signed 8-bit and 2-bit (observed with ORT 1.31.1); 4-bit leaves them 0.
        fill = xor_byte(bits) if (signed and bits in (2, 8)) else 0
        out2[:, first_pad:] = fill
    return out


def transpose_scales(scales: np.ndarray, K: int, N: int, block_size: int, *, out: np.ndarray) -> np.ndarray:
    """``[k_blocks, N]`` -> ``out`` ``[N, k_blocks]`` (or flat ``[N*k_blocks]``), same dtype, no scratch."""
    kb = -(-K // block_size)
    scales = np.asarray(scales)
    if scales.shape != (kb, N):
        raise TensorShapeError(f"scales: expected shape {(kb, N)}, got {scales.shape}")
    if out.dtype != scales.dtype or out.size != kb * N or not out.flags.c_contiguous:
        raise TensorShapeError(f"scales out: expected a contiguous {scales.dtype} buffer of {kb * N} "
                               f"elements, got {out.dtype} {out.shape}")
    o2 = view_as(out, (N, kb))
    # strip transpose: rows of [kb, N] are N wide; 8 at a time keeps it cache friendly
    for i in range(0, kb, STRIP_ROWS):
        o2[:, i : i + STRIP_ROWS] = scales[i : i + STRIP_ROWS].T
    return out


def pack_zero_points(
    zero_points: np.ndarray | None,
    K: int,
    N: int,
    bits: int,
    signed: bool,
    block_size: int,
    *,
    out: np.ndarray,
    max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES,
) -> np.ndarray:
    """Write MatMulNBits zero points (uint8 ``[N, ceil(k_blocks*bits/8)]``) into ``out``.

    ``zero_points``: packed ONNX bytes of the ``[k_blocks, N]`` DQ zero point, or None for an unsigned
    weight without one (ORT then emits all zeros, since MatMulNBits would otherwise assume
    ``2**(bits-1)``). Signed zero points are re-biased like the weights.
    """
    shp = matmulnbits_shapes(K, N, bits, block_size, True)
    _check_out(out, shp.zero_points, np.uint8, "zero_points")
    if zero_points is None:
        if signed:
            raise ConversionError("a signed weight without zero point needs no zero-point input")
        out[...] = 0
        return out
    kb = shp.k_blocks
    src = _as_bytes(zero_points, "zero_points", -(-kb * N * bits // 8))
    # pad_mid: 4-bit signed pads the odd nibble with 8 (MLAS Pack<true>(v, 0)); 2-bit pads with 0.
    transpose_pack(src, kb, N, bits, signed, view_as(out, (N, shp.zero_points[1])), pad_mid=(bits == 4),
                    max_scratch_bytes=max_scratch_bytes)
    return out


def _check_out(out: np.ndarray, shape: tuple[int, ...], dtype, what: str) -> None:
    if not isinstance(out, np.ndarray) or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous \
            or out.size != int(np.prod(shape)) or not out.flags.writeable:
        raise TensorShapeError(f"{what} out: expected a writeable C-contiguous {np.dtype(dtype)} buffer of "
                               f"shape {shape}, got {getattr(out, 'dtype', type(out))} "
                               f"{getattr(out, 'shape', '')}")


@record
class MatMulNBitsWeights:
    """The three MatMulNBits weight inputs; ``zero_points`` is None when none is needed."""

    B: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None


def convert_dq_weights(
    w: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    K: int,
    N: int,
    bits: int,
    signed: bool,
    block_size: int,
    out_B: np.ndarray,
    out_scales: np.ndarray,
    out_zero_points: np.ndarray | None,
    max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES,
) -> MatMulNBitsWeights:
    """All three outputs into caller-owned buffers. ``out_zero_points`` must be given exactly when
    :func:`needs_zero_points` says so (shape from :func:`matmulnbits_shapes`)."""
    need = needs_zero_points(signed, zero_points is not None)
    if need != (out_zero_points is not None):
        raise ConversionError("out_zero_points must be given iff a zero-point input is needed "
                              f"(signed={signed}, has DQ zero point={zero_points is not None})")
    pack_B(w, K, N, bits, signed, block_size, out=out_B, max_scratch_bytes=max_scratch_bytes)
    transpose_scales(scales, K, N, block_size, out=out_scales)
    if out_zero_points is not None:
        pack_zero_points(zero_points, K, N, bits, signed, block_size, out=out_zero_points,
                         max_scratch_bytes=max_scratch_bytes)
    return MatMulNBitsWeights(out_B, out_scales, out_zero_points)


def dq_to_matmulnbits(
    w: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    K: int,
    N: int,
    bits: int,
    signed: bool,
    block_size: int,
) -> MatMulNBitsWeights:
    """Allocating convenience around :func:`convert_dq_weights` (tests, small tensors)."""
    scales = np.asarray(scales)
    shp = matmulnbits_shapes(K, N, bits, block_size, needs_zero_points(signed, zero_points is not None))
    B = np.empty(shp.B, np.uint8)
    s = np.empty(shp.scales, scales.dtype)
    z = np.empty(shp.zero_points, np.uint8) if shp.zero_points else None
    return convert_dq_weights(w, scales, zero_points, K=K, N=N, bits=bits, signed=signed,
                              block_size=block_size, out_B=B, out_scales=s, out_zero_points=z)


def expand_to_blocks(
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-tensor (scalar) or per-channel (``[N]``, DQ axis=1) scale/zero point -> blockwise
    ``[ceil(K/bs), N]`` scales and packed zero-point bytes, as ``TransposeDQWeightsForMatMulNBits``
    expands them before transposing (raw zero-point lanes are copied, re-biasing happens later)."""
    scales = np.asarray(scales)
    kb = -(-K // block_size)
    if scales.size not in (1, N) or scales.ndim > 1:
        raise TensorShapeError(f"expected a scalar or [N]={N} scale, got shape {scales.shape}")
    s = np.broadcast_to(scales.reshape(-1), (kb, N)).copy() if scales.size == N else \
        np.full((kb, N), scales.reshape(-1)[0], scales.dtype)
    if zero_points is None:
        return s, None
    z = np.asarray(zero_points)
    n_z = 1 if scales.size == 1 else N
    codes = unpack_codes(z.view(np.uint8) if z.dtype.itemsize == 1 else z, n_z, bits)
    codes = np.broadcast_to(codes.reshape(-1), (kb, N)) if n_z == N else np.full((kb, N), codes[0], np.uint8)
    return s, pack_codes(codes, bits)
