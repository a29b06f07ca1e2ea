"""A Ray Serve deployment of a partition plan, built on :class:`RayPipeline` (``pip install 'ortmem[ray-serve]'``).

One replica owns one :class:`RayPipeline`, that is one set of stage actors and one copy of the
weights over the cluster. Each HTTP request is *submitted* to the stages at once and awaited in a
thread, so concurrent requests flow through the stages as a pipeline (stage k on request i+1 while
stage k+1 is on request i). More replicas would each place a full copy of the model: give the
cluster the memory for it first. The stage actors are the replica's own (Ray ends an actor with
the process that created it), so they stop with the replica.

The request body is JSON ``{"inputs": {name: nested list}, "outputs": [names] (optional)}``; each
input is converted to the dtype the pipeline's input declares. A malformed request (not JSON, an
unknown input or output, values that do not fit the dtype) is answered 400 with ``{"error": ...}``. The answer is
``{"outputs": {name: {"dtype": str, "shape": [...], "data": nested list}}}``: floats go through
JSON as Python floats (doubles), which hold every float32/float16 value exactly, so a client gets
the bits the stages computed.
"""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from ray import serve
from starlette.responses import JSONResponse

from ..measure.inputs import ORT_NUMPY_TYPES
from .pipeline import RayPipeline

__all__ = ["PartitionedModel", "app"]


@serve.deployment(num_replicas=1, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0})
class PartitionedModel:
    """The deployment: ``parts`` is a partition folder every node sees (see :class:`RayPipeline`)."""

    def __init__(self, parts: str, timeout_s: float = 60.0, **pipeline_kwargs: Any):
        self.pipe = RayPipeline(parts, timeout_s=timeout_s, **pipeline_kwargs)
        self.dtypes = {a.name: ORT_NUMPY_TYPES.get(a.type) for a in self.pipe.get_inputs()}  # None: numpy's guess

    async def __call__(self, request: Any) -> Any:
        try:
            body = await request.json()
            unknown = sorted(set(body["inputs"]) - set(self.dtypes))
            if unknown:
                raise ValueError(f"unknown inputs {unknown}; the pipeline takes {sorted(self.dtypes)}")
            feeds = {name: np.asarray(value, dtype=self.dtypes[name]) for name, value in body["inputs"].items()}
            names = body.get("outputs") or [a.name for a in self.pipe.get_outputs()]
            pending = self.pipe.submit(names, feeds)  # enqueued on the stages now (unknown outputs refused)
        except (ValueError, KeyError, TypeError) as exc:  # a malformed request: the client's to fix
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
        arrays = await asyncio.to_thread(pending.result)  # waits with the pipeline's deadline
        return {"outputs": {n: {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tolist()}
                            for n, a in zip(names, arrays)}}


def app(parts: str, **options: Any) -> Any:
    """The bound application for ``serve.run`` (``options`` go to :class:`PartitionedModel`)."""
    return PartitionedModel.bind(parts, **options)
