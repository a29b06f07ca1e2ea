"""Deterministic first-run inputs and a stable hash of the outputs.

Inputs come from the session's own metadata so any model can be probed without the user writing
feeds; they are deterministic (seeded) so two strategies on the same model get identical feeds and
their output hashes can be compared. Integer inputs stay small (< ``int_high``, default 100)
because they are usually token ids feeding a Gather: a random int64 would index out of range.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

import numpy as np

from ..dtypes import ORT_NUMPY_TYPES

DEFAULT_DIMS: dict[str, int] = {"batch": 1, "seq": 8}
DEFAULT_INT_HIGH = 100


def resolve_dim(dim: Any, dims: Mapping[str, int]) -> int:
    """A concrete size for one dimension: ints stay, named dims come from ``dims`` or a heuristic.

    Heuristic for unnamed/unknown symbols: anything mentioning "batch" is ``dims["batch"]`` (1),
    everything else is ``dims["seq"]`` (8): sequence-like axes are by far the common symbolic case.
    """
    if isinstance(dim, int) and dim >= 0:
        return dim
    name = str(dim) if dim is not None else ""
    if name in dims:
        return int(dims[name])
    if "batch" in name.lower():
        return int(dims.get("batch", DEFAULT_DIMS["batch"]))
    return int(dims.get("seq", DEFAULT_DIMS["seq"]))


def make_inputs(session: Any, options: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Feeds for ``session.run`` built from ``session.get_inputs()``.

    ``options["dims"]`` maps symbolic dim names to sizes; ``options["int_high"]`` bounds integer
    values (exclusive). Inputs whose name contains "mask" are all ones and "position" inputs count
    0, 1, 2, ... along the last axis, so attention models see a valid, causal-looking batch.
    """
    options = dict(options or {})
    dims = {**DEFAULT_DIMS, **options.get("dims", {})}
    int_high = int(options.get("int_high", DEFAULT_INT_HIGH))
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for meta in session.get_inputs():
        shape = tuple(resolve_dim(d, dims) for d in (meta.shape or []))
        dtype = ORT_NUMPY_TYPES.get(meta.type)
        if dtype is None:
            raise ValueError(f"cannot generate input {meta.name!r} of type {meta.type}")
        lname = meta.name.lower()
        if dtype is np.str_:
            arr = np.full(shape, "a", dtype=object)
        elif dtype is np.bool_:
            arr = np.ones(shape, dtype=np.bool_)
        elif np.issubdtype(dtype, np.integer):
            if "mask" in lname:
                arr = np.ones(shape, dtype=dtype)
            elif "position" in lname and shape:
                arr = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            else:
                hi = min(int_high, int(np.iinfo(dtype).max) + 1)
                arr = rng.integers(0, max(hi, 1), size=shape).astype(dtype)
        else:
            arr = rng.standard_normal(size=shape).astype(dtype)
        feeds[meta.name] = arr
    return feeds


def hash_outputs(names: list[str], outputs: list[Any]) -> str:
    """sha256 over each output's name, dtype, shape and bytes, in output order.

    Equal hashes mean bit-identical outputs; strategies that only change *how* weights get into
    memory must produce the same hash as plain ORT.
    """
    h = hashlib.sha256()
    for name, out in zip(names, outputs):
        h.update(name.encode() + b"\0")
        if isinstance(out, np.ndarray):
            arr = np.ascontiguousarray(out)
            h.update(str(arr.dtype).encode() + b"\0" + repr(arr.shape).encode() + b"\0")
            if arr.dtype == object:
                h.update(repr(arr.tolist()).encode())
            else:
                h.update(arr.tobytes())
        else:  # sequence / map outputs: their repr is deterministic for equal contents
            h.update(b"object\0" + repr(out).encode())
    return h.hexdigest()


def describe_outputs(names: list[str], outputs: list[Any]) -> list[dict[str, Any]]:
    """Name, dtype and shape of each output, for the report (the hash alone is opaque)."""
    desc = []
    for name, out in zip(names, outputs):
        if isinstance(out, np.ndarray):
            desc.append({"name": name, "dtype": str(out.dtype), "shape": list(out.shape)})
        else:
            desc.append({"name": name, "dtype": type(out).__name__, "shape": None})
    return desc
