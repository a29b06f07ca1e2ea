"""Execution providers as ortmem's decisions see them: which ones ORT fuses quantized patterns for,
which run every local node on the CPU, and which run a fused fp16 kernel in fp16.

Why one module: the session (what to convert, whether pre-packed weights apply, how fp16 runs) and the
hook (which sessions to leave to ORT) ask the same questions of the same ``providers`` argument; two
copies of a provider list drift apart when ORT adds an EP. Light on purpose (no onnx; onnxruntime only
to read its default providers), so the hook can ask before it imports the session path.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import onnxruntime as ort

#: Execution providers for which ORT itself applies DQMatMulToMatMulNBits, so rewriting ahead of
#: time builds the graph ORT would build. Others (TensorRT, OpenVINO, QNN, ...) consume QDQ natively.
FUSING_PROVIDERS = frozenset({"CPUExecutionProvider", "CUDAExecutionProvider", "DmlExecutionProvider",
                              "AzureExecutionProvider"})
#: Providers that leave every local node to ORT's CPU kernels: the CPU EP, and the Azure EP, listed
#: by every default build, which only serves remote endpoints and runs no local node.
CPU_PROVIDERS = frozenset({"CPUExecutionProvider", "AzureExecutionProvider"})
#: Providers that run a fused fp16 MatMulNBits in fp16 (the CPU EP runs it in fp32).
FP16_GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "DmlExecutionProvider"})


def provider_names(providers: Optional[Sequence[Any]]) -> list[str]:
    """The EP names a ``providers`` argument lists (entries are names or ``(name, options)``); none for None."""
    return [p if isinstance(p, str) else p[0] for p in providers or ()]


def session_provider_names(providers: Optional[Sequence[Any]]) -> list[str]:
    """The EP names ORT will use for ``providers``: those listed, else ORT's default (every available one)."""
    return provider_names(providers or ort.get_available_providers())


def cpu_only(names: Iterable[str]) -> bool:
    """Every node runs on ORT's CPU kernels (pre-packed weights are CPU kernel layouts)."""
    return set(names) <= CPU_PROVIDERS


def not_fusing(names: Iterable[str]) -> list[str]:
    """The providers ORT fuses nothing for (:data:`FUSING_PROVIDERS`), in the order given."""
    return [n for n in names if n not in FUSING_PROVIDERS]


def fusing_only(names: Iterable[str]) -> bool:
    """Every provider is one for which ORT fuses DQ+MatMul itself."""
    return not not_fusing(names)


def runs_fp16_on_gpu(names: Iterable[str]) -> bool:
    """Some provider runs a fused fp16 MatMulNBits in fp16 (:data:`FP16_GPU_PROVIDERS`)."""
    return any(n in FP16_GPU_PROVIDERS for n in names)
