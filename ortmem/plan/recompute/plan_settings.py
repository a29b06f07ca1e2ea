"""What a plan records: the plan string (ORT's memory-optimizer syntax) and the session settings a rewritten model needs.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ortmem.onnxfile.scan import RECOMPUTE_METADATA as META_PREFIX
# the session settings a rewrite records: defined where the session reads them without importing the planner
from ortmem.ort.recorded_settings import (DISABLE_OPTIMIZERS_KEY, apply_session_changes,  # noqa: F401
                                          merge_config_value, session_changes_for)

#: keys of the rewritten model's ``metadata_props`` (META_PREFIX: defined where the session reads it without
#: importing the planner); the optimizer ORT must skip; the plan format
ORT_OPTIMIZED_KEY = "ortmem.ort_optimized"  # set by liveness.ort_optimized: the file order is ORT's run order
CSE = "CommonSubexpressionElimination"
PLAN_VERSION = "1"


# ------------------------------------------------------------------------------------ plan strings
@dataclass(frozen=True)
class PlanEntry:
    pattern: str
    strategy: int = 1  # 1 = recompute (ORT's code); 0 = leave alone
    count: int = -1  # -1 = every occurrence

    def __str__(self) -> str:
        return f"{self.pattern}:{self.strategy}:{self.count}"


def parse_plan(text: str) -> list[PlanEntry]:
    """``"A+B+:1:-1,C+:1:2"`` -> entries (ORT's memory-optimizer syntax)."""
    out: list[PlanEntry] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        bits = part.split(":")
        if len(bits) != 3 or not bits[0].endswith("+"):
            raise ValueError(f"plan entry {part!r} is not PATTERN+:STRATEGY:COUNT")
        try:
            strategy, count = int(bits[1]), int(bits[2])
        except ValueError:
            raise ValueError(f"plan entry {part!r}: strategy and count must be integers") from None
        if strategy not in (0, 1) or count == 0 or count < -1:
            raise ValueError(f"plan entry {part!r}: strategy 0 or 1, count -1 or >= 1")
        out.append(PlanEntry(bits[0], strategy, count))
    return out


def format_plan(entries: Sequence[PlanEntry]) -> str:
    return ",".join(str(e) for e in entries)
