"""DQ+MatMul -> MatMulNBits through the hook and `ortmem convert`, checked against ORT on the QDQ model.

Tolerance: bit-identical (np.array_equal) to ORT's own session on the same QDQ model at the same
accuracy level, except fp16-scale models (ORT runs its fused fp16 MatMulNBits in fp32 on CPU and
drops a Cast pair; see docs/ort-fusion-rules.md), where the largest difference is asserted.
"""
from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.cache import Cache
from ortmem.convert import convert_to, settings_from
from ortmem.errors import CacheError, ConversionError
from ortmem.synth import SynthConfig, write_model

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}

VARIANTS = {
    "int4": {},
    "uint4+zp": {"weight_type": "uint4", "zero_points": True},
    "uint4": {"weight_type": "uint4"},
    "int4+zp": {"zero_points": True},
    "int8": {"weight_type": "int8"},
    "uint8+zp": {"weight_type": "uint8", "zero_points": True},
    "int2": {"weight_type": "int2"},
    "uint2+zp": {"weight_type": "uint2", "zero_points": True},
    "block16": {"block_size": 16},
    "block128": {"block_size": 128},
    "block256": {"block_size": 256, "hidden": 256, "intermediate": 512},
    "external": {"storage": "external"},
}


def _model(tmp_path: Path, **kw) -> Path:
    path = tmp_path / "m" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_model(SynthConfig.tiny(**kw), path)


def _ort(path: Path, accuracy_level: int | None = None, level=None) -> list[np.ndarray]:
    so = ort.SessionOptions()
    if accuracy_level is not None:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    if level is not None:
        so.graph_optimization_level = level
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, FEEDS)


def _count_ops(path: Path, op: str) -> int:
    m = onnx.load(str(path), load_external_data=False)
    return sum(n.op_type == op for n in m.graph.node)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("cache", [True, False])
def test_hook_equals_ort_on_the_qdq_model(tmp_path, variant, cache):
    path = _model(tmp_path, **VARIANTS[variant])
    expected = _ort(path)
    sess = ortmem.InferenceSession(path, cache=cache)
    assert sess.ortmem_report is not None and sess.ortmem_report.converted > 0
    got = sess.run(None, FEEDS)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("level", [0, 4])
def test_accuracy_level_follows_the_session_option(tmp_path, level):
    path = _model(tmp_path)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    got = ortmem.InferenceSession(path, so).run(None, FEEDS)
    assert np.array_equal(got[0], _ort(path, accuracy_level=level)[0])
    if level == 0:  # accuracy 0 is the unfused math: within 1e-5 relative of ORT_DISABLE_ALL
        ref = _ort(path, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)[0]
        np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_fp16_scales_close_to_ort(tmp_path):
    """ORT computes its fused fp16 MatMulNBits in fp32 on CPU; the converted model keeps fp16."""
    path = _model(tmp_path, scale_dtype="float16")
    expected = _ort(path)[0]
    got = ortmem.InferenceSession(path).run(None, FEEDS)[0]
    span = float(expected.max() - expected.min())
    assert float(np.abs(got - expected).max()) < 0.05 * span


def test_embedded_and_external_give_the_same_graph(tmp_path):
    a = _model(tmp_path / "a")
    b = _model(tmp_path / "b", storage="external")
    out_a, out_b = tmp_path / "ca", tmp_path / "cb"
    with ortmem.load(a) as m:
        convert_to(m, out_a, settings_from())
    with ortmem.load(b) as m:
        convert_to(m, out_b, settings_from())
    assert _count_ops(out_a / "model.onnx", "MatMulNBits") == _count_ops(out_b / "model.onnx", "MatMulNBits") > 0
    assert _count_ops(out_a / "model.onnx", "DequantizeLinear") == 0
    ra, rb = (ort.InferenceSession(str(p / "model.onnx")).run(None, FEEDS)[0] for p in (out_a, out_b))
    assert np.array_equal(ra, rb)


def test_convert_cli_writes_a_standalone_folder(tmp_path, capsys):
    from ortmem.cli import main

    path = _model(tmp_path, storage="external")
    out = tmp_path / "out"
    assert main(["convert", str(path), str(out), "--accuracy-level", "0"]) == 0
    assert "converted" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["conversion.json", "model.onnx", "weights.bin"]
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    levels = {a.i for n in m.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {0}
    assert np.array_equal(ort.InferenceSession(str(out / "model.onnx")).run(None, FEEDS)[0], _ort(path, accuracy_level=0)[0])
    # refuses to write into a non-empty folder, and leaves it as it was
    with pytest.raises(ConversionError, match="not empty"):
        with ortmem.load(path) as m:
            convert_to(m, out, settings_from())


def test_unconvertible_patterns_are_left_and_reported(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    k, n = 64, 32
    codes = np.random.default_rng(0).integers(0, 256, size=(k * n // 2,), dtype=np.uint8)
    inits = [helper.make_tensor("Wq", TensorProto.INT4, [k, n], codes.tobytes(), raw=True),
             numpy_helper.from_array(np.full((k // 8, n), 0.01, np.float32), "S")]  # block 8: rejected
    g = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Wq", "S"], ["W"], axis=0, block_size=8),
         helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], inits)
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21)]), path)
    x = {"x": np.ones((1, k), np.float32)}
    sess = ortmem.InferenceSession(path)
    assert sess.ortmem_report is None  # nothing converted: the model went to ORT as it was
    assert np.array_equal(sess.run(None, x)[0], ort.InferenceSession(str(path)).run(None, x)[0])
    with ortmem.load(path) as m:
        from ortmem.passes.dq_matmul import plan_conversion

        plan = plan_conversion(m)
    assert not plan.rewrites and plan.skipped and "block" in plan.skipped[0][1]


# ---- the cache ----

def test_second_start_is_a_cache_hit_and_converts_nothing(tmp_path):
    path = _model(tmp_path, storage="external")
    cache_dir = tmp_path / "cache"
    first = ortmem.InferenceSession(path, cache=cache_dir)
    assert not first.ortmem_cache_hit and first.ortmem_report.converted > 0
    second = ortmem.InferenceSession(path, cache=cache_dir)
    assert second.ortmem_cache_hit and second.ortmem_report is None
    assert np.array_equal(first.run(None, FEEDS)[0], second.run(None, FEEDS)[0])
    (entry,) = Cache(cache_dir).entries()
    assert (entry.path / "model.onnx").exists() and (entry.path / "weights.bin").exists()
    # no temporary folders left behind
    assert [p.name for p in cache_dir.iterdir()] == [entry.key]


def test_options_that_change_the_result_change_the_key(tmp_path):
    path = _model(tmp_path)
    cache_dir = tmp_path / "cache"
    ortmem.InferenceSession(path, cache=cache_dir)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    s = ortmem.InferenceSession(path, so, cache=cache_dir)
    assert not s.ortmem_cache_hit
    assert len(list(Cache(cache_dir).entries())) == 2


def test_edited_source_is_a_miss(tmp_path):
    path = _model(tmp_path)
    cache_dir = tmp_path / "cache"
    ortmem.InferenceSession(path, cache=cache_dir)
    os.utime(path, ns=(1, 1))  # same bytes, new identity: never trust a stale entry
    assert not ortmem.InferenceSession(path, cache=cache_dir).ortmem_cache_hit


def test_edited_external_data_is_a_miss(tmp_path):
    path = _model(tmp_path, storage="external")
    cache_dir = tmp_path / "cache"
    ortmem.InferenceSession(path, cache=cache_dir)
    assert ortmem.InferenceSession(path, cache=cache_dir).ortmem_cache_hit
    data = path.with_name(path.name + ".data")
    os.utime(data, ns=(2, 2))
    again = ortmem.InferenceSession(path, cache=cache_dir)
    assert not again.ortmem_cache_hit and again.ortmem_report is not None


@pytest.mark.parametrize("damage", ["truncate", "scribble", "manifest", "model"])
def test_corrupt_entry_is_rebuilt(tmp_path, damage):
    path = _model(tmp_path, storage="external")
    cache_dir = tmp_path / "cache"
    expected = ortmem.InferenceSession(path, cache=cache_dir).run(None, FEEDS)[0]
    (entry,) = Cache(cache_dir).entries()
    weights = entry.path / "weights.bin"
    if damage == "truncate":
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "scribble":
        with open(weights, "r+b") as f:
            f.write(b"\xff" * 4096)
    elif damage == "manifest":
        (entry.path / "manifest.json").write_text("{not json")
    else:
        (entry.path / "model.onnx").write_bytes(b"\x00" * 10)
    again = ortmem.InferenceSession(path, cache=cache_dir)
    assert not again.ortmem_cache_hit
    assert np.array_equal(again.run(None, FEEDS)[0], expected)
    assert Cache(cache_dir).lookup(entry.key) is not None


def test_concurrent_creators_agree(tmp_path):
    path = _model(tmp_path, storage="external")
    cache_dir = tmp_path / "cache"
    results, errors = [], []

    def start():
        try:
            results.append(ortmem.InferenceSession(path, cache=cache_dir).run(None, FEEDS)[0])
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(np.array_equal(r, results[0]) for r in results)
    assert len(list(Cache(cache_dir).entries())) == 1
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]


def test_full_disk_leaves_nothing_half_written(tmp_path, monkeypatch):
    path = _model(tmp_path, storage="external")
    cache_dir = tmp_path / "cache"

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(CacheError, match="No space"):
        ortmem.InferenceSession(path, cache=cache_dir)
    assert list(cache_dir.iterdir()) == []


def test_cache_cli_lists_and_clears(tmp_path, capsys, monkeypatch):
    from ortmem.cli import main

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "root"))
    path = _model(tmp_path)
    ortmem.InferenceSession(path)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "1 entry" in out and str(path) in out
    assert main(["cache", "clear"]) == 0
    assert main(["cache", "list"]) == 0
    assert "0 entries" in capsys.readouterr().out


# ---- cache=False: buffers borrowed by ORT, released after creation ----

def test_in_memory_releases_what_ort_no_longer_reads(tmp_path):
    path = _model(tmp_path, storage="external")
    sess = ortmem.InferenceSession(path, cache=False)
    mem = sess._ortmem_handoff.memory
    assert mem is not None and mem.released and mem.releasable
    # int4 at accuracy 4: ORT pre-packs B and scales, so both were released
    assert sum(length for _, length in mem.releasable) >= 0.9 * sum(r.B.nbytes for r in mem.plan.rewrites)
    # ORT never reads a released page: overwrite all of them, outputs do not move
    buf = np.frombuffer(mem.buffer, np.uint8)
    for offset, length in mem.releasable:
        buf[offset : offset + length] = 0xA5
    del buf
    assert np.array_equal(sess.run(None, FEEDS)[0], _ort(path)[0])


def test_in_memory_keeps_what_ort_still_reads(tmp_path):
    """With pre-packing disabled ORT reads B on every run: nothing may be released."""
    path = _model(tmp_path, storage="external")
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ortmem.InferenceSession(path, so, cache=False)
    assert sess._ortmem_handoff.memory.releasable == []
    expected = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    assert np.array_equal(sess.run(None, FEEDS)[0], expected)
