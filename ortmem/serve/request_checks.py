"""Checks of an inference request before it reaches ORT, shared by ``ortmem.serve.server`` and the Ray Serve
deployment (``ortmem.plan.partition.ray.serving``).

Why a module of its own: a server must answer a client's mistake with a 4xx and the reason, never a
500 and a traceback in its log, and it must refuse a request too big to run *before* ORT allocates
for it (an oversized request can take many seconds and leave its worker GiBs larger for good:
glibc keeps what ORT freed). Both servers read the same kind of body, so the checks are
written once.

Status codes (one rule, both servers):

* **400** the request is not a request for this model: the body is empty, not UTF-8, not JSON,
  nested deeper than Python's parser goes, not an object; ``inputs`` is not an object of inputs;
  an input is malformed (no ``dtype``/``shape``/``b64``, bad base64, bytes that do not fill dtype x
  shape); an unknown, extra or missing input name; an unknown output name.
* **413** too big: the body (``max_body_bytes``, checked on ``Content-Length`` and while reading),
  one input's element count (``max_input_elements``), all inputs' (``max_total_elements``), or the
  outputs' predicted from the model's declared output shapes with the request's dims
  (``max_output_elements``): the outputs are what ORT allocates, ``[64, 512]`` token ids are
  32,768 elements but their logits are 64 x 512 x vocabulary floats.
* **422** well-formed, but values the model cannot take: a dtype or rank or fixed dim other than
  the model declares, one symbolic dim given two sizes, an index outside the table a ``Gather``
  reads (found in the model's graph, so the request is refused before ORT runs anything; ORT's
  ``Gather``, and the index check ortmem's GatherBlockQuantized rewrite puts before it, would raise
  too), and any run ORT refuses with ``INVALID_ARGUMENT`` (:func:`ort_client_error`).

Anything else that fails while running is the server's fault: a 500 with the traceback logged.
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from ortmem.errors import OrtmemError
from ortmem.onnxfile.loader import load
from ortmem.base.dtypes import ORT_NUMPY_TYPES
from ortmem.ort.value_types import ValueTypes
from ortmem.base.units import parse_bytes

log = logging.getLogger(__name__)

# Defaults, each a size a sane request stays far below and a worker survives. A base64 body is 4/3 of
# its tensors' bytes: 64 MiB carries 48 MiB of tensors (32 images of 3x224x224 float32 take 18 MiB).
DEFAULT_MAX_BODY_BYTES = 64 * 2**20
# 8 M elements: 32 MiB as float32 per input, twice that for all inputs together.
DEFAULT_MAX_INPUT_ELEMENTS = 2**23
DEFAULT_MAX_TOTAL_ELEMENTS = 2**24
# 16 M elements (64 MiB as float32) of predicted outputs: 512 positions' logits over a 32,000-token
# vocabulary pass, 64 x 512 of them (2^30 elements, 4 GiB) do not.
DEFAULT_MAX_OUTPUT_ELEMENTS = 2**24
# A body over the limit is read (not kept) up to this, so that a client still sending gets the 413.
DRAIN_MAX_BYTES = 256 * 2**20
# A shape with more dims than this is no tensor ORT runs (numpy stops at 64).
MAX_RANK = 64

#: The environment variables ``ortmem.serve.server.app_from_env`` reads, one per :class:`Limits` field.
LIMIT_ENV = {
    "max_body_bytes": "ORTMEM_SERVE_MAX_BODY_BYTES",
    "max_input_elements": "ORTMEM_SERVE_MAX_INPUT_ELEMENTS",
    "max_total_elements": "ORTMEM_SERVE_MAX_TOTAL_ELEMENTS",
    "max_output_elements": "ORTMEM_SERVE_MAX_OUTPUT_ELEMENTS",
}

BAD_REQUEST, TOO_LARGE, UNPROCESSABLE = 400, 413, 422


class RequestRejected(OrtmemError):
    """A request refused for the client's mistake: ``status`` is the HTTP code, the message the reason
    the client reads (``tensor`` names the input at fault)."""

    def __init__(self, status: int, message: str, *, tensor: str | None = None):
        self.status = status
        super().__init__(message, tensor=tensor)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of a worker; 0 turns a limit off."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_input_elements: int = DEFAULT_MAX_INPUT_ELEMENTS
    max_total_elements: int = DEFAULT_MAX_TOTAL_ELEMENTS
    max_output_elements: int = DEFAULT_MAX_OUTPUT_ELEMENTS

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Limits":
        """The defaults, each replaced by its variable of :data:`LIMIT_ENV` where set (``16MiB`` style
        byte counts for the body, plain integers for elements); a bad value stops the server at start."""
        values: dict[str, int] = {}
        for f in fields(cls):
            text = environ.get(LIMIT_ENV[f.name], "").strip()
            if not text:
                continue
            try:
                value = parse_bytes(text) if f.name == "max_body_bytes" else int(text)
            except ValueError:
                raise ValueError(f"{LIMIT_ENV[f.name]}={text!r} is not a count") from None
            if value < 0:
                raise ValueError(f"{LIMIT_ENV[f.name]}={text!r} is negative (0 turns the limit off)")
            values[f.name] = value
        return cls(**values)


def _over(count: int, limit: int) -> bool:
    return limit > 0 and count > limit


@dataclass(frozen=True)
class TensorSpec:
    """A declared input or output: numpy dtype (None for a type with none, e.g. a sequence) and dims
    (ints, symbol names, None for unknown; ``dims`` None when no shape is declared)."""

    name: str
    dtype: np.dtype | None
    dims: tuple[int | str | None, ...] | None

    @classmethod
    def of(cls, arg: Any) -> "TensorSpec":
        """From ORT's ``NodeArg`` (or anything with ``name``, ``type``, ``shape``)."""
        scalar = ORT_NUMPY_TYPES.get(arg.type)
        dims = None if arg.shape is None else tuple(d if isinstance(d, (int, str)) else None for d in arg.shape)
        return cls(arg.name, None if scalar is None else np.dtype(scalar), dims)


def specs(args: Iterable[Any]) -> dict[str, TensorSpec]:
    """``session.get_inputs()`` (or ``get_outputs()``) as :class:`TensorSpec` by name."""
    return {s.name: s for s in map(TensorSpec.of, args)}


# -- the body ---------------------------------------------------------------------------------------

async def read_body(request: Any, max_bytes: int) -> bytes:
    """The body of a Starlette request, never held past ``max_bytes`` (413). A body over the limit
    is still read, without being kept, up to :data:`DRAIN_MAX_BYTES`: a client answered while it is
    still sending gets a connection reset instead of the 413 (urllib did, 4 MiB over a 4 MiB limit).
    A ``Content-Length`` past that is answered at once, unread."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise RequestRejected(BAD_REQUEST, f"Content-Length {declared[:40]!r} is not a byte count")
    over = declared is not None and _over(int(declared), max_bytes)
    if over and int(declared) > DRAIN_MAX_BYTES:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        over = over or _over(size, max_bytes)
        if not over:
            chunks.append(chunk)
        elif size > DRAIN_MAX_BYTES:
            break
        else:
            chunks.clear()
    if over:
        raise _too_large(max_bytes)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> RequestRejected:
    return RequestRejected(TOO_LARGE, f"body is over the limit of {max_bytes} bytes")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 with the reason for anything else."""
    if not body.strip():
        raise RequestRejected(BAD_REQUEST, "empty body: send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestRejected(BAD_REQUEST, f"body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise RequestRejected(BAD_REQUEST, "JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers of more than 4300 digits
        raise RequestRejected(BAD_REQUEST, f"body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RequestRejected(BAD_REQUEST, f"body must be a JSON object, not {_json_kind(value)}")
    return value


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


# -- names ------------------------------------------------------------------------------------------

def request_inputs(body: Mapping[str, Any], declared: Mapping[str, TensorSpec], *,
                   require_all: bool = True) -> dict[str, Any]:
    """``body["inputs"]``: an object whose names the model declares (all of them with
    ``require_all``; the Ray pipeline asks only for the inputs its stages read)."""
    if "inputs" not in body:
        raise RequestRejected(BAD_REQUEST, 'no "inputs": send {"inputs": {name: tensor}}')
    inputs = body["inputs"]
    if not isinstance(inputs, dict):
        raise RequestRejected(BAD_REQUEST, f'"inputs" must be an object of name: tensor, not {_json_kind(inputs)}')
    unknown = sorted(set(inputs) - set(declared))
    if unknown:
        raise RequestRejected(BAD_REQUEST, f"unknown input(s) {_names(unknown)}; the model takes {sorted(declared)}")
    missing = [n for n in declared if n not in inputs] if require_all else []
    if missing:
        raise RequestRejected(BAD_REQUEST, f"missing input(s) {missing}; the model takes {sorted(declared)}")
    return inputs


def request_outputs(body: Mapping[str, Any], declared: Sequence[str]) -> list[str]:
    """``body["outputs"]``: a list of distinct output names; every output when absent, null or empty."""
    asked = body.get("outputs")
    if asked is None or asked == []:
        return list(declared)
    if not isinstance(asked, list) or not all(isinstance(n, str) for n in asked):
        raise RequestRejected(BAD_REQUEST, '"outputs" must be a list of output names')
    unknown = [n for n in asked if n not in declared]
    if unknown:
        raise RequestRejected(BAD_REQUEST, f"unknown output(s) {_names(unknown)}; the model's outputs are {list(declared)}")
    if len(set(asked)) != len(asked):
        raise RequestRejected(BAD_REQUEST, f'"outputs" names an output twice: {asked}')
    return asked


def _names(names: list[str], most: int = 5) -> str:
    """A client's names, shortened: they are echoed back and into logs."""
    shown = [n if len(n) <= 64 else n[:61] + "..." for n in names[:most]]
    return str(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


# -- one tensor -------------------------------------------------------------------------------------

def decode_b64_tensor(name: str, value: Any, spec: TensorSpec, limits: Limits) -> np.ndarray:
    """``{"dtype", "shape", "b64"}`` (``ortmem.serve.server``'s wire format) as the array the model takes.
    The dtype, shape and element count are checked before a byte is decoded."""
    if not isinstance(value, dict) or not all(k in value for k in ("dtype", "shape", "b64")):
        raise RequestRejected(BAD_REQUEST, 'each input must be an object {"dtype", "shape", "b64"}', tensor=name)
    dtype = _wire_dtype(name, value["dtype"], spec)
    shape = _wire_shape(name, value["shape"])
    check_shape(name, shape, spec, limits)
    if not isinstance(value["b64"], str):
        raise RequestRejected(BAD_REQUEST, '"b64" must be a base64 string', tensor=name)
    try:
        raw = base64.b64decode(value["b64"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestRejected(BAD_REQUEST, f'"b64" is not base64: {exc}', tensor=name) from None
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise RequestRejected(BAD_REQUEST, f"{len(raw)} bytes for shape {list(shape)} of {dtype.name}, "
                                           f"which takes {expected}", tensor=name)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(spec.dtype, copy=False)


def _wire_dtype(name: str, text: Any, spec: TensorSpec) -> np.dtype:
    """The client's dtype string, which must be the declared type (either byte order)."""
    if not isinstance(text, str) or len(text) > 32:
        raise RequestRejected(BAD_REQUEST, '"dtype" must be a numpy dtype string such as "<f4"', tensor=name)
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError, SyntaxError):
        raise RequestRejected(BAD_REQUEST, f"{text!r} is not a numpy dtype", tensor=name) from None
    if spec.dtype is None or spec.dtype.kind in "OU":
        raise RequestRejected(UNPROCESSABLE, "this input's type has no raw-bytes form; this server cannot feed it",
                              tensor=name)
    if dtype not in (spec.dtype, spec.dtype.newbyteorder("<"), spec.dtype.newbyteorder(">")):
        raise RequestRejected(UNPROCESSABLE, f"dtype {text!r}, but the model takes {spec.dtype.name}", tensor=name)
    return dtype


def _wire_shape(name: str, shape: Any) -> tuple[int, ...]:
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise RequestRejected(BAD_REQUEST, f'"shape" must be a list of at most {MAX_RANK} sizes >= 0', tensor=name)
    return tuple(shape)


def list_tensor(name: str, value: Any, spec: TensorSpec, limits: Limits) -> np.ndarray:
    """A nested JSON list (the Ray deployment's wire format) as the declared dtype and shape. Values of
    another kind (floats for an integer input, strings, nulls) and integers the dtype cannot hold are
    refused, not cast: numpy would truncate 1.5 to 1 and wrap 2**63 silently. (The body limit bounds
    the list numpy reads before its element count is known.)"""
    try:
        given = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise RequestRejected(UNPROCESSABLE, f"not a rectangular array of numbers: {exc}", tensor=name) from None
    check_shape(name, given.shape, spec, limits)
    if spec.dtype is None:
        return given
    if given.dtype.kind == "O" or not np.can_cast(given.dtype, spec.dtype, "same_kind"):
        raise RequestRejected(UNPROCESSABLE, f"values of type {given.dtype.name} for an input of {spec.dtype.name}",
                              tensor=name)
    if spec.dtype.kind in "iu" and given.size and given.dtype.kind in "iu":
        info = np.iinfo(spec.dtype)
        if given.min() < info.min or given.max() > info.max:
            raise RequestRejected(UNPROCESSABLE, f"values outside {spec.dtype.name}'s range", tensor=name)
    return given.astype(spec.dtype, copy=False)


def check_shape(name: str, shape: Sequence[int], spec: TensorSpec, limits: Limits) -> None:
    """Rank and fixed dims as declared (422); element count within ``max_input_elements`` (413)."""
    if spec.dims is not None:
        if len(shape) != len(spec.dims):
            raise RequestRejected(UNPROCESSABLE, f"rank {len(shape)} (shape {list(shape)}), but the model takes "
                                                 f"rank {len(spec.dims)} {list(spec.dims)}", tensor=name)
        fixed = [i for i, d in enumerate(spec.dims) if isinstance(d, int) and d >= 0 and d != shape[i]]
        if fixed:
            raise RequestRejected(UNPROCESSABLE, f"shape {list(shape)}, but the model takes {list(spec.dims)}",
                                  tensor=name)
    count = math.prod(shape)
    if _over(count, limits.max_input_elements):
        raise RequestRejected(TOO_LARGE, f"{count} elements (shape {list(shape)}) is over the limit of "
                                         f"{limits.max_input_elements} per input", tensor=name)


# -- the request as a whole ---------------------------------------------------------------------------

def check_request(feeds: Mapping[str, np.ndarray], inputs: Mapping[str, TensorSpec],
                  outputs: Sequence[TensorSpec], limits: Limits,
                  index_bounds: Mapping[str, int] | None = None) -> None:
    """What no single input shows: one symbolic dim given two sizes (422), all inputs' elements and
    the asked outputs' predicted elements within the limits (413), indices inside the tables that
    ``Gather`` nodes read (422; see :func:`gather_index_bounds`)."""
    sizes = bind_dims(feeds, inputs)
    total = sum(a.size for a in feeds.values())
    if _over(total, limits.max_total_elements):
        raise RequestRejected(TOO_LARGE, f"{total} input elements in all is over the limit of {limits.max_total_elements}")
    predicted = sum(predicted_elements(o, sizes) or 0 for o in outputs)
    if _over(predicted, limits.max_output_elements):
        raise RequestRejected(TOO_LARGE, f"the outputs would hold {predicted} elements (dims {sizes}), over the "
                                         f"limit of {limits.max_output_elements}")
    for name, bound in (index_bounds or {}).items():
        a = feeds.get(name)
        if a is not None and a.size and a.dtype.kind in "iu" and (a.min() < -bound or a.max() >= bound):
            bad = a[(a < -bound) | (a >= bound)].flat[0]
            raise RequestRejected(UNPROCESSABLE, f"index {bad} is outside [-{bound}, {bound - 1}], the table "
                                                 "a Gather of the model reads with it", tensor=name)


def bind_dims(feeds: Mapping[str, np.ndarray], inputs: Mapping[str, TensorSpec]) -> dict[str, int]:
    """Each symbolic dim's size in this request. ONNX names a dim to say it is the same in every
    value that names it; ORT does not check that, and a kernel that trips on it fails as an internal
    error, so a request giving one dim two sizes is refused here (422)."""
    sizes: dict[str, int] = {}
    where: dict[str, str] = {}
    for name, a in feeds.items():
        dims = inputs[name].dims or ()
        for d, n in zip(dims, a.shape):
            if not isinstance(d, str):
                continue
            if sizes.setdefault(d, n) != n:
                raise RequestRejected(UNPROCESSABLE, f"dim {d!r} is {n} here but {sizes[d]} in input "
                                                     f"{where[d]!r}", tensor=name)
            where.setdefault(d, name)
    return sizes


def predicted_elements(spec: TensorSpec, sizes: Mapping[str, int]) -> int | None:
    """An output's element count from its declared dims and the request's dim sizes; None when a dim
    is neither fixed nor named by an input (computed by the graph: not known before the run)."""
    if spec.dims is None:
        return None
    count = 1
    for d in spec.dims:
        n = d if isinstance(d, int) and d >= 0 else sizes.get(d) if isinstance(d, str) else None
        if n is None:
            return None
        count *= n
    return count


# -- what the model's graph says about index inputs ---------------------------------------------------

def gather_index_bounds(model: str | Path) -> dict[str, int]:
    """For each graph input that a main-graph ``Gather`` (or ``GatherBlockQuantized``) uses as its
    indices: the size of the table's gathered axis, from ORT's own resolved types. Indices must lie
    in ``[-size, size)``. ORT's Gather raises on others (ORT's GatherBlockQuantized would answer
    zeros, which is why ortmem's rewrite checks them with a Gather first); the server checks them
    itself so that a bad request costs no run. An extra check: a model whose graph cannot be read this
    way gets none (logged), and ORT's own checks still hold."""
    try:
        with load(model) as m:
            graph = m.skeleton.graph
            tables = {t.name: list(t.dims) for t in graph.initializer}
            graph_inputs = {i.name for i in graph.input} - set(tables)
            types = ValueTypes(m.skeleton)
            bounds: dict[str, int] = {}
            for node in graph.node:
                axis = _gathered_axis(node)
                if axis is None or len(node.input) < 2 or node.input[1] not in graph_inputs:
                    continue
                size = _axis_size(node.input[0], axis, tables, types)
                if size is not None:
                    bounds[node.input[1]] = min(size, bounds.get(node.input[1], size))
            return bounds
    except (OrtmemError, OSError, ValueError) as exc:
        log.warning("index inputs of %s are not checked before the run: %s", model, exc)
        return {}


def _axis_size(name: str, axis: int, tables: Mapping[str, list[int]], types: ValueTypes) -> int | None:
    """The size of ``axis`` of a gather's table: an initializer's dims, else ORT's resolved type
    (a table made by DequantizeLinear or Cast); None when not a fixed size."""
    if name in tables:
        dims: list[Any] = [("v", d) for d in tables[name]]
    else:
        info = types.get("", name)
        dims = info.shape if info is not None and info.shape else []
    if not -len(dims) <= axis < len(dims):
        return None
    kind, size = dims[axis]
    return size if kind == "v" else None


def _gathered_axis(node: Any) -> int | None:
    """The data axis a gather node indexes; None for other nodes and for a GatherBlockQuantized that
    gathers along its packed (quantized) axis, whose declared size is not the row count."""
    attrs = {a.name: a.i for a in node.attribute}
    if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
        return attrs.get("axis", 0)
    if node.op_type == "GatherBlockQuantized" and node.domain == "com.microsoft":
        gather, quantize = attrs.get("gather_axis", 0), attrs.get("quantize_axis", 1)
        return None if gather == quantize else gather
    return None


# -- what ORT says ------------------------------------------------------------------------------------

def ort_client_error(exc: BaseException) -> RequestRejected | None:
    """A run's exception as the client's mistake (422) when ORT refused the feeds' values
    (``INVALID_ARGUMENT``: an index out of range, a dim a kernel cannot take); None for anything
    else, which is the server's own failure."""
    if isinstance(exc, InvalidArgument):
        return RequestRejected(UNPROCESSABLE, f"onnxruntime refused the inputs: {exc}")
    return None
