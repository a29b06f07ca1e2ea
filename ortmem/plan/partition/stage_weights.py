"""The one weights file every stage reads (``weights.bin``): where each weight lands in it, writing it
(a hard link to the source's data file when possible, else each distinct span copied once, page
aligned), and pointing a graph's external-data references at it.

Stages share weights (a tied embedding, a constant chain copied into several stages); one shared file
keeps each weight byte on disk, and in the page cache, once.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import AttributeProto, GraphProto, TensorProto

from ortmem.onnxfile.model import Model
from ortmem.onnxfile.weights import FILE_ALIGN
from ortmem.onnxfile.walk import external_data_dict
from ortmem.errors import PlanError
from ortmem.plan.partition.graph import tensor_nbytes

#: The partitioner's messages keep the logger name users configure, whichever module logs them.
log = logging.getLogger("ortmem.plan.partition")


@dataclass
class WeightsLayout:
    """Where each source span lands in the shared weights file."""

    mode: str  # "link" | "copy"
    source: Path | None  # link: the file linked
    spans: dict[tuple[str, int, int], int]  # (resolved source path, offset, length) -> new offset
    size: int  # file size
    weight_bytes: int  # distinct bytes


def plan_layout(model: Model, mode: str) -> WeightsLayout:
    refs = list(model.store)
    files = {r.file.resolve() for r in refs}
    embedded = any(r.embedded for r in refs)
    if mode not in ("auto", "link", "copy"):
        raise PlanError(f"weights must be 'auto', 'link' or 'copy', got {mode!r}")
    distinct: dict[tuple[str, int, int], int] = {}
    for r in refs:
        distinct.setdefault((str(r.file.resolve()), r.offset, r.length), r.length)
    total = sum(distinct.values())
    can_link = len(files) == 1 and not embedded
    if mode == "link" and not can_link:
        raise PlanError("weights='link' needs every weight in one external data file (this model has "
                        f"{len(files)} file(s){', some embedded' if embedded else ''})")
    if (mode in ("auto", "link")) and can_link:
        src = next(iter(files))
        return WeightsLayout("link", src, {k: k[1] for k in distinct}, src.stat().st_size, total)
    spans: dict[tuple[str, int, int], int] = {}
    pos = 0
    for key in sorted(distinct):
        pos = -(-pos // FILE_ALIGN) * FILE_ALIGN
        spans[key] = pos
        pos += key[2]
    return WeightsLayout("copy", None, spans, pos, total)


def write_stage_weights(layout: WeightsLayout, out: Path) -> None:
    """Write (or link) the shared weights file; a copy streams each span once, never holding more
    than a chunk in memory."""
    if out.exists() or out.is_symlink():
        out.unlink()
    if layout.mode == "link":
        assert layout.source is not None
        try:
            os.link(layout.source, out)
            return
        except OSError as e:  # another filesystem: a copy keeps the folder self-contained
            log.warning("cannot hard-link %s (%s); copying it", layout.source, e)
            shutil.copyfile(layout.source, out)
            return
    chunk = 16 << 20
    with open(out, "wb") as dst:
        dst.truncate(layout.size)
        by_file: dict[str, list[tuple[int, int, int]]] = {}
        for (path, off, length), new in layout.spans.items():
            by_file.setdefault(path, []).append((off, length, new))
        for path, spans in by_file.items():
            with open(path, "rb") as src:
                for off, length, new in sorted(spans):
                    done = 0
                    while done < length:
                        n = min(chunk, length - done)
                        copied = 0
                        if hasattr(os, "copy_file_range"):
                            try:
                                copied = os.copy_file_range(src.fileno(), dst.fileno(), n, off + done, new + done)
                            except OSError:
                                copied = 0
                        if copied <= 0:
                            data = os.pread(src.fileno(), n, off + done)
                            if len(data) != n:
                                raise PlanError(f"short read from {path} at {off + done}")
                            os.pwrite(dst.fileno(), data, new + done)
                            copied = n
                        done += copied


def _relocate_tensor(t: TensorProto, base: Path, layout: WeightsLayout, location: str) -> None:
    if t.data_location != TensorProto.EXTERNAL:
        return
    info = external_data_dict(t)
    src = (base / info.get("location", "")).resolve()
    off = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else tensor_nbytes(t)
    new = layout.spans.get((str(src), off, length))
    if new is None:
        raise PlanError(f"internal: tensor {t.name!r} ({src}, {off}, {length}) is not in the weights layout")
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(new)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v


def _relocate_node(node: onnx.NodeProto, base: Path, layout: WeightsLayout, location: str) -> None:
    for attr in node.attribute:
        if attr.type == AttributeProto.TENSOR:
            _relocate_tensor(attr.t, base, layout, location)
        elif attr.type == AttributeProto.TENSORS:
            for t in attr.tensors:
                _relocate_tensor(t, base, layout, location)
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            _relocate_tensor(attr.sparse_tensor.values, base, layout, location)
            _relocate_tensor(attr.sparse_tensor.indices, base, layout, location)
        elif attr.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
            for g in ([attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)):
                relocate_graph(g, base, layout, location)


def relocate_graph(g: GraphProto, base: Path, layout: WeightsLayout, location: str) -> None:
    for t in g.initializer:
        _relocate_tensor(t, base, layout, location)
    for s in g.sparse_initializer:
        _relocate_tensor(s.values, base, layout, location)
        _relocate_tensor(s.indices, base, layout, location)
    for node in g.node:
        _relocate_node(node, base, layout, location)
