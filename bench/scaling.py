"""Does ortmem's cost grow linearly with model size? Conversion planning + writing over 100..3,200
DQ+MatMul patterns, and ``ortmem.load`` over 1e3..1e5 tiny initializers against ``onnx.load``.

    python bench/scaling.py                    # the full sweep (a few minutes)
    python bench/scaling.py --quick            # 100..800 patterns, 1e3..1e5 initializers (CI check)

Prints one line per size (seconds, seconds per pattern / per initializer) and the ratios the issue
asks for: per-pattern time at 800 vs 100 (target <= 2x), ``ortmem.load`` vs ``onnx.load`` at 1e5
(target <= 2x). Models are built in a temporary folder and removed. Times are best of ``--repeat``.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10
OPSET = [helper.make_opsetid("", 21)]


def patterns_model(n: int, k: int = 64, width: int = 64, block: int = 32) -> onnx.ModelProto:
    """``n`` DequantizeLinear(int4, blockwise) + MatMul patterns in a chain (each one ORT fuses)."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    x = "x"
    for i in range(n):
        packed = rng.integers(0, 256, size=(k * width) // 2, dtype=np.uint8)
        inits.append(helper.make_tensor(f"W{i}_q", TensorProto.INT4, [k, width], packed.tobytes(), raw=True))
        inits.append(numpy_helper.from_array((rng.random((k // block, width), dtype=np.float32) * 0.02 + 0.01), f"W{i}_s"))
        nodes.append(helper.make_node("DequantizeLinear", [f"W{i}_q", f"W{i}_s"], [f"W{i}"], axis=0, block_size=block,
                                      name=f"dq{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"W{i}"], [f"y{i}"], name=f"mm{i}"))
        x = f"y{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])], inits)
    m = helper.make_model(g, opset_imports=OPSET)
    m.ir_version = IR_VERSION
    return m


def initializers_model(n: int) -> onnx.ModelProto:
    """``n`` tiny (1 KiB, kept inline) initializers, a few summed into the output: a loader stress test."""
    inits = [numpy_helper.from_array(np.full(256, i, np.float32), f"c{i}") for i in range(n)]
    nodes = [helper.make_node("Sum", [t.name for t in inits[:8]], ["y"])]
    g = helper.make_graph(nodes, "many", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256])], inits)
    m = helper.make_model(g, opset_imports=OPSET)
    m.ir_version = IR_VERSION
    return m


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def time_conversion(n: int, folder: Path, repeat: int) -> float:
    import ortmem
    from ortmem.convert import write_converted
    from ortmem.ortmodel.settings import session_settings
    from ortmem.passes.conversion import plan_conversion

    path = folder / f"p{n}.onnx"
    onnx.save(patterns_model(n), path)

    def run():
        out = folder / f"out{n}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        with ortmem.load(path) as model:
            plan = plan_conversion(model, session_settings())
            assert len(plan.rewrites) == n, f"{len(plan.rewrites)} of {n} patterns planned"
            write_converted(model, plan, out)

    return best_of(repeat, run)


def time_load(n: int, folder: Path, repeat: int) -> tuple[float, float]:
    import ortmem

    path = folder / f"i{n}.onnx"
    onnx.save(initializers_model(n), path)

    def ortmem_load():
        with ortmem.load(path) as m:
            assert len(m.skeleton.graph.initializer) == n

    return best_of(repeat, ortmem_load), best_of(repeat, lambda: onnx.load(str(path)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    patterns = [100, 200, 400, 800] + ([] if args.quick else [1600, 3200])
    initializers = [1000, 10000, 100000]
    folder = Path(tempfile.mkdtemp(prefix="ortmem-scaling-"))
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, python {sys.version.split()[0]}")
    try:
        per = {}
        for n in patterns:
            t = time_conversion(n, folder, args.repeat)
            per[n] = t / n
            print(f"convert {n:5d} patterns: {t:7.3f} s  {1e3 * t / n:6.3f} ms/pattern", flush=True)
        print(f"per-pattern time, 800 vs 100: {per[800] / per[100]:.2f}x (target <= 2x)")
        for n in initializers:
            ours, theirs = time_load(n, folder, args.repeat)
            print(f"load {n:6d} initializers: ortmem.load {ours:6.3f} s, onnx.load {theirs:6.3f} s, "
                  f"ratio {ours / theirs:.2f}x (target <= 2x at 1e5)", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
