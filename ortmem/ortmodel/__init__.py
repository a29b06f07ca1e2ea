"""One model of what the installed ONNX Runtime does.

``release``: the installed ORT (version, build, CPU) and its probed capabilities — the one place that
knows what differs between releases; ``probe`` and ``variants``: the tiny-model questions asked of it.
``settings``: the session settings ORT's behaviour depends on, read once from ``SessionOptions``.
``graph_index``: one graph indexed once (producers, consumers, subgraphs, constants, ORT's execution
orders). ``external_data``: ORT's rules for external-data entries (keys, offset parsing, markers).
``fp16_kernels``: whether this build runs fp16 MatMulNBits in fp32 on the CPU. ``value_types``: value
types and shapes as the installed ORT's ``Graph::Resolve`` gives them (the fusion rules' shape questions).
"""
from .release import Capabilities, Release, capabilities, installed, table_capabilities

__all__ = ["Capabilities", "Release", "capabilities", "installed", "table_capabilities"]
