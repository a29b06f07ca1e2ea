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

Layouts (the contract, checked byte for byte against ORT 1.31.1 in tests/test_nbits_layout.py)
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
``session.qdq_matmulnbits_block_size`` (:func:`ortmem.passes.dq_matmul_match.effective_block_size`).

Speed
-----
Everything is whole-array numpy over cache-sized tiles (2 MiB of scratch per call on the fast path). The
expensive step is a byte transpose ``[K, N/p] -> [N/p, K]`` (p = 8/bits), done as "gather 8 rows into
uint64 words, then transpose uint64 words in strips" (see :func:`_tile_transpose`). The lane shuffle that
turns "p columns x p rows" bytes into "p rows x p columns" bytes is a SWAR transpose on uint16 (4-bit) or
uint32 (2-bit) words: one or two masked XOR-swaps per word instead of any per-element unpacking; the
signed re-bias is one XOR per word. Measured on the shared 2-core dev box, 4096x4096 int4: ~5.5-7 ms,
1.2-1.5 GB/s of input (about half byte transpose, half shuffle and copy-out); measure with
``python -c "from ortmem.passes.nbits_layout import benchmark_pack_B as b; print(b(4096, 4096, 4))"``.
Sizes whose rows are not byte aligned (``N*bits % 8 != 0``) take a slower generic path that unpacks
codes one byte each.

Known ORT defect
----------------
ORT 1.31.1's own fusion scrambles 2-bit weights when ``N % 4 != 0`` (its fused model's outputs differ
from the unfused DQ+MatMul by O(1); pinned by ``test_ort_2bit_fusion_bug_documented``). These kernels
follow the MatMulNBits spec there, so "identical to ORT's fusion" holds for 2-bit only when ``N % 4 == 0``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import ConversionError, TensorShapeError

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
    "dequantize_dq_reference",
    "dequantize_matmulnbits_reference",
    "needs_zero_points",
    "benchmark_pack_B",
]

SUPPORTED_BITS = (2, 4, 8)
#: Default cap on scratch memory a single kernel call allocates (inputs/outputs not counted).
DEFAULT_MAX_SCRATCH_BYTES = 32 * 1024 * 1024
#: Source rows per strip of the byte transpose; 8 measured fastest (fits L1 with N/p columns).
_STRIP_ROWS = 8
#: Scratch of one tile of the fast path (gathered words + transposed tile + SWAR temporary). Measured
#: on 4096x4096 int4: 256 KiB 8 ms, 512 KiB 7 ms, 2 MiB 5.5-6 ms, 4 MiB 5.5-6 ms (fewer numpy calls per
#: byte vs. cache residency); 2 MiB keeps the tile in L2/L3.
_TILE_BYTES = 2 * 1024 * 1024
_TILE_MIN_ROWS = 256


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
        # identically is the release's business (ortmem.ortmodel.release: 16..256 up to 1.31, more on 1.32).
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


def _xor_byte(bits: int) -> int:
    """Byte that flips the top bit of every lane: turns two's-complement lanes into offset binary."""
    return {2: 0xAA, 4: 0x88, 8: 0x80}[bits]


def _strip_transpose(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src.T`` for 2-D byte arrays, in strips of 8 source rows.

    A plain ``np.copyto(dst, src.T)`` on uint8 walks one of the two arrays with a stride of a full
    row per byte and runs at ~0.15 GB/s here; strips of 8 source rows keep the 8 source rows and the
    destination lines in L1 and run ~10x faster (measured 4096x2048 bytes: 54 ms -> 4.9 ms).
    """
    rows = src.shape[0]
    for i in range(0, rows, _STRIP_ROWS):
        j = min(i + _STRIP_ROWS, rows)
        dst[:, i:j] = src[i:j].T


# ------------------------------------------------------------------------------- core transpose-pack
def _transpose_pack(
    src: np.ndarray,
    R: int,
    N: int,
    bits: int,
    signed: bool,
    out2: np.ndarray,
    *,
    pad_mid: bool,
    max_scratch_bytes: int,
) -> None:
    """Core of pack_B / pack_zero_points.

    ``src``: flat packed bytes of a row-major ``[R, N]`` ``bits``-bit matrix. ``out2``: uint8
    ``[N, >= ceil(R*bits/8)]``; row n receives column n's codes along R, low bits first. Signed codes
    are re-biased (XOR with the lane's top bit). Rows R..ceil(R/p)*p-1 of the last partial byte are
    padded with raw 0, re-biased too when ``pad_mid`` (signed only). Bytes beyond are left untouched.
    """
    per = 8 // bits
    xor = _xor_byte(bits) if signed else 0
    budget = max(int(max_scratch_bytes), 4096)
    if (N * bits) % 8 == 0:
        C = N * bits // 8  # bytes per source row
        src2 = src.reshape(R, C)
        # Work in cache-sized tiles: a tile needs X and T (the transposed tile) and a same-size
        # temporary for the SWAR shuffle, allocated once per call and reused (fresh 8 MiB temporaries
        # per call cost page faults and cache misses: one big pass measured ~2x slower).
        work = min(budget, _TILE_BYTES)
        col_chunk = min(C, max(64, work // (3 * _TILE_MIN_ROWS) // 64 * 64))
        rows_chunk = max(64, work // (3 * col_chunk) // 64 * 64)
        rows_chunk = min(rows_chunk, -(-R // 8) * 8)
        scratch = np.empty(3 * col_chunk * rows_chunk, np.uint8)
        for c0 in range(0, C, col_chunk):
            c1 = min(C, c0 + col_chunk)
            for r0 in range(0, R, rows_chunk):
                r1 = min(R, r0 + rows_chunk)
                _fast_chunk(src2, r0, r1, c0, c1, bits, xor, out2, pad_mid, scratch)
    else:
        # Rows are not byte aligned: unpack codes (1 byte each). Chunks start at multiples of 8 rows, so
        # at bit offset r0*N*bits, which is a whole byte.
        n_chunk = N if N * _STRIP_ROWS * 4 <= budget else max(1, budget // (4 * _STRIP_ROWS))
        rows_chunk = max(_STRIP_ROWS, (budget // (4 * N)) // _STRIP_ROWS * _STRIP_ROWS)
        mask = np.uint8((1 << bits) - 1)
        shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
        for r0 in range(0, R, rows_chunk):
            r1 = min(R, r0 + rows_chunk)
            b0, b1 = r0 * N * bits // 8, -(-r1 * N * bits // 8)
            codes = ((src[b0:b1, None] >> shifts) & mask).reshape(-1)[: (r1 - r0) * N].reshape(r1 - r0, N)
            rp = -(-(r1 - r0) // per) * per
            for n0 in range(0, N, n_chunk):
                n1 = min(N, n0 + n_chunk)
                T = np.zeros((n1 - n0, rp), np.uint8)
                _strip_transpose(T[:, : r1 - r0], codes[:, n0:n1])
                if xor:
                    T[:, : (rp if pad_mid else r1 - r0)] ^= np.uint8((1 << bits) >> 1)
                lanes = T.reshape(n1 - n0, rp // per, per)
                packed = lanes[:, :, 0].copy()
                for i in range(1, per):
                    packed |= lanes[:, :, i] << np.uint8(bits * i)
                out2[n0:n1, r0 // per : r0 // per + rp // per] = packed


def _tile_transpose(T: np.ndarray, src: np.ndarray, X: np.ndarray) -> None:
    """``T[:, :nr] = src.T`` for a byte tile ``src`` ``[nr, cc]``; ``T`` is ``[cc, w]`` with ``w`` a
    multiple of 8 >= nr; rows nr..w of the transposed tile (``T[:, nr:]``) become 0.

    Two steps that numpy does fast, instead of one byte-granular transpose (which it does slowly):
    gather each group of 8 source rows into uint64 words (``X[g, c]`` = bytes of rows 8g..8g+7 in
    column c: 8 strided byte copies), then transpose the uint64 matrix ``X`` in strips of 8 rows, so
    every destination write is a whole 64-byte line. Measured on 4096x2048 bytes: 4 ms, against
    10 ms for strips of 8 byte rows and 54 ms for ``np.copyto(dst, src.T)``.
    """
    nr, cc = src.shape
    g = T.shape[1] // 8
    full = nr // 8
    xv = _view_as(X[: g * cc * 8], (g, cc, 8))
    for r in range(8):
        xv[:full, :, r] = src[r : full * 8 : 8]
    if full < g:
        xv[full:] = 0
        for r in range(nr - full * 8):
            xv[full, :, r] = src[full * 8 + r]
    X64 = _view_as(X[: g * cc * 8].view(np.uint64), (g, cc))
    T64 = T.view(np.uint64)
    for i in range(0, g, 8):
        T64[:, i : i + 8] = X64[i : i + 8].T


def _delta_swap(V: np.ndarray, t: np.ndarray, shift: int, mask) -> None:
    """Swap the bit groups selected by ``mask`` with those ``shift`` bits above them, in place, in
    every word of ``V`` (``t`` is same-shape scratch): the SWAR step of a lane transpose."""
    np.right_shift(V, shift, out=t)
    t ^= V
    t &= mask
    V ^= t
    t <<= shift
    V ^= t


def _fast_chunk(src2: np.ndarray, r0: int, r1: int, c0: int, c1: int, bits: int, xor: int,
                out2: np.ndarray, pad_mid: bool, scratch: np.ndarray) -> None:
    """Rows r0..r1 (r0 % 8 == 0), source byte columns c0..c1 -> out2 rows c0*p..c1*p."""
    per = 8 // bits
    nr = r1 - r0
    rp = -(-nr // per) * per  # rows padded to whole output bytes
    w = -(-nr // 8) * 8  # tile width: whole uint64 words
    cc = c1 - c0
    ob0, ob1 = r0 // per, r0 // per + rp // per
    n = cc * w
    T = _view_as(scratch[:n], (cc, w))
    tmp = scratch[n : 2 * n]
    _tile_transpose(T, src2[r0:r1, c0:c1], scratch[2 * n : 3 * n])
    if bits == 8:
        if xor:
            tx = T if pad_mid else T[:, :nr]
            tx ^= np.uint8(xor)
        out2[c0:c1, ob0:ob1] = T[:, :nr]
        return
    if xor and not pad_mid:
        # the XOR must not reach the padding rows: do it on the tile before the shuffle
        T[:, :nr] ^= np.uint8(xor)
        xor = 0
    out3 = _view_as(out2[c0 * per : c1 * per], (cc, per, out2.shape[1]))
    if bits == 4:
        # word = row 2j (low byte) | row 2j+1 (high byte); lanes: bits 0-3 col 2c, 4-7 col 2c+1.
        # Swap (row 2j, col 2c+1) <-> (row 2j+1, col 2c): then low byte = col 2c, high byte = col 2c+1.
        V = T.view(np.uint16)
        t = _view_as(tmp.view(np.uint16), V.shape)
        _delta_swap(V, t, 4, np.uint16(0x00F0))
        Vo = V[:, : ob1 - ob0]
        if xor:  # re-bias fused into the copy-out: both bytes of the word get 0x88
            Vo ^= np.uint16(xor * 0x101)
        np.copyto(out3[:, 0, ob0:ob1], Vo, casting="unsafe")  # uint16 -> uint8 keeps the low byte
        np.right_shift(Vo, 8, out=out3[:, 1, ob0:ob1], casting="unsafe")
    else:
        # 4x4 transpose of 2-bit lanes in a uint32 (byte r = row 4j+r, lane l = column 4c+l):
        # swap the off-diagonal 2x2 blocks (distance 12 bits), then the off-diagonal lanes (6 bits).
        V = T.view(np.uint32)
        t = _view_as(tmp.view(np.uint32), V.shape)
        _delta_swap(V, t, 12, np.uint32(0x0000F0F0))
        _delta_swap(V, t, 6, np.uint32(0x00CC00CC))
        Vo = V[:, : ob1 - ob0]
        if xor:
            Vo ^= np.uint32(xor * 0x01010101)
        np.copyto(out3[:, 0, ob0:ob1], Vo, casting="unsafe")
        for lane in range(1, 4):
            np.right_shift(Vo, 8 * lane, out=out3[:, lane, ob0:ob1], casting="unsafe")


def _view_as(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reshape that must not copy (we write through it); raises instead of silently copying."""
    v = a.view()
    v.shape = shape
    return v


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
    out2 = _view_as(out, (N, shp.k_blocks * shp.blob_size))
    per = 8 // bits
    _transpose_pack(src, K, N, bits, signed, out2, pad_mid=True, max_scratch_bytes=max_scratch_bytes)
    first_pad = -(-K // per)
    if first_pad < out2.shape[1]:
        # Whole padding bytes of the tail block: ORT's memset(0), then MLAS writes XORed zeros for
        # signed 8-bit and 2-bit (observed with ORT 1.31.1); 4-bit leaves them 0.
        fill = _xor_byte(bits) if (signed and bits in (2, 8)) else 0
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
    o2 = _view_as(out, (N, kb))
    # strip transpose: rows of [kb, N] are N wide; 8 at a time keeps it cache friendly
    for i in range(0, kb, _STRIP_ROWS):
        o2[:, i : i + _STRIP_ROWS] = scales[i : i + _STRIP_ROWS].T
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
    _transpose_pack(src, kb, N, bits, signed, _view_as(out, (N, shp.zero_points[1])), pad_mid=(bits == 4),
                    max_scratch_bytes=max_scratch_bytes)
    return out


def _check_out(out: np.ndarray, shape: tuple[int, ...], dtype, what: str) -> None:
    if not isinstance(out, np.ndarray) or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous \
            or out.size != int(np.prod(shape)) or not out.flags.writeable:
        raise TensorShapeError(f"{what} out: expected a writeable C-contiguous {np.dtype(dtype)} buffer of "
                               f"shape {shape}, got {getattr(out, 'dtype', type(out))} "
                               f"{getattr(out, 'shape', '')}")


class MatMulNBitsWeights(NamedTuple):
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


# -------------------------------------------------------------------------------------- references
def dequantize_dq_reference(
    w: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    K: int,
    N: int,
    bits: int,
    signed: bool,
    block_size: int,
) -> np.ndarray:
    """ONNX DequantizeLinear (axis=0, blockwise) in plain numpy: ``(q - z) * s`` in float32, then cast
    to the scale dtype. Slow and memory hungry on purpose: it is the oracle for tests."""
    kb = -(-K // block_size)
    q = unpack_codes(w, K * N, bits, signed).astype(np.float32).reshape(K, N)
    z = np.zeros((kb, N), np.float32) if zero_points is None else \
        unpack_codes(zero_points, kb * N, bits, signed).astype(np.float32).reshape(kb, N)
    s = np.asarray(scales)
    rep = lambda a: np.repeat(a, block_size, axis=0)[:K]  # noqa: E731
    return ((q - rep(z)) * rep(s.astype(np.float32))).astype(s.dtype)


def dequantize_matmulnbits_reference(
    B: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    """MatMulNBits' view of its weight as a ``[K, N]`` float32 matrix (padding dropped): codes along K
    per column, zero point ``2**(bits-1)`` when absent. Oracle for tests."""
    shp = matmulnbits_shapes(K, N, bits, block_size, zero_points is not None)
    kb = shp.k_blocks
    codes = unpack_codes(np.ascontiguousarray(B).reshape(-1), N * kb * block_size, bits)
    codes = codes.reshape(N, kb * block_size)[:, :K].astype(np.float32)
    if zero_points is None:
        z = np.full((N, kb), float(1 << (bits - 1)), np.float32)
    else:
        zb = np.ascontiguousarray(zero_points).reshape(N, -1)
        z = np.stack([unpack_codes(zb[n], kb, bits) for n in range(N)]).astype(np.float32)
    s = np.asarray(scales).reshape(N, kb).astype(np.float32)
    rep = lambda a: np.repeat(a, block_size, axis=1)[:, :K]  # noqa: E731
    return ((codes - rep(z)) * rep(s)).T.astype(np.asarray(scales).dtype)


def benchmark_pack_B(K: int = 4096, N: int = 4096, bits: int = 4, signed: bool = True, block_size: int = 32,
                     repeats: int = 15) -> dict[str, float]:
    """Time :func:`pack_B` on random bytes; returns best/median seconds and GB/s of input weight bytes."""
    import time

    w = np.random.default_rng(0).integers(0, 256, -(-K * N * bits // 8), dtype=np.uint8)
    out = np.empty(matmulnbits_shapes(K, N, bits, block_size, False).B, np.uint8)
    pack_B(w, K, N, bits, signed, block_size, out=out)  # warm up (page faults of out)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pack_B(w, K, N, bits, signed, block_size, out=out)
        ts.append(time.perf_counter() - t0)
    best, med = min(ts), float(np.median(ts))
    return {"bytes": float(w.nbytes), "best_s": best, "median_s": med,
            "best_GBps": w.nbytes / best / 1e9, "median_GBps": w.nbytes / med / 1e9}


if __name__ == "__main__":  # pragma: no cover - manual benchmark
    import sys

    args = [int(a) for a in sys.argv[1:4]]
    K_, N_, bits_ = (args + [4096, 4096, 4][len(args):])[:3]
    for signed_ in (True, False):
        r = benchmark_pack_B(K_, N_, bits_, signed_)
        print(f"pack_B {'int' if signed_ else 'uint'}{bits_} [{K_}x{N_}] bs32: best {r['best_s'] * 1e3:.1f} ms "
              f"({r['best_GBps']:.2f} GB/s), median {r['median_s'] * 1e3:.1f} ms ({r['median_GBps']:.2f} GB/s) "
              f"of {r['bytes'] / 2**20:.0f} MiB input")
