"""ORT's int8 QDQ quantization, the models ortmem hands to ORT as they are: the two files the starts of
``docs/benchmarks.md`` ("Models ortmem converts nothing in") are measured on.

    python -m bench.int8_qdq DIR
    ORTMEM_CACHE_DIR=$(mktemp -d) ortmem bench DIR/chain/model.onnx -s ort -s ortmem -s ortmem-warm -n 7 --whole-process
    ORTMEM_CACHE_DIR=$(mktemp -d) ortmem bench DIR/chain-external/model.onnx -s ort -s ortmem -s ortmem-warm -n 7 --whole-process
    ORTMEM_CACHE_DIR=$(mktemp -d) ortmem bench DIR/minilm-int8-qdq/model.onnx -s ort -s ortmem -n 11 --whole-process

``DIR/chain/model.onnx``: ``onnxruntime.quantization.quantize_static`` in QDQ format (int8 weights and
activations) of a five-layer MatMul chain (256-1024-1024-1024-1024-256, random weights, 4 random
calibration batches), weights embedded (3.6 MB); ``DIR/chain-external/model.onnx``: the same with its
weights in ``model.onnx.data`` (below the finished-entry threshold: ortmem gains nothing on any of its
starts, and checks its references from the file's bytes). ``DIR/minilm-int8-qdq/model.onnx``: the per-class
bench's int8 QDQ MiniLM (:func:`bench.model_classes.minilm_int8_qdq`, weights in ``model.onnx.data``).
Every DequantizeLinear of both feeds a MatMul whose other input is dequantized too, which ORT's rule
(so ortmem's) does not fuse: their starts decide that from the file's structure
(:mod:`ortmem.onnxfile.convertible`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tests.support.builders import matmul_chain, save

WIDTHS = [256, 1024, 1024, 1024, 1024, 256]


def chain_int8_qdq(folder: Path) -> Path:
    """The quantized chain at ``folder/chain/model.onnx`` (made once)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    path = folder / "chain" / "model.onnx"
    if path.exists():
        return path
    source = save(matmul_chain(np.random.default_rng(3), WIDTHS), folder / "chain" / "fp32.onnx")
    rng = np.random.default_rng(4)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{"x": rng.standard_normal((2, WIDTHS[0]), dtype=np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(source), str(path), Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return path


def chain_external(folder: Path) -> Path:
    """The quantized chain with its weights as external data, at ``folder/chain-external/model.onnx``."""
    import onnx

    path = folder / "chain-external" / "model.onnx"
    if not path.exists():
        save(onnx.load(chain_int8_qdq(folder)), path, external=True)
    return path


def main(argv: list[str]) -> None:
    from bench.model_classes import minilm_int8_qdq

    folder = Path(argv[0] if argv else "int8-qdq")
    for path in (chain_int8_qdq(folder), chain_external(folder), minilm_int8_qdq(folder)):
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
