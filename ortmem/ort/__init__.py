"""One model of what the installed ONNX Runtime does.

``release``: the installed ORT (version, build, CPU) and its probed capabilities — the one place that
knows what differs between releases; ``variants``: the tiny models the release probe
(:mod:`ortmem.measure.release_probe`, a child program above the session path) asks about, and their keys.
``providers``: which execution providers ORT fuses quantized patterns for, and which are CPU or GPU.
``settings``: the session settings ORT's behaviour depends on, read once from ``SessionOptions``.
``graph_index``: one graph indexed once (producers, consumers, subgraphs, constants, ORT's execution
orders).
``fp16_kernels``: whether this build runs fp16 MatMulNBits in fp32 on the CPU. ``value_types``: value
types and shapes as the installed ORT's ``Graph::Resolve`` gives them (the fusion rules' shape questions).

This package imports nothing above it (``tests/test_import_graph.py``), and its names are lazy
(:mod:`ortmem.base.lazy`): the hook reads ``providers`` without
loading the release table, onnx or the probe's variants.
"""
from __future__ import annotations

from ortmem.base.lazy import lazy_attributes

_OWNERS = {
    "Capabilities": "ortmem.ort.release",
    "Release": "ortmem.ort.release",
    "capabilities": "ortmem.ort.release",
    "installed": "ortmem.ort.release",
    "table_capabilities": "ortmem.ort.release",
}
__all__ = list(_OWNERS)
__getattr__, __dir__ = lazy_attributes(__name__, _OWNERS)
