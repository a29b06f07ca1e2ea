"""Small models for loader, session, cache and measurement tests: hand-built ones that each stress one way
weights are stored, and ``ortmem.measure.synth``'s tiny decoder written to a folder."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortmem.measure.synth import SynthConfig, write_model

OPSET = [helper.make_opsetid("", 21)]
IR_VERSION = 10  # onnx 1.23 writes IR 14 by default; ORT 1.31 reads up to 13


def make_model(graph: onnx.GraphProto, **kw) -> onnx.ModelProto:
    """``graph`` as a model every supported ORT reads: IR 10, opset 21 unless ``opset_imports`` is given."""
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=kw.pop("opset_imports", OPSET), **kw)


def save(model: onnx.ModelProto, path: Path, *, external: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        model = _copy(model)  # onnx's external save rewrites the proto it is given
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, path)
    return path


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def tiny_decoder(folder: Path, **config) -> Path:
    """``ortmem.measure.synth``'s tiny QDQ decoder (``SynthConfig.tiny(**config)``) written to ``folder/model.onnx``:
    the model of the conversion, cache and session tests, fed ``input_ids``."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_model(SynthConfig.tiny(**config), folder / "model.onnx")


def matmul_chain(rng: np.random.Generator, widths: list[int], *, name_prefix: str = "W",
                 bias_first: bool = False) -> onnx.ModelProto:
    """x -> MatMul(W0) -> Relu -> MatMul(W1) ... : fp32 weights of chosen sizes. ``bias_first``: an
    Add(b<i>) before each MatMul (:func:`biased_chain`)."""
    nodes, inits = [], []
    cur = "x"
    for i, (k, n) in enumerate(zip(widths[:-1], widths[1:])):
        if bias_first:
            inits.append(numpy_helper.from_array(rng.standard_normal(k, dtype=np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [cur, f"b{i}"], [f"a{i}"]))
            cur = f"a{i}"
        w = rng.standard_normal((k, n), dtype=np.float32) / np.float32(np.sqrt(k))
        inits.append(numpy_helper.from_array(w, f"{name_prefix}{i}"))
        nodes.append(helper.make_node("MatMul", [cur, f"{name_prefix}{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"]))
        cur = f"r{i}"
    g = helper.make_graph(
        nodes, "biased_chain" if bias_first else "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", widths[0]])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["batch", widths[-1]])],
        inits,
    )
    return make_model(g)


def biased_chain(rng: np.random.Generator, widths: list[int]) -> onnx.ModelProto:
    """x -> Add(b0) -> MatMul(W0) -> Relu -> Add(b1) ...: fp32 weights ORT pre-packs (each MatMul's) beside
    small ordinary ones it does not (each bias, one page of fp32 at width 1024). The bias comes before
    its MatMul, so ORT's MatMul+Add fusion leaves the MatMul's packing as saved (a prepared entry)."""
    return matmul_chain(rng, widths, bias_first=True)


def embedding_model(rng: np.random.Generator, vocab: int, hidden: int, out: int) -> onnx.ModelProto:
    """Gather from a big fp32 table, then a MatMul: one huge tensor plus a medium one."""
    table = rng.standard_normal((vocab, hidden), dtype=np.float32)
    w = rng.standard_normal((hidden, out), dtype=np.float32) / np.float32(np.sqrt(hidden))
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("MatMul", ["e", "W"], ["y"])],
        "emb",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", out])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "W")],
    )
    return make_model(g)


def many_small(rng: np.random.Generator, count: int, width: int = 16) -> onnx.ModelProto:
    """Hundreds of small initializers (Add biases) of various sizes, some at or below 127 bytes."""
    nodes, inits = [], []
    cur = "x"
    for i in range(count):
        size = width if i % 3 else 4  # 4 floats = 16 bytes: stays inline everywhere
        b = rng.standard_normal((size,), dtype=np.float32)
        if size != width:
            b = np.resize(b, (width,))
        inits.append(numpy_helper.from_array(b.astype(np.float32), f"b{i}"))
        nodes.append(helper.make_node("Add", [cur, f"b{i}"], [f"a{i}"]))
        cur = f"a{i}"
    g = helper.make_graph(
        nodes, "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [1, width])],
        inits,
    )
    return make_model(g)


def subgraph_model(rng: np.random.Generator, n: int = 128) -> onnx.ModelProto:
    """If with an initializer inside each branch, a Loop body using an outer-scope weight, a Constant
    node with a large tensor attribute, and a sparse initializer."""
    w_then = numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), "W_then")
    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W_then"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, n])], [w_then])
    w_else = numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), "W_else")
    else_g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W_else"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, n])], [w_else])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["acc_in", "W_outer"], ["mm"]),
         helper.make_node("Tanh", ["mm"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1, n])])
    dense = np.zeros((n, n), np.float32)
    idx = rng.choice(n * n, size=300, replace=False)
    dense.flat[idx] = rng.standard_normal(300).astype(np.float32)
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(dense.flat[np.sort(idx)].astype(np.float32), "S"),
        numpy_helper.from_array(np.sort(idx).astype(np.int64), "S_idx"), [n, n])
    const = numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), "C")
    nodes = [
        helper.make_node("If", ["c"], ["branch"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trip", "", "branch"], ["looped"], body=body),
        helper.make_node("Constant", [], ["Cval"], value=const),
        helper.make_node("MatMul", ["looped", "Cval"], ["m1"]),
        helper.make_node("MatMul", ["m1", "S"], ["y"]),
    ]
    g = helper.make_graph(
        nodes, "sub",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("trip", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32) / np.float32(n), "W_outer")],
        sparse_initializer=[sparse],
    )
    return make_model(g)


def int4_model(rng: np.random.Generator, k: int = 256, n: int = 128, block: int = 32) -> onnx.ModelProto:
    """A blockwise int4 DequantizeLinear feeding MatMul (packed sub-byte weights)."""
    codes = rng.integers(-8, 8, size=(k, n), dtype=np.int8)
    flat = (codes.flatten() & 0x0F).astype(np.uint8)
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)  # low nibble first, as ONNX packs int4
    w = helper.make_tensor("Wq", TensorProto.INT4, [k, n], packed.tobytes(), raw=True)
    scales = numpy_helper.from_array((rng.random((k // block, n), dtype=np.float32) * 0.02 + 0.01), "Ws")
    g = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Wq", "Ws"], ["W"], axis=0, block_size=block),
         helper.make_node("MatMul", ["x", "W"], ["y"])],
        "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [w, scales],
    )
    return make_model(g)


def embedding_relu_model(path: Path) -> Path:
    """ids[batch, seq] -> Gather(emb[100, 16]) -> MatMul -> Relu, saved to ``path``: symbolic dims, int64
    indices, weights small enough that a fresh-process probe measures the process, not the model."""
    rng = np.random.default_rng(0)
    emb = numpy_helper.from_array(rng.standard_normal((100, 16)).astype(np.float32), "emb")
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["emb", "ids"], ["e"]),
            helper.make_node("MatMul", ["e", "w"], ["m"]),
            helper.make_node("Relu", ["m"], ["y"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 16])],
        [emb, w],
    )
    onnx.save(make_model(graph), path)
    return path


def elementwise(path: Path, *, external: bool = True) -> Path:
    """``x * w + b`` over [1, 32, 16, 16]: ORT makes no weight of it and packs none (nothing to finish)."""
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.standard_normal((1, 32, 16, 16)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal((1, 32, 16, 16)).astype(np.float32), "b")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
                              "scale", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, b])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.save_model(proto, str(path), save_as_external_data=external, location=path.name + ".data", size_threshold=0)
    return path
