"""A small HTTP inference server for several worker processes (extra ``ortmem[serve]``).

The recipe (docs/workers.md)::

    ORTMEM_SERVE_MODEL=model.onnx gunicorn -w 4 -k uvicorn_worker.UvicornWorker \\
        --bind 127.0.0.1:8000 ortmem.serve.server:app            # add --preload to create it before fork

The session is created when this module is imported: in every worker without ``--preload``, once
in gunicorn's master before it forks the workers with ``--preload``. Both work: a session created
before ``fork()`` keeps working in the children (tested with ORT's thread pool on; the children
share its pages copy-on-write). With ortmem's warm start the weights are mapped from the cache
entry, so the page cache holds one copy for all workers either way; preloading only saves the
imports and the small private rest.

Environment: ``ORTMEM_SERVE_MODEL`` (required), ``ORTMEM_SERVE_ENGINE`` = ``ortmem`` (default) or
``ort`` (plain ``onnxruntime.InferenceSession``, to compare), ``ORTMEM_SERVE_THREADS`` (ORT's intra-op
threads per worker; default ORT's choice), ``ORTMEM_CACHE_DIR`` as everywhere; the request limits
``ORTMEM_SERVE_MAX_BODY_BYTES``, ``ORTMEM_SERVE_MAX_INPUT_ELEMENTS``, ``ORTMEM_SERVE_MAX_TOTAL_ELEMENTS``,
``ORTMEM_SERVE_MAX_OUTPUT_ELEMENTS`` (0 turns one off; defaults in ``ortmem.serve.request_checks``) and
``ORTMEM_SERVE_CHECK_INDICES=0`` to skip checking Gather indices against their tables.

HTTP: ``GET /info`` -> the serving pid, the pid that created the session, inputs, outputs and limits;
``POST /run`` with ``{"inputs": {name: {"dtype", "shape", "b64"}}, "outputs": [names] (optional)}``
(raw little-endian bytes, base64) -> ``{"pid", "outputs": {name: {"dtype", "shape", "b64"}}}``: exact,
unlike JSON floats. A malformed request gets 400, 413 or 422 and ``{"error": reason}``
(``ortmem.serve.request_checks``); 500 means the server failed, and its log has the traceback.
"""
from __future__ import annotations

import base64
import logging
import os
from dataclasses import asdict
from typing import Any

import numpy as np

from ortmem.serve.request_checks import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INPUT_ELEMENTS, DEFAULT_MAX_OUTPUT_ELEMENTS, DEFAULT_MAX_TOTAL_ELEMENTS, Limits, RequestRejected, check_request, decode_b64_tensor, gather_index_bounds, ort_client_error, parse_json_object, read_body, request_inputs, request_outputs, specs)

ENGINES = ("ortmem", "ort")

log = logging.getLogger(__name__)


def encode(array: np.ndarray) -> dict[str, Any]:
    """An array as JSON: dtype, shape and its bytes (little-endian, C order) in base64."""
    a = np.ascontiguousarray(array)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def decode(d: dict[str, Any]) -> np.ndarray:
    """The inverse of :func:`encode`."""
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"])


def create_session(model: str, engine: str = "ortmem", threads: int | None = None) -> Any:
    """The session a worker serves: ``ortmem.InferenceSession`` (warm start from the cache) or plain ORT."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    if engine == "ort":
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    if engine != "ortmem":
        raise ValueError(f"ORTMEM_SERVE_ENGINE must be one of {ENGINES}, not {engine!r}")
    from ortmem.session.inference import InferenceSession

    return InferenceSession(model, so, providers=["CPUExecutionProvider"])


def create_app(session: Any, *, engine: str = "ortmem", model: str = "",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_input_elements: int = DEFAULT_MAX_INPUT_ELEMENTS,
               max_total_elements: int = DEFAULT_MAX_TOTAL_ELEMENTS,
               max_output_elements: int = DEFAULT_MAX_OUTPUT_ELEMENTS,
               check_indices: bool = True) -> Any:
    """A Starlette app serving ``session`` (``/info``, ``/run``; module docstring).

    A request the client got wrong is answered 400, 413 or 422 with ``{"error": reason}`` and never
    reaches ORT (``ortmem.serve.request_checks`` says which code when); the limits bound what one request
    may ask of the worker (0 turns one off). With ``check_indices`` and a ``model`` path, indices
    fed to the model's Gathers are checked against their tables before the run.
    """
    from starlette.applications import Starlette
    from starlette.routing import Route

    limits = Limits(max_body_bytes, max_input_elements, max_total_elements, max_output_elements)
    runner = _Runner(session, limits, gather_index_bounds(model) if check_indices and model else {})
    created_pid = os.getpid()

    async def info(request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({
            "pid": os.getpid(), "created_pid": created_pid, "engine": engine, "model": model,
            "cache_hit": getattr(session, "ortmem_cache_hit", None),
            "inputs": [{"name": i.name, "shape": i.shape, "type": i.type} for i in session.get_inputs()],
            "outputs": list(runner.outputs), "limits": asdict(limits),
        })

    return Starlette(routes=[Route("/info", info), Route("/run", runner.run, methods=["POST"])])


class _Runner:
    """``POST /run``: checks the request (``ortmem.serve.request_checks``), runs it off the event loop,
    and tells the client's mistakes (4xx, no traceback) from the server's (500, logged)."""

    def __init__(self, session: Any, limits: Limits, index_bounds: dict[str, int]):
        self.session, self.limits, self.index_bounds = session, limits, index_bounds
        self.inputs = specs(session.get_inputs())
        self.outputs = specs(session.get_outputs())

    def feeds(self, body: dict[str, Any]) -> tuple[list[str], dict[str, np.ndarray]]:
        """The outputs asked and the feeds, every check passed (:class:`RequestRejected` otherwise)."""
        names = request_outputs(body, list(self.outputs))
        given = request_inputs(body, self.inputs)
        feeds = {n: decode_b64_tensor(n, v, self.inputs[n], self.limits) for n, v in given.items()}
        check_request(feeds, self.inputs, [self.outputs[n] for n in names], self.limits, self.index_bounds)
        return names, feeds

    async def run(self, request: Any) -> Any:
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse

        try:
            names, feeds = self.feeds(parse_json_object(await read_body(request, self.limits.max_body_bytes)))
        except RequestRejected as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        except ClientDisconnect:  # nobody is left to answer
            return JSONResponse({"error": "client disconnected"}, status_code=400)
        try:
            outputs = await run_in_threadpool(self.session.run, names, feeds)  # keep the event loop free
        except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind types; sorted just below
            rejected = ort_client_error(exc)
            if rejected is not None:
                return JSONResponse({"error": str(rejected)}, status_code=rejected.status)
            log.exception("run failed")
            return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)
        return JSONResponse({"pid": os.getpid(), "outputs": {n: encode(o) for n, o in zip(names, outputs)}})


def app_from_env() -> Any:
    """The app gunicorn/uvicorn import as ``ortmem.serve.server:app``, configured by the environment."""
    model = os.environ.get("ORTMEM_SERVE_MODEL")
    if not model:
        raise RuntimeError("set ORTMEM_SERVE_MODEL to the model to serve (see ortmem.serve.server)")
    engine = os.environ.get("ORTMEM_SERVE_ENGINE", "ortmem")
    threads = int(os.environ.get("ORTMEM_SERVE_THREADS", "0")) or None
    limits = Limits.from_env(os.environ)
    check_indices = os.environ.get("ORTMEM_SERVE_CHECK_INDICES", "1") != "0"
    return create_app(create_session(model, engine, threads), engine=engine, model=model,
                      check_indices=check_indices, **asdict(limits))


def __getattr__(name: str) -> Any:
    # ``ortmem.serve.server:app`` is built on first access (importing the module alone creates nothing).
    if name == "app":
        global app
        app = app_from_env()
        return app
    raise AttributeError(name)
