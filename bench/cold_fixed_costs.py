"""What a cold start's type questions cost a process, measured piece by piece in fresh processes.

    python -m bench.cold_fixed_costs            # medians of 5 fresh interpreters

A cold start (``ortmem.InferenceSession`` on an empty cache) peaks while ORT creates its session on
the freshly written entry; what it holds then beyond a process running the native twin with plain
ORT is fixed, not proportional to the model. Rows, each the RssAnon (private) and RssFile (shared)
growth in KiB (``ortmem.base.procfs.read_status``), on a matcher-sized graph (the tiny synthetic
decoder: every MatMul -> residual Add asks MatMulAddFusion's shape questions):

* ``session_path``: ortmem's session path imported (``onnx`` and ortmem's loader, converter,
  cache), above ``numpy`` + ``onnxruntime``; the probe's baseline holds it for every strategy alike;
* ``ort_types``: the value types the fusion matcher asks, resolved by the installed ORT
  (``ortmem.ort.value_types``), measured after ORT's environment exists, as it does in the twin's
  process once its session is created;
* ``onnx_types``, for comparison: the same types from ``onnx.shape_inference``, which the matcher
  used before: its first call builds onnx's operator schema registry, never freed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import json
from ortmem.base.procfs import read_status
def status():
    now = read_status("self")
    return {k: now[k] >> 10 for k in ("RssAnon", "RssFile")}
def grew(a, b):
    return {k: b[k] - a[k] for k in a}
import numpy, onnxruntime
base = status()
import ortmem.session.inference, onnx.shape_inference
from ortmem.ort.value_types import ValueTypes, onnx_inferred_types
imported = status()
from ortmem.measure.synth import SynthConfig, build_model
model = build_model(SynthConfig.tiny())
onnxruntime.InferenceSession(onnx.helper.make_model(onnx.helper.make_graph(
    [onnx.helper.make_node("Relu", ["X"], ["Y"])], "g", [onnx.helper.make_tensor_value_info("X", 1, [1])],
    [onnx.helper.make_tensor_value_info("Y", 1, [1])])).SerializeToString(), providers=["CPUExecutionProvider"])
ready = status()
assert ValueTypes(model).get("", "model.embed_tokens.gather") is not None
by_ort = status()
onnx_inferred_types(model)
by_onnx = status()
print(json.dumps({"session_path": grew(base, imported), "ort_types": grew(ready, by_ort),
                  "onnx_types": grew(by_ort, by_onnx)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(args.repeat)]
    print(f"fixed costs of a cold start, KiB (median of {args.repeat} fresh processes)")
    for part in ("session_path", "ort_types", "onnx_types"):
        anon = statistics.median(r[part]["RssAnon"] for r in runs)
        file = statistics.median(r[part]["RssFile"] for r in runs)
        print(f"  {part:15s} private {anon:8.0f}  shared {file:8.0f}")


if __name__ == "__main__":
    main()
