"""A Ray Serve application over a partition plan on a Ray cluster (docs/distributed.md, "Ray Serve").

    pip install "ortmem[ray-serve]"
    ortmem partition model.onnx --ray auto --out /shared/parts      # a path every node sees
    PARTS=/shared/parts serve run examples.ray_serve_app:app
    curl -X POST localhost:8000/ -d '{"inputs": {"input_ids": [[1, 2, 3, 4]]}, "outputs": ["logits"]}'

The deployment itself is :class:`ortmem.plan.partition.ray.serving.PartitionedModel` (tested by
tests/plan/partition/ray/test_pipeline.py over loopback).
"""
import os

from ortmem.plan.partition.ray.serving import app as build_app

app = build_app(os.environ.get("PARTS", "parts"))
