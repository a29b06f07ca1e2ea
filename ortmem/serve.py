"""A small HTTP inference server for several worker processes (extra ``ortmem[serve]``).

The recipe (docs/workers.md)::

    ORTMEM_SERVE_MODEL=model.onnx gunicorn -w 4 -k uvicorn_worker.UvicornWorker \\
        --bind 127.0.0.1:8000 ortmem.serve:app            # add --preload to create it before fork

The session is created when this module is imported: in every worker without ``--preload``, once
in gunicorn's master before it forks the workers with ``--preload``. Both work: a session created
before ``fork()`` keeps working in the children (tested with ORT's thread pool on; the children
share its pages copy-on-write). With ortmem's warm start the weights are mapped from the cache
entry, so the page cache holds one copy for all workers either way; preloading only saves the
imports and the small private rest.

Environment: ``ORTMEM_SERVE_MODEL`` (required), ``ORTMEM_SERVE_ENGINE`` = ``ortmem`` (default) or
``ort`` (plain ``onnxruntime.InferenceSession``, to compare), ``ORTMEM_SERVE_THREADS`` (ORT's intra-op
threads per worker; default ORT's choice), ``ORTMEM_CACHE_DIR`` as everywhere.

HTTP: ``GET /info`` -> the serving pid, the pid that created the session, inputs and outputs;
``POST /run`` with ``{"inputs": {name: {"dtype", "shape", "b64"}}}`` (raw little-endian bytes,
base64) -> ``{"pid", "outputs": {name: {"dtype", "shape", "b64"}}}``: exact, unlike JSON floats.
"""
from __future__ import annotations

import base64
import os
from typing import Any

import numpy as np

ENGINES = ("ortmem", "ort")


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
    import ortmem

    return ortmem.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def create_app(session: Any, *, engine: str = "ortmem", model: str = "") -> Any:
    """A Starlette app serving ``session`` (``/info``, ``/run``; module docstring)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    created_pid = os.getpid()
    names = [o.name for o in session.get_outputs()]

    async def info(request: Request) -> JSONResponse:
        return JSONResponse({
            "pid": os.getpid(), "created_pid": created_pid, "engine": engine, "model": model,
            "cache_hit": getattr(session, "ortmem_cache_hit", None),
            "inputs": [{"name": i.name, "shape": i.shape, "type": i.type} for i in session.get_inputs()],
            "outputs": names,
        })

    async def run(request: Request) -> JSONResponse:
        body = await request.json()
        try:
            feeds = {name: decode(v) for name, v in body["inputs"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            return JSONResponse({"error": f"bad inputs: {exc}"}, status_code=400)
        outputs = await run_in_threadpool(session.run, None, feeds)  # keep the event loop free
        return JSONResponse({"pid": os.getpid(), "outputs": {n: encode(o) for n, o in zip(names, outputs)}})

    return Starlette(routes=[Route("/info", info), Route("/run", run, methods=["POST"])])


def app_from_env() -> Any:
    """The app gunicorn/uvicorn import as ``ortmem.serve:app``, configured by the environment."""
    model = os.environ.get("ORTMEM_SERVE_MODEL")
    if not model:
        raise RuntimeError("set ORTMEM_SERVE_MODEL to the model to serve (see ortmem.serve)")
    engine = os.environ.get("ORTMEM_SERVE_ENGINE", "ortmem")
    threads = int(os.environ.get("ORTMEM_SERVE_THREADS", "0")) or None
    return create_app(create_session(model, engine, threads), engine=engine, model=model)


def __getattr__(name: str) -> Any:
    # ``ortmem.serve:app`` is built on first access (importing the module alone creates nothing).
    if name == "app":
        global app
        app = app_from_env()
        return app
    raise AttributeError(name)
