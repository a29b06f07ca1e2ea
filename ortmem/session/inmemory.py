"""``InferenceSession(..., cache=False)``: converted weights handed to ORT straight from memory.

The converted tensors are written into one anonymous mapping at the offsets weights.bin would use,
and ORT borrows them in place (``add_external_initializers_from_files_in_memory`` with
``session.use_external_initializer_file_buffers_directly=1``; every offset is page-aligned, so every
tensor qualifies). ORT refuses to mix in-memory and on-disk external data, so the source files of
unchanged tensors are registered as read-only mappings too, and ORT borrows those in place as well.

No file is written, which makes this the fastest start. The price is that every converted tensor is
resident until the session exists: ORT pre-packs from our buffer, and only then can the pages of the
inputs ORT no longer reads (:mod:`ortmem.passes.borrowing` asks ORT which) be given back. A native model
on disk (or a cache entry) peaks lower, because ORT unmaps each file-backed tensor right after
packing it.
"""
from __future__ import annotations

import logging
import mmap
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ortmem.passes.borrowing import BORROW_KEY, B, SCALES, ZERO_POINTS, matmulnbits_unread_inputs
from ortmem.errors import WeightStateError
from ortmem.onnxfile.model import Model
from ortmem.onnxfile.weights import page_align
from ortmem.passes.engine import convert_into_memory, rewrite_skeleton
from ortmem.passes.rules import dq_matmul
from ortmem.passes.conversion_plan import ConversionPlan
from ortmem.passes.writers import Progress

log = logging.getLogger(__name__)


@dataclass
class InMemoryConversion:
    """The converted tensors of one model, in one anonymous mapping ORT borrows from."""

    plan: ConversionPlan
    buffer: mmap.mmap
    name: str  # the in-memory "file" name the skeleton's locations use
    skeleton: bytes  # for ORT: converted tensors in memory, the rest from the source files
    seconds: float
    releasable: list[tuple[int, int]] = field(default_factory=list)
    sources: dict[str, mmap.mmap] = field(default_factory=dict)  # location -> read-only map of a source file
    released: bool = False

    @property
    def config(self) -> dict[str, str]:
        return {BORROW_KEY: "1"}

    def register(self, options: Any) -> None:
        """Tell ORT where the in-memory files are (the options keep only pointers, not references).

        ORT refuses a model that mixes in-memory and on-disk external data, so the source files of
        unchanged tensors are registered too, as read-only mappings: ORT borrows their (aligned)
        tensors in place, exactly as if it had mapped the file itself.
        """
        if self.released and self.releasable:
            raise WeightStateError(
                "the session's converted weights were given back after it was created, so ORT cannot "
                "create it again (set_providers, an EP fallback): create a new ortmem.InferenceSession, "
                "or pass cache=True", file=self.name)
        names, views, sizes = [self.name], [np.frombuffer(self.buffer, np.uint8)], [len(self.buffer)]
        for location, mm in self.sources.items():
            names.append(location)
            views.append(np.frombuffer(mm, np.uint8))
            sizes.append(len(mm))
        options.add_external_initializers_from_files_in_memory(names, views, sizes)

    def release_unread(self) -> int:
        """Give back the pages of every tensor ORT no longer reads; returns bytes released.

        ``MADV_REMOVE``, not ``MADV_DONTNEED``: the buffer is a shared anonymous mapping (shmem), from
        which ``DONTNEED`` only unmaps pages while the memory stays allocated (the process's RSS drops,
        the machine's ``Shmem`` does not: measured 256 MiB kept). ``REMOVE`` frees them; the released
        ranges then read as zeros, so no session may be created from this buffer again
        (:meth:`register` refuses).
        """
        if self.released:
            return 0
        freed = 0
        for offset, length in self.releasable:
            self.buffer.madvise(mmap.MADV_REMOVE, offset, length)
            freed += length
        self.released = True
        return freed


def convert_in_memory(model: Model, plan: ConversionPlan, *, progress: Optional[Progress] = None,
                      prepacking: bool = True, threads: int = 0) -> InMemoryConversion:
    """Convert ``plan`` into a fresh anonymous mapping (``threads`` counted as ORT's
    ``intra_op_num_threads``: :func:`ortmem.passes.writers.conversion_threads`) and describe how ORT
    borrows it."""
    name = f"ortmem-mem-{uuid.uuid4().hex}.bin"
    buffer = mmap.mmap(-1, max(plan.size, mmap.PAGESIZE))
    seconds = convert_into_memory(model, plan, buffer, progress=progress, threads=threads)
    skeleton = rewrite_skeleton(model, plan, name, move_carried=False).SerializeToString()
    conv = InMemoryConversion(plan, buffer, name, skeleton, seconds)
    for ref, _ in plan.copied:
        location = _location_of(model, ref)
        if location not in conv.sources:
            with open(ref.file, "rb") as f:
                conv.sources[location] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # Only MatMulNBits inputs can ever be released. GatherBlockQuantized (the dq_gather rule) has no PrePack
    # (onnxruntime/contrib_ops/cpu/quantization/gather_block_quantized.cc defines Compute only): it
    # reads data, scales and zero points from our buffers on every run, so none of its tensors --
    # neither those materialized into `buffer` nor the carried table in a source mapping -- is listed
    # here (tests/session/test_convert.py::test_in_memory_never_releases_gbq_inputs).
    if prepacking:
        for r in plan.of_rule(dq_matmul.NAME):
            c = r.candidate
            # the node's own scale type: fp32 where ortmem emits an fp16 DQ's MatMulNBits in fp32, as
            # ORT's CPU EP runs it (ortmem.ort.fp16_kernels.runs_fp16_matmulnbits_in_fp32)
            unread = matmulnbits_unread_inputs(c.bits, c.block_size, c.accuracy_level, r.scales.data_type,
                                               r.zero_points is not None)
            for pos, t in ((B, r.B), (SCALES, r.scales), (ZERO_POINTS, r.zero_points)):
                if t is not None and pos in unread:
                    conv.releasable.append((t.offset, page_align(t.nbytes)))
    return conv


def _location_of(model: Model, ref) -> str:
    """The location string the skeleton uses for ``ref``'s file (what ORT looks the file up by)."""
    return os.path.relpath(ref.file, model.folder)
