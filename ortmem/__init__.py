"""ortmem: own the memory lifecycle of ONNX model weights around ONNX Runtime.

The public API fits on one screen:

- :func:`load` reads a model into a weightless skeleton plus mapped weight spans (no byte copied);
- :class:`InferenceSession` is a drop-in for ``onnxruntime.InferenceSession`` that hands ORT
  external-data references instead of bytes, so ORT never copies the weights;
- :class:`Model`, :class:`WeightRef`, :class:`WeightState` describe what was loaded;
- :func:`estimate` predicts memory from metadata alone; :func:`stats` measures it per node;
- :class:`PipelineSession` runs a model partitioned over devices with memory budgets
  (:func:`ortmem.plan.partition`, ``ortmem partition``); ``ortmem.RayPipeline`` (a lazy attribute,
  ``pip install ortmem[ray]``) runs it over the nodes of a Ray cluster (:mod:`ortmem.distributed`);
- :func:`allocator_hygiene` (a context manager) and :func:`trim` keep glibc from hoarding what ORT
  frees, for sessions created without ortmem;
- :mod:`ortmem.errors` holds the exception hierarchy rooted at :class:`OrtmemError`.
"""

__version__ = "0.1.0"

from .errors import OrtmemError  # noqa: E402
from .hygiene import allocator_hygiene, trim
from .loader import load
from .model import Model
from .pipeline import PipelineSession
from .plan.estimate import estimate
from .plan.partition import partition
from .plan.stats import stats
from .session import InferenceSession
from .weights import WeightRef, WeightState

__all__ = [
    "InferenceSession", "Model", "OrtmemError", "PipelineSession", "WeightRef", "WeightState",
    "allocator_hygiene", "estimate", "load", "partition", "stats", "trim",
]



def __getattr__(name: str):
    """``ortmem.RayPipeline``: imported (with Ray) only when asked for."""
    if name == "RayPipeline":
        from .distributed import RayPipeline

        return RayPipeline
    raise AttributeError(f"module 'ortmem' has no attribute {name!r}")
