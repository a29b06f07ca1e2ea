"""Device names to ONNX Runtime execution providers, and the fixed bytes a stage's session costs there.

The planner and :class:`ortmem.plan.partition.run.pipeline_session.PipelineSession` (which runs a plan) must agree on which
provider a device name means, so both use these functions.

A device on another machine is named ``node:<NODE>/<device>`` (``node:10.0.0.2/cpu``,
``node:n1/cuda:0``): ``<NODE>`` names a node of a Ray cluster (``ortmem.plan.partition.ray`` resolves it),
``<device>`` is a device name as below. The planner only needs to know which devices share a node
(a cut between two nodes moves its tensors over the network); nothing here imports Ray.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping


NODE_PREFIX = "node:"


def split_node(device: str) -> tuple[str | None, str]:
    """(node, device on that node) of a device name: ``"node:n1/cpu"`` -> ``("n1", "cpu")``,
    ``"node:n1"`` -> ``("n1", "cpu")``; a name without the prefix is on no named node: ``(None, name)``."""
    name = str(device).strip()
    if not name.lower().startswith(NODE_PREFIX):
        return None, name
    node, _, local = name[len(NODE_PREFIX):].partition("/")
    return node, local or "cpu"


def default_provider(device: str) -> tuple[str, dict[str, Any], bool]:
    """(execution provider, provider options, known) for a device name (its ``node:<NODE>/`` prefix aside).

    ``cpu``/``cpu:N``/``disk`` run on the CPU EP; ``cuda``, ``cuda:N``, ``gpu:N`` and bare integers
    (accelerate's GPU names, ``"0"``) on the CUDA EP with that ``device_id``; ``dml:N`` on DirectML.
    Anything else is unknown: CPU, and ``known`` is False so the caller can warn.
    """
    _, name = split_node(device)
    low = name.lower()
    kind, _, idx = low.partition(":")
    if low.isdigit():
        return "CUDAExecutionProvider", {"device_id": int(low)}, True
    if kind in ("cpu", "disk"):
        return "CPUExecutionProvider", {}, True
    if kind in ("cuda", "gpu") and (not idx or idx.isdigit()):
        return "CUDAExecutionProvider", {"device_id": int(idx or 0)}, True
    if kind == "dml" and (not idx or idx.isdigit()):
        return "DmlExecutionProvider", {"device_id": int(idx or 0)}, True
    return "CPUExecutionProvider", {}, False


def resolve_provider(device: str, providers_per_device: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The provider a device's stages run with: ``providers_per_device[device]`` (a provider name or a
    ``(name, options)`` pair) when given, else :func:`default_provider` (warning on unknown names)."""
    given = (providers_per_device or {}).get(device)
    if given is not None:
        if isinstance(given, str):
            return given, {}
        name, opts = given
        return str(name), dict(opts or {})
    name, opts, known = default_provider(device)
    if not known:
        warnings.warn(f"device {device!r} is not a known device name; its stages run on the CPU "
                      "(say otherwise with providers_per_device)", stacklevel=3)
    return name, opts


def stage_providers(device: str, provider: str, provider_options: Mapping[str, Any],
                    overrides: Mapping[str, Any] | None) -> tuple[str, dict[str, Any], list[Any]]:
    """(provider, options, ORT ``providers`` list) a stage of ``device`` runs with: the plan's provider
    unless ``overrides`` names the device; a non-CPU provider gets the CPU EP as its fallback."""
    if overrides and device in overrides:
        name, opts = resolve_provider(device, overrides)
    else:
        name, opts = provider, dict(provider_options)
    return name, opts, [(name, opts)] + ([] if is_cpu(name) else ["CPUExecutionProvider"])


def is_cpu(provider: str) -> bool:
    return provider == "CPUExecutionProvider"


#: What a stage costs more in a Ray actor than in a plain process, above the actor's RSS once it has
#: run a Ray task (docs/distributed.md: 5.1-5.6 MiB on three stages of a 21 MB synthetic Llama, Ray 2.60,
#: onnxruntime 1.32.0: the session is created and run from Ray's task thread, arguments and results
#: pass through Ray's buffers).
NODE_ACTOR_OVERHEAD = 6 << 20


def default_overhead(provider: str, device: str = "") -> int:
    """Per-session fixed bytes assumed for a stage: on the CPU, what the estimator's calibration
    measured for a session (creation + first run + ortmem's hook), plus :data:`NODE_ACTOR_OVERHEAD`
    for a device on a named node (a Ray actor); elsewhere 0 (a device budget is taken to exclude the
    runtime's own context)."""
    if not is_cpu(provider):
        return 0
    from ortmem.plan.estimate import Calibration

    cal = Calibration.load()
    actor = NODE_ACTOR_OVERHEAD if split_node(device)[0] is not None else 0
    return cal.session_fixed_bytes + cal.run_fixed_bytes + cal.ortmem_fixed_bytes + actor
