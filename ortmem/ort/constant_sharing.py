"""Level-1 ``ConstantSharing`` (``core/optimizer/constant_sharing.cc``), replayed: which single-value
initializers ORT merges into one, so that their consumers end up sharing it.

Why the fusion rules care: two per-tensor DQs with the same scale value, or one whose scale equals any
other float scalar constant of the graph (a ``Mul`` by 0.5), share one scale after this transformer,
and ``DQMatMulToMatMulNBits``'s shared-initializer guard then refuses both (``docs/ort-fusion-rules.md``
section 3). It is the one question of the rules that needs *values*: single-element tensors are read
when embedded; external ones only through a caller's reader, else they are reported as unknown.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
from onnx import TensorProto, numpy_helper

from ortmem.ort.fusion_graph import FusionGraph

# constant_sharing.cc supported_data_types
SHARING_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT32, TensorProto.INT64)

#: Reads an external single-element initializer of graph ``path``: ``reader(path, tensor)``.
ScalarReader = Callable[[str, TensorProto], object]


def scalar_value(g: FusionGraph, t: TensorProto, reader: ScalarReader | None) -> float | None:
    """Value of a single-element tensor, or None when it cannot be known without reading a file."""
    if t.data_location == TensorProto.EXTERNAL:
        if reader is None:
            return None
        v = reader(g.path, t)
        return None if v is None else float(np.asarray(v).reshape(-1)[0])
    try:
        arr = numpy_helper.to_array(t)
    except Exception:  # noqa: BLE001 - malformed tiny tensor: treat as unknown
        return None
    if arr.size != 1:
        return None
    return float(arr.reshape(-1)[0].astype(np.float64))


def constant_sharing_groups(g: FusionGraph, reader: ScalarReader | None) -> tuple[dict[str, set[int]], set[str]]:
    """(name -> the nodes reading it once merged, names whose value is unknown).

    Only the main graph (the transformer does not Recurse). An initializer takes part when it is a
    constant initializer, its shape is rank 0 or [1], its type is one of float/float16/double/int32/int64,
    it has readers and none of them reads it from a subgraph. Equal (type, rank, value) -> one tensor.
    """
    merged: dict[str, set[int]] = {}
    unknown: set[str] = set()
    if g.parent is not None:
        return merged, unknown
    groups: dict[tuple, list[str]] = {}
    for name, init in g.inits.items():
        t = init.proto
        if g.constant_initializer(name) is None or t.data_type not in SHARING_TYPES:
            continue
        dims = list(t.dims)
        if not (len(dims) == 0 or (len(dims) == 1 and dims[0] == 1)):
            continue
        if not g.readers(name) or g.implicit_users(name):
            continue
        value = scalar_value(g, t, reader)
        if value is None:
            unknown.add(name)
            continue
        if math.isnan(value):
            continue
        groups.setdefault((t.data_type, len(dims), value), []).append(name)
    for names in groups.values():
        if len(names) > 1:
            union: set[int] = set()
            for nm in names:
                union.update(g.readers(nm))
            for nm in names:
                merged[nm] = union
    return merged, unknown
