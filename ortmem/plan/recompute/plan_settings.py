"""What a plan records: the plan string (ORT's memory-optimizer syntax) and the session settings a rewritten model needs.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ortmem.onnxfile.scan import RECOMPUTE_METADATA as META_PREFIX

#: keys of the rewritten model's ``metadata_props`` (META_PREFIX: defined where the hook reads it without
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


# ------------------------------------------------------------------------------------ session settings
#: ORT's session config key (``onnxruntime_session_options_config_keys.h``) naming graph transformers
#: to skip, ``;``-separated; checked on 1.31.1 to keep CSE from merging clones.
DISABLE_OPTIMIZERS_KEY = "optimization.disable_specified_optimizers"


def session_changes_for(order: str, disabled: Sequence[str]) -> dict[str, Any]:
    """The session changes a rewrite needs: ORT's execution order and the optimizers to skip."""
    out: dict[str, Any] = {"execution_order": order}
    if disabled:
        out["session_config"] = {DISABLE_OPTIMIZERS_KEY: ";".join(disabled)}
    return out


def merge_config_value(key: str, ours: str, theirs: str | None) -> str:
    """A config value combining the user's and ours (the disabled-optimizer list is a union)."""
    if key != DISABLE_OPTIMIZERS_KEY or not theirs:
        return ours
    names = [n for n in theirs.split(";") if n]
    names += [n for n in ours.split(";") if n and n not in names]
    return ";".join(names)


def apply_session_changes(so, changes: Mapping[str, Any]):
    """Apply ``changes`` (from :func:`apply_for_session` or :func:`recorded_settings`) to an
    ``onnxruntime.SessionOptions`` in place, and return it. For people and scripts running a
    rewritten model with plain ONNX Runtime; the hook applies the same changes to a scoped copy."""
    import onnxruntime as ort

    if "execution_order" in changes:
        so.execution_order = getattr(ort.ExecutionOrder, str(changes["execution_order"]))
    for key, value in (changes.get("session_config") or {}).items():
        current = so.get_session_config_entry(key) if _has_config(so, key) else None
        so.add_session_config_entry(key, merge_config_value(key, str(value), current))
    return so


def _has_config(so, key: str) -> bool:
    try:
        so.get_session_config_entry(key)
        return True
    except Exception:  # noqa: BLE001 - ORT raises for a key never set
        return False


