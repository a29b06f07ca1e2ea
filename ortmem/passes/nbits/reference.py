"""Oracles for the MatMulNBits packing kernels (:mod:`.packing`) and a benchmark of them.

Why apart from the kernels: the oracles are plain, slow numpy (``(q - z) * s`` over whole tensors),
written to be obviously right rather than fast; tests compare the kernels' output with them
(``tests/passes/nbits/test_packing.py``). Measure the kernel with
``python -m ortmem.passes.nbits.reference [K N bits]``.
"""
from __future__ import annotations

import numpy as np

from ortmem.passes.nbits.packing import matmulnbits_shapes, pack_B, unpack_codes


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
