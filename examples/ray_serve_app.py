"""A Ray Serve deployment built on ``ortmem.distributed.RayPipeline`` (docs/distributed.md).

    pip install "ortmem[ray]" "ray[serve]"
    ortmem partition model.onnx --ray auto --out /shared/parts      # a path every node sees
    PARTS=/shared/parts serve run examples.ray_serve_app:app
    curl -X POST localhost:8000/ -d '{"input_ids": [[1, 2, 3, 4]]}'

One replica owns one set of stage actors (one copy of the weights over the cluster); concurrent
requests are submitted without waiting, so they flow through the stages as a pipeline. More
replicas would each place a full copy of the model: give the cluster the memory for it first.
Not run by the test suite (Serve needs FastAPI/uvicorn, which the test install does not have).
"""
from __future__ import annotations

import asyncio
import os

import numpy as np
from ray import serve

from ortmem.distributed import RayPipeline


@serve.deployment(num_replicas=1, max_ongoing_requests=8)
class PartitionedModel:
    def __init__(self, parts: str):
        self.pipe = RayPipeline(parts, timeout_s=60)

    async def __call__(self, request) -> dict:
        body = await request.json()
        ids = np.asarray(body["input_ids"], dtype=np.int64)
        pending = self.pipe.submit(["logits"], {"input_ids": ids})  # enqueued on the stages at once
        (logits,) = await asyncio.to_thread(pending.result)  # waits with the pipeline's deadline
        return {"next_token": logits[:, -1].argmax(-1).tolist()}


app = PartitionedModel.bind(os.environ.get("PARTS", "parts"))
