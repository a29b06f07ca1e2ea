"""ORT's own ``InferenceSession`` class, captured the first time ortmem imports onnxruntime.

:mod:`ortmem.intercept.session_hook` replaces ``onnxruntime.InferenceSession`` by a factory while the hook is on;
``ortmem.InferenceSession`` must derive from ORT's class whenever its module is first imported, which
the hook defers until a model needs ortmem (:mod:`ortmem.onnxfile.scan`). Both take the class from
here, and the hook imports this module before it patches anything.
"""
from __future__ import annotations

from onnxruntime.capi import onnxruntime_inference_collection as collection

#: ORT's class, as it was before any hook.
ORT_SESSION = collection.InferenceSession
