"""One model of what the installed ONNX Runtime does.

``release``: the installed ORT (version, build, CPU) and its probed capabilities — the one place that
knows what differs between releases. ``probe``: the tiny-model questions asked of it.
"""
from .release import Capabilities, Release, capabilities, installed, table_capabilities

__all__ = ["Capabilities", "Release", "capabilities", "installed", "table_capabilities"]
