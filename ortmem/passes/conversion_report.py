"""What a conversion did: :class:`ConversionReport`, apart from the plan it summarises.

Why a module of its own, without onnx: a cold start converts in a helper process
(:mod:`ortmem.session.cold_start_child`) and the session's process receives the report; unpickling it
from :mod:`.conversion_plan`, which imports onnx, would put onnx's import back into the very process
the helper keeps it out of.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortmem.passes.conversion_plan import ConversionPlan


@dataclass
class ConversionReport:
    converted: int  # rewrites that convert source weights into a new form (converted_bytes > 0)
    skipped: list[tuple[str, str]]
    source_bytes: int  # quantized weight bytes read
    output_bytes: int  # bytes written to weights.bin (converted + carried)
    seconds: float
    done: list[str] = field(default_factory=list)  # what each rule did (ConversionPlan.done)
    #: Full digests (:mod:`ortmem.files.digest`) of the files written, computed while writing them; only
    #: when the caller asked (a cache entry records them in its manifest).
    file_digests: dict[str, str] = field(default_factory=dict)

    @property
    def throughput_gbps(self) -> float:
        return self.source_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @classmethod
    def from_plan(cls, plan: "ConversionPlan", seconds: float) -> "ConversionReport":
        converted = sum(1 for r in plan.rewrites if r.converted_bytes)
        return cls(converted, plan.skipped, plan.converted_source_bytes, plan.size, seconds, list(plan.done))

    def summary(self) -> str:
        lines = [
            ", ".join([*self.done, f"left {len(self.skipped)} as they were"]),
            f"{self.source_bytes / 2**20:.1f} MiB of quantized weights in {self.seconds:.2f} s "
            f"({self.throughput_gbps:.2f} GB/s); weights.bin {self.output_bytes / 2**20:.1f} MiB",
        ]
        lines += [f"  left as is: {node}: {reason}" for node, reason in self.skipped]
        return "\n".join(lines)
