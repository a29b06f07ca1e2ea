"""Synthetic models for recompute and order planning: tensors built once and read by every layer.

Exporters (``torch.onnx.export`` of Hugging Face decoders) build the 4-D attention mask and the rotary
position tables once, in the model's forward, and hand the same tensors to every layer. In an ONNX
graph that makes them values produced near the start and consumed by the last layer, alive through
every layer's attention peak, although they come from the inputs through a handful of cheap ops.
These builders reproduce that structure with fp32 weights (deterministic, seeded), so the recompute
planner (:mod:`ortmem.plan.recompute`) can be measured against ONNX Runtime at long sequence lengths.

* :func:`llama_shared_mask`: a Llama-shaped decoder as Hugging Face's eager attention exports it:
  ``mask = causal(Range, Greater, Where, Expand) + padding(attention_mask)`` of shape
  ``[batch, 1, seq, seq]``, rotary ``cos``/``sin`` of shape ``[1, 1, seq, head_dim]`` from
  ``inv_freq @ positions`` (a MatMul: the expensive class), RMS norm from primitives, per layer a
  ``Slice`` of the mask (``attention_mask[:, :, :, :kv_len]``), rotary Q/K, scaled scores + mask,
  Softmax, SiLU MLP, residuals, an LM head.
* :func:`t5_shared_bias`: a T5-shaped encoder: the relative-position bias ``[1, heads, seq, seq]`` is
  computed once (bucketed ``|i - j|`` through Abs/Less/Log/Div/Mul/Cast/Min/Where, a ``Gather`` from the
  bias table, Transpose, plus the padding mask) and added to the scores of every layer.
* :func:`unet_skip`: a small convolutional encoder-decoder with long skip connections (Concat of early
  feature maps into late decoder stages).

Weights are embedded; models carry IR 10 (ORT 1.31 rejects onnx 1.23's default IR 14), opset 17.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
OPSET = 17
F = TensorProto.FLOAT
I64 = TensorProto.INT64


class _B:
    """Node/initializer accumulator with unique names."""

    def __init__(self, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self._n = 0
        self._consts: dict[tuple, str] = {}

    def op(self, op: str, inputs: list[str], name: str, n_out: int = 1, **attrs) -> str | list[str]:
        outs = [name] if n_out == 1 else [f"{name}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.float32, name: str | None = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if name is None and key in self._consts:
            return self._consts[key]
        self._n += 1
        n = name or f"const_{self._n}"
        self.inits.append(numpy_helper.from_array(arr, n))
        if name is None:
            self._consts[key] = n
        return n

    def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        """A random fp32 weight named ``<name>.weight`` (node outputs carry the bare name)."""
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * scale).astype(np.float32),
                                                  name + ".weight"))
        return name + ".weight"


def _model(b: _B, name: str, inputs, outputs) -> onnx.ModelProto:
    g = helper.make_graph(b.nodes, name, inputs, outputs, b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                          producer_name="ortmem.plan.recompute_models")
    return m


# ---------------------------------------------------------------------------------------- Llama
@dataclass(frozen=True)
class LlamaMaskConfig:
    """Shape of :func:`llama_shared_mask`. Everything that changes a byte is a field."""

    layers: int = 4
    hidden: int = 128
    heads: int = 2
    intermediate: int = 344
    vocab: int = 512
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def llama_shared_mask(config: LlamaMaskConfig = LlamaMaskConfig()) -> onnx.ModelProto:
    """A Llama-shaped fp32 decoder whose mask and rotary tables are built once (see module docstring).

    Inputs ``input_ids`` and ``attention_mask`` (int64 ``[batch, seq]``), output ``logits``
    ``[batch, seq, vocab]``.
    """
    c = config
    b = _B(c.seed)
    H, nh, d = c.hidden, c.heads, c.head_dim
    neg = float(np.finfo(np.float32).min)
    x = b.op("Gather", [b.weight("embed_tokens", (c.vocab, H), 1.0), "input_ids"], "embed")

    # ---- shared causal + padding mask [B, 1, S, S] (HF _prepare_4d_causal_attention_mask)
    shape = b.op("Shape", ["input_ids"], "mask.shape")
    bsz = b.op("Gather", [shape, b.const(0, np.int64)], "mask.batch", axis=0)
    seq = b.op("Gather", [shape, b.const(1, np.int64)], "mask.seq", axis=0)
    r = b.op("Range", [b.const(0, np.int64), seq, b.const(1, np.int64)], "mask.arange")
    row = b.op("Unsqueeze", [r, b.const([1], np.int64)], "mask.rows")
    col = b.op("Unsqueeze", [r, b.const([0], np.int64)], "mask.cols")
    future = b.op("Greater", [col, row], "mask.future")
    causal = b.op("Where", [future, b.const(neg), b.const(0.0)], "mask.causal")
    causal4 = b.op("Unsqueeze", [causal, b.const([0, 1], np.int64)], "mask.causal4")
    one = b.const([1], np.int64)
    bsz1 = b.op("Unsqueeze", [bsz, b.const([0], np.int64)], "mask.batch1")
    seq1 = b.op("Unsqueeze", [seq, b.const([0], np.int64)], "mask.seq1")
    full_shape = b.op("Concat", [bsz1, one, seq1, seq1], "mask.full_shape", axis=0)
    causal_b = b.op("Expand", [causal4, full_shape], "mask.expand")
    pad = b.op("Unsqueeze", ["attention_mask", b.const([1, 2], np.int64)], "mask.pad4")
    pad = b.op("Cast", [pad], "mask.pad_float", to=F)
    pad = b.op("Sub", [b.const(1.0), pad], "mask.pad_invert")
    pad = b.op("Mul", [pad, b.const(neg)], "mask.pad_min")
    mask = b.op("Add", [causal_b, pad], "mask.combined")

    # ---- shared rotary tables cos/sin [1, 1, S, d] (HF LlamaRotaryEmbedding: inv_freq @ positions)
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    pos = b.op("Cast", [r], "rope.positions", to=F)
    pos = b.op("Unsqueeze", [pos, b.const([0, 1], np.int64)], "rope.positions3")  # [1, 1, S]
    inv = b.const(inv_freq.reshape(1, d // 2, 1))  # [1, d/2, 1]
    freqs = b.op("MatMul", [inv, pos], "rope.freqs")  # [1, d/2, S]
    freqs = b.op("Transpose", [freqs], "rope.freqs_t", perm=[0, 2, 1])  # [1, S, d/2]
    emb = b.op("Concat", [freqs, freqs], "rope.emb", axis=-1)
    cos = b.op("Unsqueeze", [b.op("Cos", [emb], "rope.cos"), b.const([1], np.int64)], "rope.cos4")
    sin = b.op("Unsqueeze", [b.op("Sin", [emb], "rope.sin"), b.const([1], np.int64)], "rope.sin4")

    eps, half = b.const(1e-6), d // 2
    heads_shape = b.const([0, 0, nh, d], np.int64)
    hidden_shape = b.const([0, 0, H], np.int64)

    def rms(v: str, tag: str) -> str:
        sq = b.op("Pow", [v, b.const(2.0)], f"{tag}.pow")
        ms = b.op("ReduceMean", [sq], f"{tag}.mean", axes=[-1], keepdims=1)
        den = b.op("Sqrt", [b.op("Add", [ms, eps], f"{tag}.add_eps")], f"{tag}.sqrt")
        y = b.op("Div", [v, den], f"{tag}.div")
        w = b.const(1.0 + 0.05 * b.rng.standard_normal(H), name=f"{tag}.gamma")
        return b.op("Mul", [y, w], f"{tag}.mul")

    def rotate(v: str, tag: str) -> str:
        x1 = b.op("Slice", [v, b.const([0], np.int64), b.const([half], np.int64), b.const([-1], np.int64)], f"{tag}.x1")
        x2 = b.op("Slice", [v, b.const([half], np.int64), b.const([d], np.int64), b.const([-1], np.int64)], f"{tag}.x2")
        rot = b.op("Concat", [b.op("Neg", [x2], f"{tag}.neg"), x1], f"{tag}.rot", axis=-1)
        return b.op("Add", [b.op("Mul", [v, cos], f"{tag}.mul_cos"), b.op("Mul", [rot, sin], f"{tag}.mul_sin")],
                    f"{tag}.rope")

    w_in = 1.0 / math.sqrt(H)
    for li in range(c.layers):
        p = f"layers.{li}"
        h = rms(x, f"{p}.input_norm")
        qkv = {}
        for t in ("q", "k", "v"):
            y = b.op("MatMul", [h, b.weight(f"{p}.{t}_proj", (H, H), w_in)], f"{p}.{t}_proj")
            y = b.op("Reshape", [y, heads_shape], f"{p}.{t}_heads")
            qkv[t] = b.op("Transpose", [y], f"{p}.{t}_t", perm=[0, 2, 1, 3])
        q = rotate(qkv["q"], f"{p}.q")
        k = rotate(qkv["k"], f"{p}.k")
        kt = b.op("Transpose", [k], f"{p}.k_tt", perm=[0, 1, 3, 2])
        s = b.op("MatMul", [q, kt], f"{p}.qk")
        s = b.op("Div", [s, b.const(math.sqrt(d))], f"{p}.scale")
        kv_len = b.op("Unsqueeze", [b.op("Gather", [b.op("Shape", [k], f"{p}.k_shape"), b.const(2, np.int64)],
                                         f"{p}.kv_len", axis=0), b.const([0], np.int64)], f"{p}.kv_len1")
        m = b.op("Slice", [mask, b.const([0], np.int64), kv_len, b.const([3], np.int64)], f"{p}.mask_slice")
        s = b.op("Add", [s, m], f"{p}.masked")
        s = b.op("Softmax", [s], f"{p}.softmax", axis=-1)
        a = b.op("MatMul", [s, qkv["v"]], f"{p}.pv")
        a = b.op("Reshape", [b.op("Transpose", [a], f"{p}.merge_t", perm=[0, 2, 1, 3]), hidden_shape], f"{p}.merge")
        o = b.op("MatMul", [a, b.weight(f"{p}.o_proj", (H, H), w_in / math.sqrt(2 * c.layers))], f"{p}.o_proj")
        x = b.op("Add", [x, o], f"{p}.attn_residual")
        h = rms(x, f"{p}.post_norm")
        gate = b.op("MatMul", [h, b.weight(f"{p}.gate_proj", (H, c.intermediate), w_in)], f"{p}.gate_proj")
        up = b.op("MatMul", [h, b.weight(f"{p}.up_proj", (H, c.intermediate), w_in)], f"{p}.up_proj")
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate], f"{p}.sigmoid")], f"{p}.silu")
        act = b.op("Mul", [act, up], f"{p}.gated")
        down = b.op("MatMul", [act, b.weight(f"{p}.down_proj", (c.intermediate, H),
                                             1.0 / math.sqrt(c.intermediate * 2 * c.layers))], f"{p}.down_proj")
        x = b.op("Add", [x, down], f"{p}.mlp_residual")
    h = rms(x, "norm")
    b.op("MatMul", [h, b.weight("lm_head", (H, c.vocab), w_in)], "logits")
    return _model(b, "llama_shared_mask",
                  [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
                   helper.make_tensor_value_info("attention_mask", I64, ["batch", "seq"])],
                  [helper.make_tensor_value_info("logits", F, ["batch", "seq", c.vocab])])


# ------------------------------------------------------------------------------------------- T5
@dataclass(frozen=True)
class T5BiasConfig:
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    ff: int = 256
    vocab: int = 512
    buckets: int = 32
    max_distance: int = 128
    seed: int = 0


def t5_shared_bias(config: T5BiasConfig = T5BiasConfig()) -> onnx.ModelProto:
    """A T5-shaped encoder: bidirectional relative-position bias computed once, added in every layer.

    Inputs ``input_ids``/``attention_mask`` int64 ``[batch, seq]``; output ``hidden`` ``[batch, seq, hidden]``.
    """
    c = config
    b = _B(c.seed)
    H, nh = c.hidden, c.heads
    d = H // nh
    x = b.op("Gather", [b.weight("embed_tokens", (c.vocab, H), 1.0), "input_ids"], "embed")
    shape = b.op("Shape", ["input_ids"], "bias.shape")
    seq = b.op("Gather", [shape, b.const(1, np.int64)], "bias.seq", axis=0)
    r = b.op("Range", [b.const(0, np.int64), seq, b.const(1, np.int64)], "bias.arange")
    ctx = b.op("Unsqueeze", [r, b.const([1], np.int64)], "bias.ctx")
    mem = b.op("Unsqueeze", [r, b.const([0], np.int64)], "bias.mem")
    rel = b.op("Sub", [mem, ctx], "bias.relative")  # [S, S] int64
    # T5 _relative_position_bucket, bidirectional
    nb = c.buckets // 2
    pos_side = b.op("Mul", [b.op("Cast", [b.op("Greater", [rel, b.const(0, np.int64)], "bias.gt0")], "bias.gt0_i",
                                 to=I64), b.const(nb, np.int64)], "bias.side")
    rel = b.op("Abs", [rel], "bias.abs")
    max_exact = nb // 2
    small = b.op("Less", [rel, b.const(max_exact, np.int64)], "bias.is_small")
    relf = b.op("Cast", [rel], "bias.rel_f", to=F)
    large = b.op("Div", [b.op("Log", [b.op("Div", [relf, b.const(float(max_exact))], "bias.ratio")], "bias.log"),
                         b.const(math.log(c.max_distance / max_exact))], "bias.log_ratio")
    large = b.op("Mul", [large, b.const(float(nb - max_exact))], "bias.scaled")
    large = b.op("Cast", [large], "bias.scaled_i", to=I64)
    large = b.op("Add", [large, b.const(max_exact, np.int64)], "bias.shift")
    large = b.op("Min", [large, b.const(nb - 1, np.int64)], "bias.clip")
    bucket = b.op("Add", [pos_side, b.op("Where", [small, rel, large], "bias.pick")], "bias.bucket")
    values = b.op("Gather", [b.weight("relative_attention_bias", (c.buckets, nh), 0.5), bucket], "bias.values")
    values = b.op("Transpose", [values], "bias.heads_first", perm=[2, 0, 1])  # [nh, S, S]
    values = b.op("Unsqueeze", [values, b.const([0], np.int64)], "bias.values4")
    pad = b.op("Cast", [b.op("Unsqueeze", ["attention_mask", b.const([1, 2], np.int64)], "bias.pad4")], "bias.pad_f", to=F)
    pad = b.op("Mul", [b.op("Sub", [b.const(1.0), pad], "bias.pad_invert"), b.const(float(np.finfo(np.float32).min))],
               "bias.pad_min")
    bias = b.op("Add", [values, pad], "bias.position_bias")  # [B, nh, S, S]

    heads_shape = b.const([0, 0, nh, d], np.int64)
    hidden_shape = b.const([0, 0, H], np.int64)
    for li in range(c.layers):
        p = f"block.{li}"
        sq = b.op("Pow", [x, b.const(2.0)], f"{p}.ln0.pow")
        ms = b.op("ReduceMean", [sq], f"{p}.ln0.mean", axes=[-1], keepdims=1)
        h = b.op("Div", [x, b.op("Sqrt", [b.op("Add", [ms, b.const(1e-6)], f"{p}.ln0.eps")], f"{p}.ln0.sqrt")],
                 f"{p}.ln0.div")
        qkv = {}
        for t in ("q", "k", "v"):
            y = b.op("MatMul", [h, b.weight(f"{p}.{t}", (H, H), 1 / math.sqrt(H))], f"{p}.{t}")
            qkv[t] = b.op("Transpose", [b.op("Reshape", [y, heads_shape], f"{p}.{t}_heads")], f"{p}.{t}_t",
                          perm=[0, 2, 1, 3] if t != "k" else [0, 2, 3, 1])
        s = b.op("MatMul", [qkv["q"], qkv["k"]], f"{p}.qk")
        s = b.op("Add", [s, bias], f"{p}.biased")
        s = b.op("Softmax", [s], f"{p}.softmax", axis=-1)
        a = b.op("MatMul", [s, qkv["v"]], f"{p}.pv")
        a = b.op("Reshape", [b.op("Transpose", [a], f"{p}.merge_t", perm=[0, 2, 1, 3]), hidden_shape], f"{p}.merge")
        x = b.op("Add", [x, b.op("MatMul", [a, b.weight(f"{p}.o", (H, H), 0.5 / math.sqrt(H))], f"{p}.o")],
                 f"{p}.attn_residual")
        y = b.op("Relu", [b.op("MatMul", [x, b.weight(f"{p}.wi", (H, c.ff), 1 / math.sqrt(H))], f"{p}.wi")], f"{p}.relu")
        x = b.op("Add", [x, b.op("MatMul", [y, b.weight(f"{p}.wo", (c.ff, H), 0.5 / math.sqrt(c.ff))], f"{p}.wo")],
                 f"{p}.ff_residual")
    b.op("Identity", [x], "hidden")
    return _model(b, "t5_shared_bias",
                  [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
                   helper.make_tensor_value_info("attention_mask", I64, ["batch", "seq"])],
                  [helper.make_tensor_value_info("hidden", F, ["batch", "seq", H])])


# ------------------------------------------------------------------------------------------ conv
@dataclass(frozen=True)
class UNetConfig:
    channels: tuple[int, ...] = (16, 32, 64)
    in_channels: int = 3
    seed: int = 0


def unet_skip(config: UNetConfig = UNetConfig()) -> onnx.ModelProto:
    """A small U-Net: conv-relu stages, max-pool down, resize up, Concat with the encoder's feature map
    of the same resolution (a long skip), a final 1x1 conv. Input ``image`` ``[batch, C, height, width]``."""
    c = config
    b = _B(c.seed)

    def conv(v: str, cin: int, cout: int, tag: str, k: int = 3) -> str:
        w = b.weight(f"{tag}", (cout, cin, k, k), math.sqrt(2.0 / (cin * k * k)))
        bias = b.const(np.zeros(cout), name=f"{tag}.bias")
        return b.op("Relu", [b.op("Conv", [v, w, bias], f"{tag}.conv", pads=[k // 2] * 4)], f"{tag}.relu")

    v, cin = "image", c.in_channels
    skips: list[tuple[str, int]] = []
    for i, ch in enumerate(c.channels):
        v = conv(conv(v, cin, ch, f"enc{i}.a"), ch, ch, f"enc{i}.b")
        cin = ch
        if i < len(c.channels) - 1:
            skips.append((v, ch))
            v = b.op("MaxPool", [v], f"enc{i}.pool", kernel_shape=[2, 2], strides=[2, 2])
    for i, (skip, ch) in reversed(list(enumerate(skips))):
        v = b.op("Resize", [v, "", b.const([1.0, 1.0, 2.0, 2.0])], f"dec{i}.up", mode="nearest")
        v = b.op("Concat", [v, skip], f"dec{i}.cat", axis=1)
        v = conv(conv(v, cin + ch, ch, f"dec{i}.a"), ch, ch, f"dec{i}.b")
        cin = ch
    w = b.weight("head", (1, cin, 1, 1), 1.0 / math.sqrt(cin))
    b.op("Conv", [v, w], "mask")
    return _model(b, "unet_skip", [helper.make_tensor_value_info("image", F, ["batch", c.in_channels, "height", "width"])],
                  [helper.make_tensor_value_info("mask", F, ["batch", 1, "height", "width"])])
