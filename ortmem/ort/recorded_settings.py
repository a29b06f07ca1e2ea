"""The ORT session settings a model written by ``ortmem recompute`` records, and how to apply them.

A rewritten model records its execution order and the optimizers ORT must skip in ``metadata_props``
(keys starting with :data:`ortmem.onnxfile.scan.RECOMPUTE_METADATA`): ORT's CSE would merge the clones
back into one, and the planned order holds only under the recorded ``ExecutionOrder``. The session
replays them (:meth:`ortmem.session.handoff.Handoff.with_recorded_settings`) and plain ORT users apply
them with :func:`apply_session_changes`, neither importing the planner (:mod:`ortmem.plan.recompute`).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ortmem.onnxfile.scan import RECOMPUTE_METADATA

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


def recorded_settings(model: Any) -> dict[str, Any]:
    """The session changes a rewritten model (an ``onnx.ModelProto``; only its ``metadata_props`` are
    read) records: ``{"execution_order": ..., "session_config": {...}}``, empty for a model ortmem did
    not rewrite."""
    meta = {p.key[len(RECOMPUTE_METADATA):]: p.value for p in model.metadata_props
            if p.key.startswith(RECOMPUTE_METADATA)}
    if not meta:
        return {}
    return session_changes_for(meta.get("execution_order", "DEFAULT"),
                               [x for x in meta.get("disabled_optimizers", "").split(";") if x])


def apply_session_changes(so, changes: Mapping[str, Any]):
    """Apply ``changes`` (from :func:`recorded_settings`) to an ``onnxruntime.SessionOptions`` in place,
    and return it. For people and scripts running a rewritten model with plain ONNX Runtime;
    ``ortmem.InferenceSession`` applies the same changes for its creation call only."""
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
