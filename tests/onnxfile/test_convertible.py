"""Whether a model file may hold a DequantizeLinear ortmem converts, read from its structure
(:mod:`ortmem.onnxfile.convertible`): never False where the rules convert (every DQ graph the rule
tests build, QDQ models mutated the way the fuzz tests mutate them), and False on ORT's own int8 QDQ
quantization, whose starts then hand the model to ORT without importing onnx."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T

from ortmem.onnxfile.convertible import may_convert
from ortmem.onnxfile.loader import load
from ortmem.onnxfile.scan import read_facts
from ortmem.passes.engine import plan_conversion
from tests.support import dq_graphs as dq
from tests.support.builders import matmul_chain, save
from tests.support.fuzz_models import mutate_model, qdq_seed


def _plans_work(data: bytes, folder: Path) -> bool:
    """Whether ortmem's rules rewrite the serialized model (None: the loader refuses it)."""
    path = folder / "model.onnx"
    path.write_bytes(data)
    model = load(path)
    try:
        return plan_conversion(model).has_work
    finally:
        model.store.close()


@pytest.fixture(scope="module")
def int8_qdq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ORT's ``quantize_static`` of a small MatMul chain in QDQ format (int8 weights and activations),
    its weights embedded: DequantizeLinear on every weight, none of them ortmem's to convert."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    folder = tmp_path_factory.mktemp("int8qdq")
    source = save(matmul_chain(np.random.default_rng(3), [64, 256, 256, 32]), folder / "fp32.onnx")
    rng = np.random.default_rng(4)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{"x": rng.standard_normal((2, 64), dtype=np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    path = folder / "model.onnx"
    quantize_static(str(source), str(path), Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return path


def _dq_graphs() -> dict[str, onnx.ModelProto]:
    graphs = {f"matmul-{T.DataType.Name(t) if t in T.DataType.values() else t}": dq.dq_mm(wtype=t, tag=str(t))
              for t in (T.INT4, T.UINT4, T.INT8, T.UINT8, dq.INT2, dq.UINT2, T.INT16)}
    graphs["matmul-per-channel"] = dq.dq_mm(wtype=T.INT8, attrs=dict(axis=1), scale_shape=[dq.N], tag="pc")
    graphs.update({f"gather-{name}": m for name, (m, _) in dq.hand_gather_models().items()})
    graphs.update({f"fp16-{name}": m for name, (m, _) in dq.fp16_graphs().items()})
    return graphs


@pytest.mark.parametrize("name", sorted(_dq_graphs()))
def test_never_false_where_the_rules_convert(name: str, tmp_path: Path):
    data = _dq_graphs()[name].SerializeToString()
    assert may_convert(data, name) or not _plans_work(data, tmp_path)


def test_never_false_on_mutated_qdq_models(int8_qdq: Path, tmp_path: Path):
    """The fuzz tests' structural and wire edits of two int4 DQ+MatMul patterns (one inside an If) and
    of ORT's int8 QDQ quantization: wherever the loader reads the result and the rules rewrite it, the
    structure said they may."""
    rng = np.random.default_rng(11)
    seeds = [qdq_seed(np.random.default_rng(0)), qdq_seed(np.random.default_rng(1), subgraph=True),
             onnx.load(int8_qdq)]
    converted = 0
    for case in range(240):
        data = mutate_model(seeds[case % 3], rng)
        folder = tmp_path / str(case)
        folder.mkdir()
        try:
            works = _plans_work(data, folder)
        except Exception:  # noqa: BLE001 - the loader refuses it: nothing to compare
            continue
        converted += works
        assert may_convert(data, f"case {case}") or not works, f"case {case}: converted, though the structure said no"
    assert converted >= 40  # the property was asked of models the rules do convert


def _structure(nodes, inits, inputs) -> bytes:
    return dq.model(nodes, inputs, [dq.vi("Y", [2, dq.N])], inits).SerializeToString()


def test_what_no_rule_converts_is_false():
    """A MatMul whose input A comes from a DQ too (a QDQ activation), a DQ feeding only input A, an
    int8 Gather table, and a weight type no kernel takes: the answers the rules give (checked above)."""
    w, s = dq.wt("W", [dq.K, dq.N], T.INT8), dq.st("S", [1])
    a_q, a_s = dq.wt("Aq", [2, dq.K], T.INT8), dq.st("As", [1])
    activation = [dq.dqn(name="dq", axis=0), dq.dqn("Aq", "As", out="Ad", name="dqa"), dq.mm(a="Ad")]
    assert not may_convert(_structure(activation, [w, s, a_q, a_s], []), "activation")
    swapped = [dq.dqn(name="dq"), dq.mm(a="Wd", b="B")]
    assert not may_convert(_structure(swapped, [w, s], [dq.vi("B", [dq.N, dq.N])]), "input A")
    table = dq.dq_gather("int8", wtype=T.INT8, attrs=dict(axis=0))
    assert not may_convert(table.SerializeToString(), "int8 table")
    wide = dq.dq_mm(wtype=T.INT16, tag="int16")
    assert not may_convert(wide.SerializeToString(), "int16")
    assert may_convert(dq.dq_mm().SerializeToString(), "int4")


def test_ort_quantizer_int8_qdq_holds_nothing_to_convert(int8_qdq: Path, tmp_path: Path):
    data = int8_qdq.read_bytes()
    assert b"DequantizeLinear" in data
    assert not may_convert(data, str(int8_qdq))
    assert not read_facts(int8_qdq).convertible
    assert not _plans_work(data, tmp_path)  # the rules agree


def test_its_start_hands_it_to_ort_without_onnx(int8_qdq: Path, tmp_path: Path):
    """A fresh process: ``ortmem.InferenceSession`` on the int8 QDQ file imports no onnx, no loader and no
    pass, and its outputs are ORT's own, bit for bit."""
    code = f"""
import sys
import numpy as np
import onnxruntime as ort
import ortmem
x = {{"x": np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)}}
s = ortmem.InferenceSession({str(int8_qdq)!r}, providers=["CPUExecutionProvider"], cache={str(tmp_path / "cache")!r})
loaded = sorted(m for m in sys.modules if m == "onnx" or m.startswith(("ortmem.passes", "ortmem.onnxfile.loader")))
got = s.run(None, x)[0]
want = ort.InferenceSession({str(int8_qdq)!r}, providers=["CPUExecutionProvider"]).run(None, x)[0]
print(s.ortmem_action, loaded, np.array_equal(got, want))
"""
    for _ in range(2):  # the walk, then its record
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        assert out[0] in ("as-is", "mapped") and out[1] == "[]" and out[2] == "True", out


def test_a_hooked_program_takes_the_light_route(int8_qdq: Path, tmp_path: Path):
    """``ortmem run`` on a program that creates ORT's own session on the int8 QDQ file: the hook decides
    from the file's bytes (no onnx imported in the program), with ORT's outputs."""
    script = tmp_path / "app.py"
    script.write_text(f"""
import sys
import numpy as np
import onnxruntime as ort
x = {{"x": np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)}}
s = ort.InferenceSession({str(int8_qdq)!r}, providers=["CPUExecutionProvider"])
np.save(sys.argv[1], s.run(None, x)[0])
print(getattr(s, "ortmem_action", None), "onnx" in sys.modules)
""")
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(tmp_path / "cache")}
    hooked = subprocess.run([sys.executable, "-m", "ortmem", "run", "--", str(script), str(tmp_path / "hooked.npy")],
                            capture_output=True, text=True, check=True, env=env).stdout.split()
    subprocess.run([sys.executable, str(script), str(tmp_path / "plain.npy")], check=True, capture_output=True)
    assert hooked[0] in ("as-is", "mapped") and hooked[1] == "False", hooked
    assert np.array_equal(np.load(tmp_path / "hooked.npy"), np.load(tmp_path / "plain.npy"))
