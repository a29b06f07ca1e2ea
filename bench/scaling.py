"""Does ortmem's cost grow linearly with model size? Conversion planning + writing over 100..3,200
DQ+MatMul patterns, and ``ortmem.load`` over 1e3..1e5 initializers against ``onnx.load``.

    python -m bench.scaling                    # the full sweep (a few minutes)
    python -m bench.scaling --quick            # 100..800 patterns, 1e3..1e5 initializers (CI check)
    python -m bench.scaling --only load        # the loader alone (also: --only convert)
    python -m bench.scaling --only load --kinds tiny,embedded,external --initializers 1000,10000

Prints one line per size (seconds, seconds per pattern / per initializer) and the ratios the issue
asks for: per-pattern time at 800 vs 100 (target <= 2x), ``ortmem.load`` vs ``onnx.load`` at 1e5
tiny initializers (target <= 2x, wall clock). Load kinds: ``tiny`` (1 KiB tensors, kept inline: the
issue's case), ``embedded`` (4100-byte tensors in the .onnx, which ortmem describes as external data
pointing into the file) and ``external`` (the same in an external data file). Each load line also
gives the CPU-time ratio (this process's CPU: steadier than wall on a shared machine) and the cost
per initializer. Models are built in a temporary folder and removed. Times are best of ``--repeat``,
ortmem and onnx alternating.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
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


def initializers_model(n: int, floats: int = 256) -> onnx.ModelProto:
    """``n`` initializers of ``floats`` float32 each (256: 1 KiB, kept inline), a few summed into the
    output: a loader stress test."""
    inits = [numpy_helper.from_array(np.full(floats, i, np.float32), f"c{i}") for i in range(n)]
    nodes = [helper.make_node("Sum", [t.name for t in inits[:8]], ["y"])]
    g = helper.make_graph(nodes, "many", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [floats])], inits)
    m = helper.make_model(g, opset_imports=OPSET)
    m.ir_version = IR_VERSION
    return m


#: Load kinds: float32 elements per initializer, and whether the weights go to an external file.
LOAD_KINDS = {"tiny": (256, False), "embedded": (1025, False), "external": (1025, True)}


def write_initializers_model(n: int, folder: Path, kind: str = "tiny") -> Path:
    floats, external = LOAD_KINDS[kind]
    path = folder / f"{kind}{n}.onnx"
    onnx.save(initializers_model(n, floats), path, save_as_external_data=external, location=f"{kind}{n}.data",
              size_threshold=0)
    return path


@dataclass
class LoadTiming:
    """Best-of wall and CPU seconds of ``ortmem.load`` and ``onnx.load`` on one file."""

    n: int
    ortmem_wall: float
    onnx_wall: float
    ortmem_cpu: float
    onnx_cpu: float

    @property
    def wall_ratio(self) -> float:
        return self.ortmem_wall / self.onnx_wall

    @property
    def cpu_ratio(self) -> float:
        return self.ortmem_cpu / self.onnx_cpu


def time_load_file(path: Path, n: int, repeat: int) -> LoadTiming:
    """``ortmem.load`` (with the skeleton checked and the model closed) against ``onnx.load`` (weights
    read, as it does by default), alternating, best of ``repeat`` each, wall and CPU apart."""
    import ortmem

    def ortmem_load():
        with ortmem.load(path) as m:
            assert len(m.skeleton.graph.initializer) == n

    def onnx_load():
        assert len(onnx.load(str(path)).graph.initializer) == n

    walls: dict = {ortmem_load: [], onnx_load: []}
    cpus: dict = {ortmem_load: [], onnx_load: []}
    for _ in range(repeat):
        for fn in (ortmem_load, onnx_load):
            c, t = time.process_time(), time.perf_counter()
            fn()
            walls[fn].append(time.perf_counter() - t)
            cpus[fn].append(time.process_time() - c)
    return LoadTiming(n, min(walls[ortmem_load]), min(walls[onnx_load]), min(cpus[ortmem_load]), min(cpus[onnx_load]))


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def time_conversion(n: int, folder: Path, repeat: int) -> float:
    import ortmem
    from ortmem.store.writer import write_converted
    from ortmem.ort.settings import session_settings
    from ortmem.passes.engine import plan_conversion

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


def time_load(n: int, folder: Path, repeat: int, kind: str = "tiny") -> LoadTiming:
    path = write_initializers_model(n, folder, kind)
    try:
        return time_load_file(path, n, repeat)
    finally:
        for f in folder.glob(f"{kind}{n}.*"):
            f.unlink()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["convert", "load"])
    ap.add_argument("--kinds", default="tiny", help=f"load kinds, comma-separated: {', '.join(LOAD_KINDS)}")
    ap.add_argument("--initializers", default="1000,10000,100000", help="initializer counts, comma-separated")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    patterns = [100, 200, 400, 800] + ([] if args.quick else [1600, 3200])
    initializers = [int(n) for n in args.initializers.split(",")]
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(LOAD_KINDS):
        ap.error(f"unknown load kinds {sorted(unknown)}")
    folder = Path(tempfile.mkdtemp(prefix="ortmem-scaling-"))
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, python {sys.version.split()[0]}")
    try:
        if args.only != "load":
            per = {}
            for n in patterns:
                t = time_conversion(n, folder, args.repeat)
                per[n] = t / n
                print(f"convert {n:5d} patterns: {t:7.3f} s  {1e3 * t / n:6.3f} ms/pattern", flush=True)
            print(f"per-pattern time, 800 vs 100: {per[800] / per[100]:.2f}x (target <= 2x)")
        if args.only != "convert":
            for kind in kinds:
                for n in initializers:
                    r = time_load(n, folder, args.repeat, kind)
                    target = " (target <= 2x at 1e5)" if kind == "tiny" else ""
                    print(f"load {n:6d} {kind} initializers: ortmem.load {r.ortmem_wall:6.3f} s "
                          f"({1e6 * r.ortmem_wall / n:5.1f} us each), onnx.load {r.onnx_wall:6.3f} s "
                          f"({1e6 * r.onnx_wall / n:5.1f} us each), ratio {r.wall_ratio:.2f}x{target}; "
                          f"CPU ratio {r.cpu_ratio:.2f}x", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
