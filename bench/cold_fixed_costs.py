"""What a cold start holds that the twin's process does not, measured piece by piece in fresh processes.

    python bench/cold_fixed_costs.py            # medians of 5 fresh interpreters

A cold start (``ortmem.InferenceSession`` on an empty cache) peaks while ORT creates its session on
the freshly written entry; what it still holds then, beyond what a process running the twin with
plain ORT holds, is fixed (independent of the model's size):

* ``session_path``: ortmem's session path imported (``onnx`` and ortmem's loader, converter,
  cache), above ``numpy`` + ``onnxruntime``;
* ``shape_registry``: the first ``onnx.shape_inference.infer_shapes`` call, which builds onnx's
  operator schema registry in its C++ extension; the fusion matcher needs inferred shapes to replay
  ORT's MatMulAddFusion conditions exactly, and the registry is never freed.

Each figure is RssAnon (private) and RssFile (shared) growth in KiB (``ortmem.measure.procfs.read_status``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import json
from ortmem.measure.procfs import read_status
def status():
    now = read_status("self")
    return {k: now[k] >> 10 for k in ("RssAnon", "RssFile")}
import numpy, onnxruntime
base = status()
import ortmem.session, onnx, onnx.helper, onnx.shape_inference
imported = status()
g = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
                           [onnx.helper.make_tensor_value_info("X", 1, [2, 4]),
                            onnx.helper.make_tensor_value_info("W", 1, [4, 4])],
                           [onnx.helper.make_tensor_value_info("Y", 1, None)])
onnx.shape_inference.infer_shapes(onnx.helper.make_model(g))
inferred = status()
print(json.dumps({"session_path": {k: imported[k] - base[k] for k in base},
                  "shape_registry": {k: inferred[k] - imported[k] for k in base}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(args.repeat)]
    print(f"fixed costs of a cold start, KiB (median of {args.repeat} fresh processes)")
    for part in ("session_path", "shape_registry"):
        anon = statistics.median(r[part]["RssAnon"] for r in runs)
        file = statistics.median(r[part]["RssFile"] for r in runs)
        print(f"  {part:15s} private {anon:8.0f}  shared {file:8.0f}")


if __name__ == "__main__":
    main()
