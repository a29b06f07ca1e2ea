"""A Ray Serve deployment of a partition plan, built on :class:`RayPipeline` (``pip install 'ortmem[ray-serve]'``).

One replica owns one :class:`RayPipeline`, that is one set of stage actors and one copy of the
weights over the cluster. Each HTTP request is *submitted* to the stages at once and awaited in a
thread, so concurrent requests flow through the stages as a pipeline (stage k on request i+1 while
stage k+1 is on request i). More replicas would each place a full copy of the model: give the
cluster the memory for it first. The stage actors are the replica's own (Ray ends an actor with
the process that created it), so they stop with the replica.

The request body is JSON ``{"inputs": {name: nested list}, "outputs": [names] (optional)}``; each
input is converted to the dtype the pipeline's input declares. A malformed request is answered 400, 413
or 422 with ``{"error": ...}`` by the checks ``ortmem.serve.server`` uses (``ortmem.serve.request_checks``: not
JSON, an unknown input or output -> 400; over the body or element limits -> 413; values of another
kind, rank or fixed dim than declared -> 422). The answer is
``{"outputs": {name: {"dtype": str, "shape": [...], "data": nested list}}}``: floats go through
JSON as Python floats (doubles), which hold every float32/float16 value exactly, so a client gets
the bits the stages computed.
"""
from __future__ import annotations

import asyncio
from typing import Any

from ray import serve
from starlette.responses import JSONResponse

from ortmem.serve.request_checks import (Limits, RequestRejected, check_request, list_tensor, parse_json_object, read_body, request_inputs, request_outputs, specs)
from ortmem.plan.partition.ray.pipeline import RayPipeline

__all__ = ["PartitionedModel", "app"]


@serve.deployment(num_replicas=1, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0})
class PartitionedModel:
    """The deployment: ``parts`` is a partition folder every node sees (see :class:`RayPipeline`);
    ``limits`` bound what one request may ask (``ortmem.serve.request_checks``; its defaults when None)."""

    def __init__(self, parts: str, timeout_s: float = 60.0, limits: Limits | None = None, **pipeline_kwargs: Any):
        self.pipe = RayPipeline(parts, timeout_s=timeout_s, **pipeline_kwargs)
        self.limits = limits or Limits()
        self.inputs = specs(self.pipe.get_inputs())
        self.outputs = specs(self.pipe.get_outputs())

    async def __call__(self, request: Any) -> Any:
        try:
            body = parse_json_object(await read_body(request, self.limits.max_body_bytes))
            names = request_outputs(body, list(self.outputs))
            given = request_inputs(body, self.inputs, require_all=False)  # the plan says which it reads
            feeds = {n: list_tensor(n, v, self.inputs[n], self.limits) for n, v in given.items()}
            check_request(feeds, self.inputs, [self.outputs[n] for n in names], self.limits)
            pending = self.pipe.submit(names, feeds)  # enqueued on the stages now
        except RequestRejected as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        except ValueError as exc:  # submit: an input a stage reads is missing
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
        arrays = await asyncio.to_thread(pending.result)  # waits with the pipeline's deadline
        return {"outputs": {n: {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tolist()}
                            for n, a in zip(names, arrays)}}


def app(parts: str, **options: Any) -> Any:
    """The bound application for ``serve.run`` (``options`` go to :class:`PartitionedModel`)."""
    return PartitionedModel.bind(parts, **options)
