"""``ortmem.PipelineSession``: run a partitioned model stage by stage, like one InferenceSession.

:func:`ortmem.plan.partition.partition` writes one sub-model per stage; this class creates one
:class:`ortmem.InferenceSession` per stage with its device's execution provider and runs them in
order, handing each stage the tensors it reads. It answers ``run``, ``get_inputs``, ``get_outputs``
(and ``get_providers``) the way ORT's session does for the unpartitioned model.

Moving tensors
--------------
* All stages on the CPU (the default ``transfer="auto"``): numpy arrays, passed by reference; a
  tensor is dropped as soon as no later stage reads it and the caller did not ask for it.
* Otherwise (``transfer="ortvalue"``): each stage runs with IO binding; its outputs are bound on its
  own device, so a tensor read by a later stage on the *same* device never leaves it. A tensor whose
  producer and reader are on different devices goes through host memory (``OrtValue.numpy()``, then
  the reading session copies it in): ORT's Python API has no device-to-device copy between sessions.
  Outputs come back as numpy arrays.

Device names map to providers as in :func:`ortmem.plan.partition.default_provider` (``cpu``,
``cuda:N``...; unknown names run on the CPU with a warning) unless ``providers_per_device`` says
otherwise; non-CPU stages get the CPU EP as their fallback for ops the device lacks.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from ortmem.errors import PlanError
from ortmem.plan.partition import PartitionPlan, StageInfo, is_cpu, stage_providers
from ortmem.session.inference import InferenceSession
from ortmem.plan.partition.run.stage_io import StagedModelIO

__all__ = ["PipelineSession"]


class PipelineSession(StagedModelIO):
    """Run the stages of a partition plan in order (see the module docstring).

    ``plan_or_dir``: a :class:`PartitionPlan` that was written (``out_dir``), its folder, or its
    ``plan.json``. ``providers_per_device``: device -> provider name or ``(name, options)``,
    overriding the plan's. ``sess_options`` go to every stage's session; the remaining keyword
    arguments to :class:`ortmem.InferenceSession` (``cache``, ``trim``...). ``transfer``: ``"auto"``,
    ``"numpy"`` or ``"ortvalue"``.
    """

    def __init__(self, plan_or_dir: PartitionPlan | str | os.PathLike,
                 providers_per_device: Mapping[str, Any] | None = None,
                 sess_options: ort.SessionOptions | None = None, *, transfer: str = "auto", **session_kwargs: Any):
        plan = plan_or_dir if isinstance(plan_or_dir, PartitionPlan) else PartitionPlan.load(plan_or_dir)
        if not plan.out_dir:
            raise PlanError("this plan was not written (partition(..., out_dir=...)): there are no stage files to run")
        if transfer not in ("auto", "numpy", "ortvalue"):
            raise PlanError(f"transfer must be 'auto', 'numpy' or 'ortvalue', got {transfer!r}")
        self.plan = plan
        folder = Path(plan.out_dir)
        overrides = dict(providers_per_device or {})
        self._devices: list[tuple[str, dict[str, Any]]] = []
        self._sessions: list[InferenceSession] = []
        for st in plan.stages:
            name, opts, providers = stage_providers(st.device, st.provider, st.provider_options, overrides)
            self._devices.append((name, opts))
            self._sessions.append(InferenceSession(str(folder / st.file), sess_options, providers=providers,
                                                   **session_kwargs))
        all_cpu = all(is_cpu(name) for name, _ in self._devices)
        self._ortvalue = transfer == "ortvalue" or (transfer == "auto" and not all_cpu)
        # the last stage reading each value: after it, the value can go (unless asked for)
        self._last_read = plan.last_readers()
        self.declare_io(plan.inputs, plan.outputs, [a for s in self._sessions for a in s.get_inputs()],
                        [a for s in self._sessions for a in s.get_outputs()])

    # ---------------------------------------------------------------------------------- metadata
    def get_providers(self) -> list[str]:
        out: list[str] = []
        for sess in self._sessions:
            for p in sess.get_providers():
                if p not in out:
                    out.append(p)
        return out

    @property
    def sessions(self) -> list[InferenceSession]:
        """One session per stage, in order."""
        return list(self._sessions)

    @property
    def stages(self) -> list[StageInfo]:
        return list(self.plan.stages)

    # ---------------------------------------------------------------------------------- running
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: ort.RunOptions | None = None) -> list[np.ndarray]:
        """Outputs ``output_names`` (all, when None) for ``input_feed``, as ORT's ``run`` returns them."""
        wanted = self.plan.requested_outputs(output_names, input_feed)
        keep = set(wanted)
        values: dict[str, Any] = dict(input_feed)
        where: dict[str, int] = {}  # value -> stage that made it (feeds: -1, on the host)
        if self._ortvalue:
            self._run_bound(values, where, keep, run_options)
        else:
            self._run_numpy(values, keep, run_options)
        return [self._host(values[n]) for n in wanted]

    def _needed_outputs(self, k: int, st: StageInfo, keep: set[str]) -> list[str]:
        return [o for o in st.outputs if o in keep or self._last_read.get(o, -1) > k]

    def _drop(self, values: dict[str, Any], k: int, keep: set[str]) -> None:
        for x in [x for x in values if x not in keep and self._last_read.get(x, -1) <= k]:
            del values[x]

    def _run_numpy(self, values: dict[str, Any], keep: set[str], run_options) -> None:
        for k, (st, sess) in enumerate(zip(self.plan.stages, self._sessions)):
            feeds = {x: values[x] for x in st.inputs if x in values}
            outs = self._needed_outputs(k, st, keep)
            if outs:
                for name, arr in zip(outs, sess.run(outs, feeds, run_options)):
                    values[name] = arr
            self._drop(values, k, keep)

    def _run_bound(self, values: dict[str, Any], where: dict[str, int], keep: set[str], run_options) -> None:
        for k, (st, sess) in enumerate(zip(self.plan.stages, self._sessions)):
            name, opts = self._devices[k]
            dev_type, dev_id = _ort_device(name, opts)
            outs = self._needed_outputs(k, st, keep)
            if not outs:
                self._drop(values, k, keep)
                continue
            binding = sess.io_binding()
            for x in st.inputs:
                if x not in values:
                    continue
                v = values[x]
                src = where.get(x, -1)
                if isinstance(v, ort.OrtValue) and src >= 0 and self._devices[src] == self._devices[k]:
                    binding.bind_ortvalue_input(x, v)  # same device: no copy
                else:
                    binding.bind_cpu_input(x, self._host(v))
            for o in outs:
                binding.bind_output(o, dev_type, dev_id)
            sess.run_with_iobinding(binding, run_options)
            for o, v in zip(outs, binding.get_outputs()):
                values[o] = v
                where[o] = k
            self._drop(values, k, keep)

    @staticmethod
    def _host(v: Any) -> Any:
        return v.numpy() if isinstance(v, ort.OrtValue) else v


def _ort_device(provider: str, options: Mapping[str, Any]) -> tuple[str, int]:
    """IO-binding device for a provider's outputs."""
    if provider == "CUDAExecutionProvider":
        return "cuda", int(options.get("device_id", 0))
    if provider == "DmlExecutionProvider":
        return "dml", int(options.get("device_id", 0))
    return "cpu", 0
