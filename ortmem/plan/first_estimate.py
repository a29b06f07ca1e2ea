"""A first, metadata-only guess at session-creation peak memory, from the facts in docs/ort-facts.

It is deliberately simple (the calibrated estimator is :mod:`ortmem.plan.estimate`'s job): ORT
copies embedded bytes twice (protobuf, then an OrtValue) and maps external data; ortmem maps both;
ORT's own DQ+MatMul fusion holds an extra copy of each quantized weight it rewrites.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model import Model

#: ORT on an embedded file peaks at ~2x the embedded weights (protobuf copy + OrtValue copy).
EMBEDDED_COPY_FACTOR = 2.0
#: ORT's DQMatMulToMatMulNBits keeps the old and new weight alive together plus an Initializer copy.
QDQ_FUSION_EXTRA_FACTOR = 1.0


@dataclass
class PeakEstimate:
    ort_peak_bytes: int
    ortmem_peak_bytes: int
    notes: list[str] = field(default_factory=list)


def first_estimate(model: Model, quantized_fusable_bytes: int = 0) -> PeakEstimate:
    embedded = sum(w.nbytes for w in model.weights if w.embedded)
    external = sum(w.nbytes for w in model.weights if not w.embedded)
    ort = int(external + EMBEDDED_COPY_FACTOR * embedded + QDQ_FUSION_EXTRA_FACTOR * quantized_fusable_bytes)
    ortmem = int(external + embedded + QDQ_FUSION_EXTRA_FACTOR * quantized_fusable_bytes)
    notes = [
        f"{embedded / 2**20:.1f} MiB embedded: ORT copies it twice, ortmem maps it from the file",
        f"{external / 2**20:.1f} MiB external data: mapped by both",
    ]
    return PeakEstimate(ort, ortmem, notes)
