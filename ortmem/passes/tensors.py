"""What the rewrites read and write: source tensors of a loaded model, and the tensors of the output model.

Why a module of its own: both rules (:mod:`ortmem.passes.rules.dq_matmul` and :mod:`ortmem.passes.rules.dq_gather`) read initializers by
(graph path, name) with ORT's outer-scope lookup and describe the tensors they write the same way;
keeping these here lets each rule import them without importing the other (no cycle).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ortmem.base.dtypes import dtype_info
from ortmem.errors import ConversionError
from ortmem.onnxfile.model import Model
from ortmem.onnxfile.walk import is_external, iter_graphs
from ortmem.onnxfile.weights import WeightRef


@dataclass
class OutTensor:
    """A tensor of the output model: where its bytes go in weights.bin."""

    name: str
    data_type: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0
    location: Optional[str] = None  # None: weights.bin; else a file beside it (a linked source)





@dataclass
class SkeletonIndex:
    """Every graph of a skeleton by path and every initializer by (graph path, name), built once per
    skeleton: looking a tensor up per pattern by rescanning the graphs made conversion quadratic
    (800 patterns took 30x the time of 100). The first initializer of a name wins, as a scan would."""

    skeleton: onnx.ModelProto
    graphs: dict[str, onnx.GraphProto]
    initializers: dict[str, dict[str, TensorProto]]


_INDEXES: "weakref.WeakKeyDictionary[Model, SkeletonIndex]" = weakref.WeakKeyDictionary()
_INDEX_LOCK = threading.Lock()  # conversion workers look tensors up concurrently


def skeleton_index(model: Model) -> SkeletonIndex:
    """The :class:`SkeletonIndex` of ``model.skeleton`` (rebuilt if the skeleton was replaced; a
    loaded model's skeleton is never edited in place: rewrites work on a copy)."""
    with _INDEX_LOCK:
        idx = _INDEXES.get(model)
        if idx is None or idx.skeleton is not model.skeleton:
            graphs = dict(iter_graphs(model.skeleton.graph))
            inits: dict[str, dict[str, TensorProto]] = {}
            for path, g in graphs.items():
                by_name = inits.setdefault(path, {})
                for t in g.initializer:
                    by_name.setdefault(t.name, t)
            idx = SkeletonIndex(model.skeleton, graphs, inits)
            _INDEXES[model] = idx
        return idx


def find_initializer(model: Model, graph_path: str, name: str) -> tuple[str, TensorProto]:
    """The initializer ``name`` as seen from ``graph_path`` (outer scopes included, as ORT looks it up)."""
    index = skeleton_index(model)
    path = graph_path
    while True:
        t = index.initializers.get(path, {}).get(name)
        if t is not None:
            return path, t
        if not path:
            break
        path = path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""
    raise ConversionError("initializer not found (a Constant node or graph input?)", tensor=name, file=str(model.path))


def source_bytes(model: Model, graph_path: str, name: str) -> np.ndarray:
    """The raw bytes of an initializer: a zero-copy view of its mapped span, or the inline bytes."""
    path, t = find_initializer(model, graph_path, name)
    if is_external(t):
        return model.store.get(name, path).raw()
    if t.raw_data:
        return np.frombuffer(t.raw_data, dtype=np.uint8)
    arr = numpy_helper.to_array(t)  # typed fields: small tensors only (scales, zero points)
    if dtype_info(t.data_type).packed:
        raise ConversionError("packed sub-byte tensor stored in typed fields is not supported", tensor=name, file=str(model.path))
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def source_ref(model: Model, graph_path: str, name: str) -> Optional[WeightRef]:
    """The mapped weight behind an external initializer; None for an inline one."""
    path, t = find_initializer(model, graph_path, name)
    return model.store.get(name, path) if is_external(t) else None
