"""What the DequantizeLinear matchers share: the rejection record and how a check rejects, the
element types both rules read, and the walk over DQ nodes.

Why a module of its own: :mod:`.dq_matmul_match` (ORT's own DQ+MatMul rule, replayed) and
:mod:`.dq_gather_match` (ortmem's DQ+Gather rewrite, from GatherBlockQuantized's kernel) report the
pairs they leave alone the same way (:class:`Rejected`, a stable ``code`` listed in
``docs/ort-fusion-rules.md``), and neither should import the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from onnx import NodeProto, TensorProto

from ortmem.ort.fusion_graph import FusionGraph

#: What ORT does with a DQ+MatMul pair. ``fused_by_ort``: the installed release fuses it but ortmem's
#: rewrite does not reproduce that case (shared initializers on releases without PR #28326's guard):
#: ortmem leaves the node for ORT to fuse.
OrtOutcome = Literal["converted", "converted_wrong", "session_error", "kept", "fused_by_ort"]

INT2 = getattr(TensorProto, "INT2", 26)
UINT2 = getattr(TensorProto, "UINT2", 25)
#: Scale types both rules take (ValidateDQForMatMulNBits; GatherBlockQuantized's CPU kernel).
SCALE_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
#: The smallest block either op takes (qdq_selectors.cc ValidateDQForMatMulNBits; gather_block_quantized.cc).
MIN_BLOCK = 16


@dataclass(frozen=True)
class Rejected:
    """A DQ node feeding a MatMul/Gemm (or, from ``dq_gather_match``, a Gather) that stays as it is
    (``ort_outcome="kept"``), and why.

    ``code`` is a stable identifier (see ``docs/ort-fusion-rules.md``); ``reason`` is for people.
    One record per (DQ, consumer) pair: a DQ feeding two MatMuls is reported twice.
    """

    graph_path: str
    node: str
    node_index: int
    consumer: str
    consumer_index: int
    code: str
    reason: str
    ort_outcome: OrtOutcome = "kept"

    @property
    def node_name(self) -> str:
        """The consumer (MatMul/Gemm) label, like ``Candidate.node_name``."""
        return f"{self.graph_path}:{self.consumer}" if self.graph_path else self.consumer


class Reject(Exception):
    """Raised by a check that refuses the pair: its ``code``, ``reason`` and ORT's ``outcome``."""

    def __init__(self, code: str, reason: str, outcome: OrtOutcome = "kept"):
        super().__init__(reason)
        self.code, self.reason, self.outcome = code, reason, outcome

    def record(self, g: FusionGraph, dq_idx: int, consumer_idx: int) -> Rejected:
        return Rejected(g.path, g.label(dq_idx), dq_idx, g.label(consumer_idx), consumer_idx,
                        self.code, self.reason, self.outcome)


def is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def dequantize_nodes(g: FusionGraph) -> Iterator[tuple[int, NodeProto]]:
    """Every DequantizeLinear of ``g`` with an output and at least weight and scale inputs, in file order."""
    for i, dq in enumerate(g.nodes):
        if dq.op_type == "DequantizeLinear" and dq.output and dq.output[0] and len(dq.input) >= 2:
            yield i, dq


def is_onnx_domain(node: NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")
