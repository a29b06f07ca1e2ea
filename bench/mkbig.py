"""Build the fp32 handoff example of docs/handoff.md: a 256 MiB embedding table and 128 MiB of
MatMul weights, saved embedded (big/emb.onnx) and with external data (big/ext/ext.onnx).

    python -m bench.mkbig [OUT_DIR]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tests.support import builders as mb


def build() -> "helper.ModelProto":
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((65536, 1024), dtype=np.float32), "table")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h0"])]
    cur = "h0"
    for i in range(8):
        k, n = (1024, 4096) if i % 2 == 0 else (4096, 1024)
        w = rng.standard_normal((k, n), dtype=np.float32) / np.float32(32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        nodes.append(helper.make_node("MatMul", [cur, f"W{i}"], [f"h{i + 1}"]))
        cur = f"h{i + 1}"
    graph = helper.make_graph(
        nodes, "big", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["batch", "seq", 1024])], inits)
    return mb.make_model(graph)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "big")
    model = build()
    mb.save(model, out / "emb.onnx")
    mb.save(model, out / "ext" / "ext.onnx", external=True)
    print(f"wrote {out / 'emb.onnx'} and {out / 'ext' / 'ext.onnx'}")
