"""The byte transpose under the MatMulNBits packing kernels (:mod:`.packing`): ``[K, N/p] -> [N/p, K]``
bytes (p = 8/bits) with the sub-byte lanes swapped in place, in bounded scratch.

Why a module of its own: it is the one hot loop of the conversion and its speed tricks (tiles, strips,
SWAR lane shuffles) have nothing to do with the layout contract the kernels keep.

Speed
-----
Everything is whole-array numpy over cache-sized tiles (2 MiB of scratch per call on the fast path). The
expensive step is a byte transpose ``[K, N/p] -> [N/p, K]`` (p = 8/bits), done as "gather 8 rows into
uint64 words, then transpose uint64 words in strips" (see :func:`_tile_transpose`). The lane shuffle that
turns "p columns x p rows" bytes into "p rows x p columns" bytes is a SWAR transpose on uint16 (4-bit) or
uint32 (2-bit) words: one or two masked XOR-swaps per word instead of any per-element unpacking; the
signed re-bias is one XOR per word. The byte transpose and the shuffle with copy-out take about
half the time each; measure with
``python -c "from ortmem.passes.nbits.reference import benchmark_pack_B as b; print(b(4096, 4096, 4))"``.
Sizes whose rows are not byte aligned (``N*bits % 8 != 0``) take a slower generic path that unpacks
codes one byte each.
"""
from __future__ import annotations

import numpy as np

#: Source rows per strip of the byte transpose; 8 measured fastest (fits L1 with N/p columns).
STRIP_ROWS = 8
#: Scratch of one tile of the fast path (gathered words + transposed tile + SWAR temporary). Measured
#: on 4096x4096 int4: 256 KiB 8 ms, 512 KiB 7 ms, 2 MiB 5.5-6 ms, 4 MiB 5.5-6 ms (fewer numpy calls per
#: byte vs. cache residency); 2 MiB keeps the tile in L2/L3.
_TILE_BYTES = 2 * 1024 * 1024
_TILE_MIN_ROWS = 256


def xor_byte(bits: int) -> int:
    """Byte that flips the top bit of every lane: turns two's-complement lanes into offset binary."""
    return {2: 0xAA, 4: 0x88, 8: 0x80}[bits]


def strip_transpose(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src.T`` for 2-D byte arrays, in strips of 8 source rows.

    A plain ``np.copyto(dst, src.T)`` on uint8 walks one of the two arrays with a stride of a full
    row per byte and runs at ~0.15 GB/s here; strips of 8 source rows keep the 8 source rows and the
    destination lines in L1 and run ~10x faster (measured 4096x2048 bytes: 54 ms -> 4.9 ms).
    """
    rows = src.shape[0]
    for i in range(0, rows, STRIP_ROWS):
        j = min(i + STRIP_ROWS, rows)
        dst[:, i:j] = src[i:j].T


# ------------------------------------------------------------------------------- core transpose-pack
def transpose_pack(
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
    xor = xor_byte(bits) if signed else 0
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
        n_chunk = N if N * STRIP_ROWS * 4 <= budget else max(1, budget // (4 * STRIP_ROWS))
        rows_chunk = max(STRIP_ROWS, (budget // (4 * N)) // STRIP_ROWS * STRIP_ROWS)
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
                strip_transpose(T[:, : r1 - r0], codes[:, n0:n1])
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
    xv = view_as(X[: g * cc * 8], (g, cc, 8))
    for r in range(8):
        xv[:full, :, r] = src[r : full * 8 : 8]
    if full < g:
        xv[full:] = 0
        for r in range(nr - full * 8):
            xv[full, :, r] = src[full * 8 + r]
    X64 = view_as(X[: g * cc * 8].view(np.uint64), (g, cc))
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
    T = view_as(scratch[:n], (cc, w))
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
    out3 = view_as(out2[c0 * per : c1 * per], (cc, per, out2.shape[1]))
    if bits == 4:
        # word = row 2j (low byte) | row 2j+1 (high byte); lanes: bits 0-3 col 2c, 4-7 col 2c+1.
        # Swap (row 2j, col 2c+1) <-> (row 2j+1, col 2c): then low byte = col 2c, high byte = col 2c+1.
        V = T.view(np.uint16)
        t = view_as(tmp.view(np.uint16), V.shape)
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
        t = view_as(tmp.view(np.uint32), V.shape)
        _delta_swap(V, t, 12, np.uint32(0x0000F0F0))
        _delta_swap(V, t, 6, np.uint32(0x00CC00CC))
        Vo = V[:, : ob1 - ob0]
        if xor:
            Vo ^= np.uint32(xor * 0x01010101)
        np.copyto(out3[:, 0, ob0:ob1], Vo, casting="unsafe")
        for lane in range(1, 4):
            np.right_shift(Vo, 8 * lane, out=out3[:, lane, ob0:ob1], casting="unsafe")


def view_as(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reshape that must not copy (we write through it); raises instead of silently copying."""
    v = a.view()
    v.shape = shape
    return v
