"""Device names to ONNX Runtime execution providers, and the fixed bytes a stage's session costs there.

The planner and :class:`ortmem.pipeline.PipelineSession` (which runs a plan) must agree on which
provider a device name means, so both use these functions.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping


def default_provider(device: str) -> tuple[str, dict[str, Any], bool]:
    """(execution provider, provider options, known) for a device name.

    ``cpu``/``cpu:N``/``disk`` run on the CPU EP; ``cuda``, ``cuda:N``, ``gpu:N`` and bare integers
    (accelerate's GPU names, ``"0"``) on the CUDA EP with that ``device_id``; ``dml:N`` on DirectML.
    Anything else is unknown: CPU, and ``known`` is False so the caller can warn.
    """
    name = str(device).strip()
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


def is_cpu(provider: str) -> bool:
    return provider == "CPUExecutionProvider"


def default_overhead(provider: str) -> int:
    """Per-session fixed bytes assumed for a stage: on the CPU, what the estimator's calibration
    measured for a session (creation + first run + ortmem's hook); elsewhere 0 (a device budget is
    taken to exclude the runtime's own context)."""
    if not is_cpu(provider):
        return 0
    from .estimate import Calibration

    cal = Calibration.load()
    return cal.session_fixed_bytes + cal.run_fixed_bytes + cal.ortmem_fixed_bytes
