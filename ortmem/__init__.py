"""ortmem: own the memory lifecycle of ONNX model weights around ONNX Runtime.

The public API fits on one screen:

- :func:`load` reads a model into a weightless skeleton plus mapped weight spans (no byte copied);
- :class:`InferenceSession` is a drop-in for ``onnxruntime.InferenceSession`` that hands ORT
  external-data references instead of bytes, so ORT never copies the weights;
- :class:`Model`, :class:`WeightRef`, :class:`WeightState` describe what was loaded;
- :func:`estimate` predicts memory from metadata alone; :func:`stats` measures it per node;
- :class:`PipelineSession` runs a model partitioned over devices with memory budgets
  (:func:`ortmem.plan.partition`, ``ortmem partition``); ``ortmem.RayPipeline`` (``pip install ortmem[ray]``)
  runs it over the nodes of a Ray cluster (:mod:`ortmem.plan.partition.ray`);
- :func:`hook` / :func:`unhook` route every session the process creates through ortmem, code that
  calls ``onnxruntime.InferenceSession`` itself included (``python -m ortmem run`` does it for a
  whole program);
- :func:`allocator_hygiene` (a context manager) and :func:`trim` keep glibc from hoarding what ORT
  frees, for sessions created without ortmem;
- :mod:`ortmem.errors` holds the exception hierarchy rooted at :class:`OrtmemError`.

Why the attributes are lazy: ``import ortmem`` must not cost what ortmem exists to save. Each name is
imported from the module that owns it on first use, so a program that only creates sessions never loads
the planners, plotting or memray, and ``import ortmem`` itself loads nothing but the exception types
(``bench/bench_import.py`` measures it against ``import onnxruntime`` in fresh interpreters).
"""
from __future__ import annotations

from ortmem.errors import OrtmemError
from ortmem.base.lazy import lazy_attributes

__version__ = "0.1.0"

#: public name -> module that owns it
_LAZY = {
    "InferenceSession": "ortmem.session.inference",
    "load": "ortmem.onnxfile.loader",
    "Model": "ortmem.onnxfile.model",
    "WeightRef": "ortmem.onnxfile.weights",
    "WeightState": "ortmem.onnxfile.weights",
    "allocator_hygiene": "ortmem.base.hygiene",
    "trim": "ortmem.base.hygiene",
    "estimate": "ortmem.plan.estimate",
    "partition": "ortmem.plan.partition",
    "stats": "ortmem.plan.estimate",
    "PipelineSession": "ortmem.plan.partition.run.pipeline_session",
    "hook": "ortmem.intercept.session_hook",
    "unhook": "ortmem.intercept.session_hook",
}
#: names that need an optional extra (not in ``__all__``, so ``from ortmem import *`` never imports Ray)
_OPTIONAL = {"RayPipeline": "ortmem.plan.partition.ray"}

__all__ = ["OrtmemError", *_LAZY]


__getattr__, __dir__ = lazy_attributes(__name__, {**_LAZY, **_OPTIONAL})
