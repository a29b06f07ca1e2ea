"""ortmem.measure.synth: the synthetic decoders the demo, tests and benchmarks are built on."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortmem.passes.nbits import packing as nl
from ortmem.measure.synth import (SynthConfig, SynthError, build_model, cached_model, model_weight_bytes, write_model)
from tests.support.reference import run_plain

IDS = np.random.default_rng(0).integers(0, 1000, (2, 7)).astype(np.int64)


def _run(model: onnx.ModelProto | Path, *, config: dict[str, str] | None = None, feed=IDS) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, v)
    return run_plain(model if isinstance(model, Path) else model.SerializeToString(), {"input_ids": feed}, so)[0]


def _inits(model: onnx.ModelProto) -> dict[str, TensorProto]:
    return {t.name: t for t in model.graph.initializer}


# --------------------------------------------------------------------------------------- basics
def test_tiny_builds_fast_and_runs():
    t0 = time.perf_counter()
    m = build_model(SynthConfig.tiny())
    assert time.perf_counter() - t0 < 1.0
    assert m.ir_version == 10
    assert {o.domain: o.version for o in m.opset_import} == {"": 21}
    (inp,), (out,) = m.graph.input, m.graph.output
    assert inp.name == "input_ids" and inp.type.tensor_type.elem_type == TensorProto.INT64
    assert [d.dim_param for d in inp.type.tensor_type.shape.dim] == ["batch", "seq"]
    assert out.name == "logits" and out.type.tensor_type.elem_type == TensorProto.FLOAT
    logits = _run(m)
    assert logits.shape == (2, 7, 1000) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std() > 0.1 and np.ptp(logits, axis=-1).min() > 0.1  # not all equal, per position
    # causal: the first position must not see the tokens after it
    other = IDS.copy()
    other[:, 3:] = (other[:, 3:] + 1) % 1000
    np.testing.assert_array_equal(_run(m, feed=other)[:, :3], logits[:, :3])
    assert not np.array_equal(_run(m, feed=other)[:, 3:], logits[:, 3:])


@pytest.mark.parametrize("layers", [1, 6])
def test_activations_stay_scaled_with_depth(layers):
    logits = _run(build_model(SynthConfig.tiny(layers=layers)))
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 5


# ------------------------------------------------------------------------ QDQ vs native forms
@pytest.mark.parametrize("weight_type", ["int4", "uint4", "int8", "uint8", "int2", "uint2"])
@pytest.mark.parametrize("zero_points", [False, True])
def test_qdq_and_native_give_identical_outputs(weight_type, zero_points):
    """ORT fuses the QDQ model to MatMulNBits (accuracy 4 by default); the native twin, built with our
    kernels at accuracy_level 4, must produce the very same bits."""
    cfg = SynthConfig.tiny(weight_type=weight_type, zero_points=zero_points)
    qdq, native = _run(build_model(cfg)), _run(build_model(cfg.replace(form="native")))
    assert np.isfinite(qdq).all()
    assert np.array_equal(qdq, native), np.abs(qdq - native).max()


@pytest.mark.parametrize("kw", [
    {"embedding": "quantized"},
    {"embedding": "quantized", "zero_points": True, "weight_type": "uint4", "block_size": 16},
    {"block_size": 128, "hidden": 160, "heads": 5},  # K=160: tail blocks everywhere
    {"block_size": 256, "intermediate": 300},
])
def test_qdq_and_native_identical_other_knobs(kw):
    cfg = SynthConfig.tiny(**kw)
    assert np.array_equal(_run(build_model(cfg)), _run(build_model(cfg.replace(form="native"))))


def test_qdq_and_native_identical_at_accuracy_0():
    cfg = SynthConfig.tiny(accuracy_level=0)
    qdq = _run(build_model(cfg), config={"session.qdq_matmulnbits_accuracy_level": "0"})
    native = _run(build_model(cfg.replace(form="native")))
    assert np.array_equal(qdq, native)
    assert not np.array_equal(qdq, _run(build_model(cfg)))  # and accuracy 0 really differs from 4


def test_fp16_scales_forms_agree_to_fp16_precision():
    """fp16 scales: not bit-identical, by ORT's doing. On x86 CPU ORT demotes the *fused* fp16
    MatMulNBits to fp32 (InsertCastTransformer, initializer names 'FusedBack_*') and then drops our
    explicit fp32->fp16->fp32 Cast pair around it, while the native fp16 MatMulNBits keeps its fp16 CPU
    kernel and sees fp16-rounded activations. The difference is fp16 rounding, ~1% of the logit range."""
    cfg = SynthConfig.tiny(scale_dtype="float16")
    qdq, native = _run(build_model(cfg)), _run(build_model(cfg.replace(form="native")))
    assert np.isfinite(qdq).all() and np.isfinite(native).all()
    assert np.abs(qdq - native).max() < 0.05 * np.ptp(qdq)


@pytest.mark.parametrize("weight_type,zero_points", [("int4", False), ("uint4", False), ("int2", True), ("uint8", True)])
def test_forms_hold_identical_codes(weight_type, zero_points):
    """The native initializers are exactly nbits_layout's conversion of the QDQ initializers."""
    cfg = SynthConfig.tiny(weight_type=weight_type, zero_points=zero_points, layers=1)
    qi, ni = _inits(build_model(cfg)), _inits(build_model(cfg.replace(form="native")))
    bits, signed = cfg.bits, cfg.signed
    for prefix, K, N, _ in cfg.matmuls():
        zp = qi.get(f"{prefix}.weight_zero_point")
        conv = nl.dq_to_matmulnbits(
            np.frombuffer(qi[f"{prefix}.weight"].raw_data, np.uint8), numpy_helper.to_array(qi[f"{prefix}.weight_scale"]),
            None if zp is None else np.frombuffer(zp.raw_data, np.uint8), K=K, N=N, bits=bits, signed=signed,
            block_size=cfg.block_size)
        np.testing.assert_array_equal(numpy_helper.to_array(ni[f"{prefix}.qweight"]), conv.B)
        np.testing.assert_array_equal(numpy_helper.to_array(ni[f"{prefix}.scales"]), conv.scales)
        if conv.zero_points is None:
            assert f"{prefix}.qzeros" not in ni
        else:
            np.testing.assert_array_equal(numpy_helper.to_array(ni[f"{prefix}.qzeros"]), conv.zero_points)


# --------------------------------------------------------------------------- knobs: dims, dtypes
@pytest.mark.parametrize("kw", [
    {},
    {"weight_type": "uint8", "zero_points": True, "scale_dtype": "float16", "block_size": 64},
    {"weight_type": "int2", "embedding": "quantized"},
    {"form": "native", "weight_type": "uint4", "block_size": 16},
    {"form": "native", "weight_type": "int8", "zero_points": True, "scale_dtype": "float16", "accuracy_level": 0},
])
def test_dims_and_dtypes_follow_config(kw):
    cfg = SynthConfig.tiny(**kw)
    m = build_model(cfg)
    inits = _inits(m)
    wt = {"int2": TensorProto.INT2, "uint2": TensorProto.UINT2, "int4": TensorProto.INT4,
          "uint4": TensorProto.UINT4, "int8": TensorProto.INT8, "uint8": TensorProto.UINT8}[cfg.weight_type]
    st = TensorProto.FLOAT if cfg.scale_dtype == "float32" else TensorProto.FLOAT16
    assert {o.domain: o.version for o in m.opset_import}[""] == (25 if cfg.bits == 2 else 21)
    bs = cfg.block_size
    for prefix, K, N, _ in cfg.matmuls():
        kb = -(-K // bs)
        if cfg.form == "qdq":
            w, s = inits[f"{prefix}.weight"], inits[f"{prefix}.weight_scale"]
            assert (w.data_type, list(w.dims), s.data_type, list(s.dims)) == (wt, [K, N], st, [kb, N])
            assert (f"{prefix}.weight_zero_point" in inits) == cfg.zero_points
        else:
            shp = nl.matmulnbits_shapes(K, N, cfg.bits, bs, nl.needs_zero_points(cfg.signed, cfg.zero_points))
            assert list(inits[f"{prefix}.qweight"].dims) == list(shp.B)
            assert (inits[f"{prefix}.scales"].data_type, list(inits[f"{prefix}.scales"].dims)) == (st, list(shp.scales))
            assert (f"{prefix}.qzeros" in inits) == (shp.zero_points is not None)
    nodes = [n for n in m.graph.node if n.op_type in ("MatMulNBits", "DequantizeLinear")]
    for n in nodes:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        assert a["block_size"] == bs
        if n.op_type == "MatMulNBits":
            assert (a["bits"], a["accuracy_level"]) == (cfg.bits, cfg.accuracy_level)
    emb = inits["model.embed_tokens.weight"]
    assert list(emb.dims) == [cfg.vocab, cfg.hidden]
    assert emb.data_type == (TensorProto.FLOAT if cfg.embedding == "fp32" else wt)
    # the size accounting used by presets and reports is exact
    assert model_weight_bytes(cfg)["total"] == sum(
        len(t.raw_data) for t in m.graph.initializer if not t.name.startswith("const."))
    logits = _run(m)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


def test_presets_sizes():
    """Preset sizes match the sizes the docs quote (docs/hygiene.md, docs/benchmarks.md; accounting only)."""
    gb = lambda c, k: model_weight_bytes(c)[k] / 1e9  # noqa: E731
    for cfg, codes, emb in ((SynthConfig.demo(), 0.24, 0.26), (SynthConfig.llama_0_6gb(), 0.60, 0.26),
                            (SynthConfig.llama_1_6gb(), 1.64, 0.39)):
        assert abs(gb(cfg, "codes") - codes) < 0.01 and abs(gb(cfg, "embedding") - emb) < 0.01, cfg.name
        assert cfg.block_size == 32 and cfg.weight_type == "int4"
        # native codes carry no padding here: K is a multiple of 32 everywhere
        assert model_weight_bytes(cfg.replace(form="native"))["codes"] == model_weight_bytes(cfg)["codes"]
    assert model_weight_bytes(SynthConfig.tiny())["total"] < 4e6


def test_config_validation():
    for bad in ({"weight_type": "int3"}, {"block_size": 48}, {"hidden": 130, "heads": 4}, {"form": "gptq"},
                {"storage": "s3"}, {"scale_dtype": "bfloat16"}, {"name": "../x"}, {"accuracy_level": 5}):
        with pytest.raises(SynthError):
            SynthConfig.tiny(**bad)


def test_embedded_over_2gb_is_refused_before_generating(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(SynthError, match="2 GiB"):
        write_model(SynthConfig.llama_1_6gb(), tmp_path / "big.onnx")
    assert time.perf_counter() - t0 < 1.0 and not list(tmp_path.iterdir())


# -------------------------------------------------------------------------------- files on disk
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    cfg = SynthConfig.tiny(storage="external", form="native", zero_points=True)
    paths = []
    for c, d in ((cfg, "a"), (cfg, "b"), (cfg.replace(seed=1), "c")):
        (tmp_path / d).mkdir()
        paths.append(write_model(c, tmp_path / d / "m.onnx"))
    read = lambda p: (p.read_bytes(), Path(str(p) + ".data").read_bytes())  # noqa: E731
    a, b, c = map(read, paths)
    assert a == b
    assert a[1] != c[1]
    emb_a, emb_b = build_model(SynthConfig.tiny()), build_model(SynthConfig.tiny())
    assert emb_a.SerializeToString() == emb_b.SerializeToString()


@pytest.mark.parametrize("form", ["qdq", "native"])
def test_external_data_layout(form, tmp_path):
    cfg = SynthConfig.tiny(storage="external", form=form, embedding="quantized", zero_points=True)
    seen = []
    path = write_model(cfg, tmp_path / "m.onnx", progress=lambda done, total, name: seen.append((done, total)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert seen[-1][0] == seen[-1][1] and all(x[0] <= y[0] for x, y in zip(seen, seen[1:]))
    data_size = (tmp_path / "m.onnx.data").stat().st_size
    m = onnx.load(str(path), load_external_data=False)
    ref = _inits(build_model(cfg))
    spans = []
    with open(tmp_path / "m.onnx.data", "rb") as f:
        for t in m.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                ext = {e.key: e.value for e in t.external_data}
                assert ext["location"] == "m.onnx.data" and not t.HasField("raw_data")
                off, ln = int(ext["offset"]), int(ext["length"])
                assert off % 4096 == 0 and ln >= 1024
                f.seek(off)
                assert f.read(ln) == ref[t.name].raw_data, t.name
                spans.append((off, off + ln))
            else:
                assert len(t.raw_data) < 1024 and t.raw_data == ref[t.name].raw_data
    spans.sort()
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == data_size
    # the proto carries no weight bytes: only the graph and sub-KiB constants
    assert path.stat().st_size < 64 * 1024
    assert np.array_equal(_run(path), _run(build_model(cfg)))


def test_write_model_memory_is_bounded(tmp_path):
    """Generating a ~200 MB external model (native form: the kernels run too) in a fresh process must
    raise peak RSS by far less than the model size: one tensor at a time, no copy of the model."""
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        import numpy as np, onnx
        from ortmem.measure.synth import SynthConfig, write_model
        def kib(key):
            for line in open('/proc/self/status'):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        cfg = SynthConfig(hidden=1024, intermediate=2816, layers=12, vocab=24000, heads=8,
                          form='native', storage='external', name='mem')
        base = kib('VmRSS:')
        write_model(cfg, Path(sys.argv[1]) / 'mem.onnx')
        print(kib('VmHWM:') - base)
    """)
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    growth = int(res.stdout.strip().splitlines()[-1])
    size = (tmp_path / "mem.onnx.data").stat().st_size
    assert size > 190e6
    print(f"write_model peak RSS growth {growth / 2**20:.0f} MiB for {size / 2**20:.0f} MiB")
    assert growth < 0.35 * size, f"peak RSS grew {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"


def test_cached_model_generates_once(tmp_path):
    cfg = SynthConfig.tiny(storage="external")
    p1 = cached_model(cfg, tmp_path / "cache")
    mtime = p1.stat().st_mtime_ns
    p2 = cached_model(cfg, tmp_path / "cache")
    assert p1 == p2 and p2.stat().st_mtime_ns == mtime
    p3 = cached_model(cfg.replace(seed=3), tmp_path / "cache")
    assert p3 != p1 and p3.is_file()
    # only finished entries, no temp folders left behind
    assert sorted(p.name.startswith(".") for p in (tmp_path / "cache").iterdir()) == [False, False]
    assert Path(str(p1) + ".data").is_file()
    assert np.array_equal(_run(p1), _run(build_model(cfg)))
