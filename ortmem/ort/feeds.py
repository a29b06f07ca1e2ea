"""Deterministic first-run inputs and a stable hash of the outputs.

Inputs come from the session's own metadata so any model can be probed without the user writing
feeds; they are deterministic (seeded) so two strategies on the same model get identical feeds and
their output hashes can be compared. Integer inputs stay small (< ``int_high``, default 100)
because they are usually token ids feeding a Gather: a random int64 would index out of range.

Decoders are fed as their first step is: an empty KV cache (past length 0), a mask as long as past and
new tokens together, positions counted from the past length, and the lengths an attention op reads
(``seqlens_k``, ``total_sequence_length``) consistent with them. A cache input's symbolic head count
and head size (``kv_cache_dim``) cannot be guessed: :func:`decoder_dims` reads them from the model
folder's ``genai_config.json``, else from the model's attention nodes.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from ortmem.base.dtypes import ORT_NUMPY_TYPES

DEFAULT_DIMS: dict[str, int] = {"batch": 1, "seq": 8, "past": 0}
DEFAULT_INT_HIGH = 100
#: Names of the sizes :func:`decoder_dims` finds, as keys of ``options["dims"]``.
HEAD_SIZE, KV_HEADS = "head_size", "kv_heads"
#: Symbolic dim names that stand for the head size (some exporters name a cache's last dim so).
HEAD_SIZE_NAMES = frozenset({"head_size", "head_dim", "kv_cache_dim", "hidden_per_head"})
#: Attention ops (com.microsoft, and ONNX's own Attention from opset 23) whose attributes give head counts.
ATTENTION_OPS = frozenset({"GroupQueryAttention", "MultiHeadAttention", "Attention", "SparseAttention",
                           "DecoderMaskedMultiHeadAttention", "PagedAttention"})
#: Where onnxruntime-genai keeps a folder's model sizes (``model.decoder``).
GENAI_CONFIG_NAME = "genai_config.json"


def resolve_dim(dim: Any, dims: Mapping[str, int]) -> int:
    """A concrete size for one dimension: ints stay, named dims come from ``dims`` or a heuristic.

    Heuristic for unnamed/unknown symbols: anything mentioning "batch" is ``dims["batch"]`` (1), "past"
    the past length (0), "total" past plus sequence, a head-size name (``kv_cache_dim``...) the head size
    where ``dims`` has one; everything else is ``dims["seq"]`` (8): sequence-like axes are by far the
    common symbolic case.
    """
    return _dim_size(dim, dims, None)


def _sizes(dims: Mapping[str, int]) -> dict[str, int]:
    return {**DEFAULT_DIMS, **dims}


def _role_size(role: str, dims: Mapping[str, int]) -> Optional[int]:
    """The size of an axis by its role (None: unknown, the caller falls back)."""
    if role == "total":
        return int(dims["past"]) + int(dims["seq"])
    value = dims.get(role)
    return None if value is None else int(value)


def _dim_size(dim: Any, dims: Mapping[str, int], role: Optional[str]) -> int:
    """One axis: a fixed size stays; a name ``dims`` gives wins; then the name's own meaning; then the
    axis's ``role`` in its input (a cache's head count, past length, head size; a mask's total length)."""
    if isinstance(dim, int) and dim >= 0:
        return dim
    dims = _sizes(dims)
    name = str(dim) if dim is not None else ""
    if name in dims:
        return int(dims[name])
    lname = name.lower()
    by_name = ("batch" if "batch" in lname else "past" if "past" in lname else "total" if "total" in lname
               else HEAD_SIZE if lname in HEAD_SIZE_NAMES or "head_size" in lname or "head_dim" in lname else None)
    for guess in (by_name, role):
        size = _role_size(guess, dims) if guess else None
        if size is not None:
            return size
    return int(dims["seq"])


def is_cache_input(name: str) -> bool:
    """A KV-cache input by its name: ``past_key_values.0.key``, ``past_key``, ``cache.3.value``... (not a
    rotary ``cos_cache``/``sin_cache`` table)."""
    lname = name.lower()
    if "cos_cache" in lname or "sin_cache" in lname:
        return False
    return "past" in lname or "cache" in lname


def _axis_roles(name: str, rank: int) -> list[Optional[str]]:
    """Each axis's role in input ``name``: a cache is ``[batch, heads, past, head_size]`` (ORT's
    attention ops and genai's builder; a leading 2 for packed key/value), a mask ends with the total
    length."""
    roles: list[Optional[str]] = [None] * rank
    if is_cache_input(name) and rank >= 4:
        roles[-4:] = ["batch", KV_HEADS, "past", HEAD_SIZE]
    elif "mask" in name.lower() and rank >= 1:
        roles[-1] = "total"
    return roles


def input_shape(name: str, shape: Any, dims: Mapping[str, int]) -> tuple[int, ...]:
    """The concrete shape of input ``name`` whose metadata shape is ``shape``."""
    shape = list(shape or [])
    roles = _axis_roles(name, len(shape))
    return tuple(_dim_size(d, dims, role) for d, role in zip(shape, roles))


def make_inputs(session: Any, options: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Feeds for ``session.run`` built from ``session.get_inputs()``.

    ``options["dims"]`` maps symbolic dim names to sizes (and ``"batch"``, ``"seq"``, ``"past"``,
    :data:`HEAD_SIZE`, :data:`KV_HEADS`: :func:`decoder_dims`); ``options["int_high"]`` bounds integer
    values (exclusive). Inputs whose name contains "mask" are all ones and "position" inputs count
    past, past + 1, ... along the last axis, so attention models see a valid, causal-looking batch;
    ``seqlens_k`` holds total - 1 and ``total_sequence_length`` (``past_sequence_length``) the total
    (past) length, as ORT's attention ops read them.
    """
    options = dict(options or {})
    dims = _sizes(options.get("dims", {}))
    int_high = int(options.get("int_high", DEFAULT_INT_HIGH))
    past, total = int(dims["past"]), int(dims["past"]) + int(dims["seq"])
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for meta in session.get_inputs():
        shape = input_shape(meta.name, meta.shape, dims)
        dtype = ORT_NUMPY_TYPES.get(meta.type)
        if dtype is None:
            raise ValueError(f"cannot generate input {meta.name!r} of type {meta.type}")
        lname = meta.name.lower()
        if dtype is np.str_:
            arr = np.full(shape, "a", dtype=object)
        elif dtype is np.bool_:
            arr = np.ones(shape, dtype=np.bool_)
        elif np.issubdtype(dtype, np.integer):
            if "mask" in lname:
                arr = np.ones(shape, dtype=dtype)
            elif "seqlens" in lname:
                arr = np.full(shape, total - 1, dtype=dtype)
            elif "total_seq" in lname:
                arr = np.full(shape, total, dtype=dtype)
            elif "past_seq" in lname:
                arr = np.full(shape, past, dtype=dtype)
            elif "position" in lname and shape:
                arr = np.broadcast_to(np.arange(past, past + shape[-1], dtype=dtype), shape).copy()
            else:
                hi = min(int_high, int(np.iinfo(dtype).max) + 1)
                arr = rng.integers(0, max(hi, 1), size=shape).astype(dtype)
        else:
            arr = rng.standard_normal(size=shape).astype(dtype)
        feeds[meta.name] = arr
    return feeds


def decoder_dims(model_path: Path) -> dict[str, int]:
    """The head size and KV head count a decoder's cache inputs need (``options["dims"]`` entries
    :data:`HEAD_SIZE`, :data:`KV_HEADS`; {} for a model with no attention): the ``model.decoder``
    section of ``genai_config.json`` beside the model where there is one (``head_size``,
    ``num_key_value_heads``, else ``hidden_size / num_attention_heads``), else the model's own
    attention nodes (:func:`attention_dims`)."""
    dims = _genai_dims(Path(model_path).parent / GENAI_CONFIG_NAME)
    if HEAD_SIZE in dims and KV_HEADS in dims:
        return dims
    return {**attention_dims(Path(model_path)), **dims}


def _positive(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _genai_dims(config_path: Path) -> dict[str, int]:
    """Head size and KV heads from a genai config's ``model.decoder`` ({} without a readable one)."""
    try:
        decoder = json.loads(config_path.read_text())["model"]["decoder"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(decoder, dict):
        return {}
    heads, hidden = _positive(decoder.get("num_attention_heads")), _positive(decoder.get("hidden_size"))
    head = _positive(decoder.get("head_size")) or (hidden // heads if heads and hidden and hidden % heads == 0 else None)
    kv = _positive(decoder.get("num_key_value_heads")) or heads
    return {k: v for k, v in ((HEAD_SIZE, head), (KV_HEADS, kv)) if v}


def attention_dims(model_path: Path) -> dict[str, int]:
    """Head size and KV heads from the model itself: a cache input's fixed dims where it has them,
    else the first attention node's ``num_heads``/``kv_num_heads`` (``q_num_heads`` for ONNX's
    Attention) and its query width as the installed ORT resolves it (GroupQueryAttention with packed
    QKV: ``(num_heads + 2 kv_num_heads) * head_size``; com.microsoft Attention: its weight's width / 3)."""
    import onnx  # here: the feed maker of a probe child loads no onnx
    from onnx import helper

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    dims: dict[str, int] = {}
    for value in graph.input:
        fixed = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
        if is_cache_input(value.name) and len(fixed) >= 4:
            for role, size in zip((KV_HEADS, HEAD_SIZE), fixed[-3::2]):
                if size and role not in dims:
                    dims[role] = size
    nodes = [n for n in graph.node if n.op_type in ATTENTION_OPS and n.domain in ("", "com.microsoft")]
    if not nodes or (HEAD_SIZE in dims and KV_HEADS in dims):
        return dims
    node = nodes[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    heads = _positive(attrs.get("num_heads")) or _positive(attrs.get("q_num_heads"))
    kv = _positive(attrs.get("kv_num_heads")) or heads
    if kv:
        dims.setdefault(KV_HEADS, kv)
    if HEAD_SIZE in dims or not heads:
        return dims
    width = _attention_width(model, node, attrs)
    if node.op_type == "GroupQueryAttention" and (len(node.input) < 2 or not node.input[1]):
        parts = heads + 2 * (kv or heads)  # query, key and value packed in one input
    else:
        parts = heads
    if width and width % parts == 0:
        dims[HEAD_SIZE] = width // parts
    return dims


def _attention_width(model: Any, node: Any, attrs: Mapping[str, Any]) -> Optional[int]:
    """The hidden width an attention node's heads split (None where it cannot be told)."""
    from ortmem.ort.value_types import ValueTypes

    if node.op_type == "Attention" and node.domain == "com.microsoft":
        sizes = attrs.get("qkv_hidden_sizes")
        if sizes:
            return int(sizes[0])
        weights = {t.name: list(t.dims) for t in model.graph.initializer}.get(node.input[1] if len(node.input) > 1 else "")
        return weights[-1] // 3 if weights and weights[-1] % 3 == 0 else None
    info = ValueTypes(model).get("", node.input[0])
    if info is None or not info.shape:
        return None
    kind, value = info.shape[-1]
    if kind != "v":
        return None
    if node.op_type == "Attention" and node.domain == "" and len(info.shape) == 4:
        return int(value) * int(attrs.get("q_num_heads") or 1)  # [batch, heads, seq, head_size]
    return int(value)


def hash_outputs(names: list[str], outputs: list[Any]) -> str:
    """sha256 over each output's name, dtype, shape and bytes, in output order.

    Equal hashes mean bit-identical outputs; strategies that only change *how* weights get into
    memory must produce the same hash as plain ORT.
    """
    h = hashlib.sha256()
    for name, out in zip(names, outputs):
        h.update(name.encode() + b"\0")
        if isinstance(out, np.ndarray):
            arr = np.ascontiguousarray(out)
            h.update(str(arr.dtype).encode() + b"\0" + repr(arr.shape).encode() + b"\0")
            if arr.dtype == object:
                h.update(repr(arr.tolist()).encode())
            else:
                h.update(arr.tobytes())
        else:  # sequence / map outputs: their repr is deterministic for equal contents
            h.update(b"object\0" + repr(out).encode())
    return h.hexdigest()


def describe_outputs(names: list[str], outputs: list[Any]) -> list[dict[str, Any]]:
    """Name, dtype and shape of each output, for the report (the hash alone is opaque)."""
    desc = []
    for name, out in zip(names, outputs):
        if isinstance(out, np.ndarray):
            desc.append({"name": name, "dtype": str(out.dtype), "shape": list(out.shape)})
        else:
            desc.append({"name": name, "dtype": type(out).__name__, "shape": None})
    return desc
