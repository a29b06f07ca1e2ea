"""What ``ortmem.InferenceSession(..., recompute=...)`` calls.

Part of :mod:`ortmem.plan.recompute` (see its docstring for the method)."""
from __future__ import annotations

import os
from typing import Any, Mapping

import onnx

from ortmem.plan.estimate.liveness import ModelLike, load_proto
from ortmem.plan.recompute.guard import verify
from ortmem.plan.recompute.planner import materialize, plan, recorded_settings


def apply_for_session(model: onnx.ModelProto | ModelLike, recompute: Any, dims: Mapping[str, int] | None = None,
                      *, session_options=None, folder: str | os.PathLike | None = None,
                      workdir: str | os.PathLike | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """What ``ortmem.InferenceSession(..., recompute=...)`` calls: ``(new_model, session_changes)``.

    ``model`` is what the hook is about to hand ORT: a path, or the skeleton (weights never read)
    whose external data lives in ``folder``. ``recompute``:

    * ``True`` / ``"auto"``: lower the peak as far as cheap recomputation gets it;
    * an ``int``: a budget in bytes;
    * a plan string (``"PATTERN+:1:-1,..."``, from ``ortmem recompute``'s summary);
    * ``"order"``: only the peak-minimizing order;
    * a dict with any of ``plan``, ``budget``, ``order`` (bool), ``expensive`` (bool), ``optimize``
      (bool, default: True when ``workdir`` is given), ``verify`` (bool, default False), ``dims``
      (symbolic dimension sizes, merged over ``dims``: sizes decide the plan).

    ``optimize``: plan on the graph ORT executes (:func:`ortmem.plan.estimate.liveness.ort_optimized`, a
    throwaway session at ``ORT_ENABLE_EXTENDED`` without pre-packing) instead of the graph as given,
    which is exact only at ``ORT_DISABLE_ALL``: ORT's fusions renumber nodes and so reorder them. The
    optimized model and its ``model.onnx.data`` are written into ``workdir`` (the caller's, kept until
    the session is created); ``session_changes["model_folder"]`` then names it, for
    ``session.model_external_initializers_file_folder_path``. ``verify``: measure the rewrite
    against the original under ORT's defaults in fresh processes (:func:`verify`; seconds to minutes)
    and refuse it (return the model unchanged, ``{}``) when its default peak is higher.

    A model already rewritten by ortmem (its ``metadata_props`` say so) comes back unchanged with the
    settings it records. ``session_changes`` is ``{}`` when nothing is worth changing, otherwise
    ``{"execution_order": "DEFAULT" | "PRIORITY_BASED", "session_config": {...}}`` (the config holds
    ``optimization.disable_specified_optimizers = CommonSubexpressionElimination`` when clones exist:
    ORT's CSE would merge them back). See docs/recompute.md, "The session hook".
    """
    proto = load_proto(model)
    recorded = recorded_settings(proto)
    if recorded or recompute in (None, False):
        return proto, recorded
    req: dict[str, Any] = {}
    if recompute is True or recompute == "auto":
        pass
    elif recompute == "order":
        req = {"order": True, "plan": ""}
    elif isinstance(recompute, bool):
        pass
    elif isinstance(recompute, int):
        req = {"budget": int(recompute)}
    elif isinstance(recompute, str):
        req = {"plan": recompute}
    elif isinstance(recompute, Mapping):
        unknown = set(recompute) - {"plan", "budget", "order", "expensive", "optimize", "verify", "dims"}
        if unknown:
            raise ValueError(f"recompute options not understood: {sorted(unknown)}")
        req = dict(recompute)
        dims = {**dict(dims or {}), **dict(req.pop("dims", None) or {})}
    else:
        raise TypeError(f"recompute must be True, an int budget, a plan string or a dict, not {type(recompute).__name__}")
    optimize = bool(req.get("optimize", workdir is not None))
    if (optimize or req.get("verify")) and workdir is None:
        raise ValueError("recompute with optimize or verify needs a workdir for the models it writes")
    analysed: onnx.ModelProto = proto
    opt_path = None
    if optimize:
        from ortmem.plan.estimate.liveness import ort_optimized

        opt_path = os.path.join(os.fspath(workdir), "model.onnx")  # type: ignore[arg-type]
        src = os.fspath(model) if isinstance(model, (str, os.PathLike)) else proto
        analysed = ort_optimized(src, opt_path, folder=folder)
    res = plan(analysed, dims, budget=req.get("budget"), plan_text=req.get("plan"), order=bool(req.get("order")),
               expensive=bool(req.get("expensive")), session_options=session_options)
    if not res.changed:
        return proto, {}
    new = materialize(res, analysed)
    changes = res.session_changes()
    if optimize:
        changes["model_folder"] = os.fspath(workdir)  # type: ignore[arg-type]
    if req.get("verify"):
        rewritten = os.path.join(os.fspath(workdir), "rewritten.onnx")  # type: ignore[arg-type]
        ref = os.fspath(model) if isinstance(model, (str, os.PathLike)) else opt_path
        if not optimize or ref is None:
            raise ValueError("verify needs optimize (the rewritten model's data lives in workdir)")
        onnx.save(new, rewritten)
        if not verify(ref, rewritten, dict(dims or {})).ok:
            return proto, {}
    return new, changes
