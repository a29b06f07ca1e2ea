"""The unpartitioned model's inputs and outputs, answered from what a pipeline's stages declare.

Why one class: :class:`ortmem.plan.partition.run.pipeline_session.PipelineSession` (stages in this process) and
:class:`ortmem.plan.partition.ray.RayPipeline` (stages on a cluster's nodes) answer ``get_inputs`` and
``get_outputs`` as ORT's session does for the whole model; both pick, by name and in the plan's order,
the first declaration of each value among their stages' own. Light (errors only), so the Ray driver
needs nothing of the session path for it.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from ortmem.errors import PlanError


def args_by_name(names: Sequence[str], declared: Iterable[Any]) -> list[Any]:
    """The declarations (objects with a ``name``: ORT ``NodeArg``s or equivalents) of ``names``, in that
    order; the first declaration of a name wins. PlanError names those no stage declares."""
    by_name: dict[str, Any] = {}
    for arg in declared:
        by_name.setdefault(arg.name, arg)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise PlanError(f"no stage declares {missing}: the plan and its stage files disagree")
    return [by_name[n] for n in names]


class StagedModelIO:
    """``get_inputs``/``get_outputs`` of a pipeline: the subclass calls :meth:`declare_io` once its
    stages exist."""

    _inputs: list[Any]
    _outputs: list[Any]

    def declare_io(self, inputs: Sequence[str], outputs: Sequence[str], stage_inputs: Iterable[Any],
                   stage_outputs: Iterable[Any]) -> None:
        """Pick the model's ``inputs`` and ``outputs`` (names, in the model's order) from the stages'
        declarations; a model output that is a model input passes straight through."""
        self._inputs = args_by_name(inputs, stage_inputs)
        self._outputs = args_by_name(outputs, [*stage_outputs, *self._inputs])

    def get_inputs(self) -> list[Any]:
        """The unpartitioned model's inputs (ORT ``NodeArg``s or their equivalents, in the model's order)."""
        return list(self._inputs)

    def get_outputs(self) -> list[Any]:
        """The unpartitioned model's outputs (ORT ``NodeArg``s or their equivalents, in the model's order)."""
        return list(self._outputs)
