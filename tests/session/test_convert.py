"""DQ+MatMul -> MatMulNBits through the hook and `ortmem convert`, checked against ORT on the QDQ model.

Tolerance: bit-identical (np.array_equal) to ORT's own session on the same QDQ model at the same
accuracy level, fp16-scale models included (ORT runs its fused fp16 MatMulNBits in fp32 on x86-64
CPUs, and so does the converted model; see docs/fusion.md).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.store.cache import Cache
from ortmem.files.layout import WEIGHTS_FILE
from ortmem.session.convert import convert_to
from ortmem.session.inmemory import convert_in_memory
from ortmem.passes.engine import plan_conversion
from ortmem.ort.settings import session_settings
from ortmem.errors import ConversionError
from ortmem.ort.variants import onnx_type_name
from ortmem.passes.rules import dq_gather, dq_matmul
from ortmem.passes.rules.dq_gather_match import dq_gather_match
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.builders import tiny_decoder
from tests.support.compare import assert_close_outputs, assert_same_outputs
from tests.support.dq_graphs import GATHER_VARIANTS, fp16_graphs, hand_gather_models
from tests.support.release_expect import gather_refusal
from tests.support.threads import run_in_threads

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
    path = tiny_decoder(tmp_path / "m", **VARIANTS[variant])
    expected = _ort(path)
    sess = ortmem.InferenceSession(path, cache=cache)
    assert sess.ortmem_report is not None and sess.ortmem_report.converted > 0
    got = sess.run(None, FEEDS)
    assert_same_outputs(got, expected)


@pytest.mark.parametrize("level", [0, 4])
def test_accuracy_level_follows_the_session_option(tmp_path, level):
    path = tiny_decoder(tmp_path / "m")
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    got = ortmem.InferenceSession(path, so).run(None, FEEDS)
    assert np.array_equal(got[0], _ort(path, accuracy_level=level)[0])
    if level == 0:  # accuracy 0 is the unfused math: within 1e-5 relative of ORT_DISABLE_ALL
        ref = _ort(path, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)[0]
        assert_close_outputs(got[:1], [ref], rtol=1e-5, atol_of_max=1e-5)


@pytest.mark.parametrize("level", [4, 0])
@pytest.mark.parametrize("cache", [True, False])
def test_fp16_scales_bit_identical_to_ort(tmp_path, level, cache):
    """On x86-64 ORT runs the MatMulNBits it fuses from an fp16 DQ+MatMul with its fp32 kernel
    (InsertCastTransformer + FuseInitializersTransformer + RemoveDuplicateCastTransformer, see
    ortmem.ort.fp16_kernels.runs_fp16_matmulnbits_in_fp32); ortmem emits that form itself."""
    path = tiny_decoder(tmp_path / "m", scale_dtype="float16", embedding="quantized")
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    expected = _ort(path, accuracy_level=level)
    sess = ortmem.InferenceSession(path, so, cache=tmp_path / "cache" if cache else False)
    assert sess.ortmem_report is not None and sess.ortmem_report.converted > 0  # converted, not handed over
    assert_same_outputs(sess.run(None, FEEDS), expected)


def test_embedded_and_external_give_the_same_graph(tmp_path):
    a = tiny_decoder(tmp_path / "a" / "m")
    b = tiny_decoder(tmp_path / "b" / "m", storage="external")
    out_a, out_b = tmp_path / "ca", tmp_path / "cb"
    with ortmem.load(a) as m:
        convert_to(m, out_a, session_settings())
    with ortmem.load(b) as m:
        convert_to(m, out_b, session_settings())
    assert _count_ops(out_a / "model.onnx", "MatMulNBits") == _count_ops(out_b / "model.onnx", "MatMulNBits") > 0
    assert _count_ops(out_a / "model.onnx", "DequantizeLinear") == 0
    ra, rb = (ort.InferenceSession(str(p / "model.onnx")).run(None, FEEDS)[0] for p in (out_a, out_b))
    assert np.array_equal(ra, rb)


def test_convert_cli_writes_a_standalone_folder(tmp_path, capsys):
    from ortmem.cli import main

    path = tiny_decoder(tmp_path / "m", storage="external")
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
            convert_to(m, out, session_settings())


def test_convert_cli_prepack_writes_a_model_plain_ort_loads(tmp_path, capsys):
    from ortmem.files import layout
    from ortmem.store.finished import finished_problem
    from ortmem.cli import main

    path = tiny_decoder(tmp_path / "m", storage="external")
    out = tmp_path / "out"
    assert main(["convert", str(path), str(out), "--prepack"]) == 0
    from ortmem.ort.release import capabilities

    if not capabilities().prepacked_save:  # 1.25 saves no pre-packed MatMulNBits weights
        assert "nothing onnxruntime finishes is worth mapping" in capsys.readouterr().out
        assert not (out / f"{layout.FINISHED_STEM}.onnx").exists()
        got = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
        assert np.array_equal(got, _ort(path)[0])
        return
    assert "finished for this CPU" in capsys.readouterr().out
    assert finished_problem(out, layout.FINISHED_STEM) is None
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(out / f"{layout.FINISHED_STEM}.onnx"), so,
                               providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    assert np.array_equal(got, _ort(path)[0])


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
        from ortmem.passes.engine import plan_conversion

        plan = plan_conversion(m)
    assert not plan.of_rule(dq_matmul.NAME) and plan.skipped and "block" in plan.skipped[0][1]


# ---- the cache ----

def test_second_start_is_a_cache_hit_and_converts_nothing(tmp_path):
    path = tiny_decoder(tmp_path / "m", storage="external")
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
    path = tiny_decoder(tmp_path / "m")
    cache_dir = tmp_path / "cache"
    ortmem.InferenceSession(path, cache=cache_dir)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    s = ortmem.InferenceSession(path, so, cache=cache_dir)
    assert not s.ortmem_cache_hit
    assert len(list(Cache(cache_dir).entries())) == 2


def test_edited_source_is_a_miss(tmp_path):
    path = tiny_decoder(tmp_path / "m")
    cache_dir = tmp_path / "cache"
    ortmem.InferenceSession(path, cache=cache_dir)
    os.utime(path, ns=(1, 1))  # same bytes, new identity: never trust a stale entry
    assert not ortmem.InferenceSession(path, cache=cache_dir).ortmem_cache_hit


def test_edited_external_data_is_a_miss(tmp_path):
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache_dir = tmp_path / "cache"
    ortmem.InferenceSession(path, cache=cache_dir)
    assert ortmem.InferenceSession(path, cache=cache_dir).ortmem_cache_hit
    data = path.with_name(path.name + ".data")
    os.utime(data, ns=(2, 2))
    again = ortmem.InferenceSession(path, cache=cache_dir)
    assert not again.ortmem_cache_hit and again.ortmem_report is not None


@pytest.mark.parametrize("damage", ["truncate", "scribble", "manifest", "model"])
def test_corrupt_entry_is_rebuilt(tmp_path, damage):
    path = tiny_decoder(tmp_path / "m", storage="external")
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
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache_dir = tmp_path / "cache"
    results = run_in_threads(lambda: ortmem.InferenceSession(path, cache=cache_dir).run(None, FEEDS)[0])
    assert all(np.array_equal(r, results[0]) for r in results)
    assert len(list(Cache(cache_dir).entries())) == 1
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]


def test_full_disk_leaves_nothing_half_written(tmp_path, monkeypatch, caplog):
    path = tiny_decoder(tmp_path / "m", storage="external")
    cache_dir = tmp_path / "cache"

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with caplog.at_level(logging.WARNING, logger="ortmem"):
        sess = ortmem.InferenceSession(path, cache=cache_dir)
    # A full disk degrades to an in-memory conversion with one warning: the session still works.
    assert [r.message for r in caplog.records if "No space" in r.getMessage()]
    assert sess.ortmem_report is not None and not sess.ortmem_cache_hit
    assert list(cache_dir.iterdir()) == []


def test_cache_cli_lists_and_clears(tmp_path, capsys, monkeypatch):
    from ortmem.cli import main

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "root"))
    path = tiny_decoder(tmp_path / "m")
    ortmem.InferenceSession(path)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "1 entry" in out and str(path) in out
    assert main(["cache", "clear"]) == 0
    assert main(["cache", "list"]) == 0
    assert "0 entries" in capsys.readouterr().out


# ---- cache=False: buffers borrowed by ORT, released after creation ----

@pytest.mark.usefixtures("no_temp_folder")
def test_in_memory_releases_what_ort_no_longer_reads(tmp_path):
    path = tiny_decoder(tmp_path / "m", storage="external")
    sess = ortmem.InferenceSession(path, cache=False)
    mem = sess.ortmem_handoff.memory
    assert mem is not None and mem.released and mem.releasable
    # int4 at accuracy 4: ORT pre-packs B and scales, so both were released
    assert sum(length for _, length in mem.releasable) >= 0.9 * sum(r.B.nbytes for r in mem.plan.of_rule(dq_matmul.NAME))
    # ORT never reads a released page: overwrite all of them, outputs do not move
    buf = np.frombuffer(mem.buffer, np.uint8)
    for offset, length in mem.releasable:
        buf[offset : offset + length] = 0xA5
    del buf
    assert np.array_equal(sess.run(None, FEEDS)[0], _ort(path)[0])


def test_in_memory_keeps_what_ort_still_reads(tmp_path):
    """With pre-packing disabled ORT reads B on every run: nothing may be released. Such settings
    come with the caller's options, which never carry in-memory files (tests/base/test_options.py):
    the session converts into a private folder, and the in-memory plan is checked on its own."""
    path = tiny_decoder(tmp_path / "m", storage="external")
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    model = ortmem.load(path)
    plan = plan_conversion(model, session_settings(so))
    assert plan.of_rule(dq_matmul.NAME) and convert_in_memory(model, plan, prepacking=False).releasable == []
    sess = ortmem.InferenceSession(path, so, cache=False)
    assert sess.ortmem_action == "converted-temporary"
    expected = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    assert np.array_equal(sess.run(None, FEEDS)[0], expected)


# ---- DQ(+Cast)+Gather -> GatherBlockQuantized ----

def _gbq_nodes(model_path: Path) -> list[onnx.NodeProto]:
    m = onnx.load(str(model_path), load_external_data=False)
    return [n for n in m.graph.node if n.op_type == "GatherBlockQuantized"]


@pytest.mark.usefixtures("no_temp_folder")
@pytest.mark.parametrize("variant", sorted(GATHER_VARIANTS))
@pytest.mark.parametrize("cache", [True, False])
def test_gbq_hook_equals_ort_on_the_qdq_model(tmp_path, variant, cache):
    path = tiny_decoder(tmp_path / "m", embedding="quantized", **GATHER_VARIANTS[variant])
    expected = _ort(path)
    sess = ortmem.InferenceSession(path, cache=tmp_path / "cache" if cache else False)
    got = sess.run(None, FEEDS)
    assert_same_outputs(got, expected)
    kw = GATHER_VARIANTS[variant]
    refusal = gather_refusal(kw.get("weight_type", "int4"), bool(kw.get("zero_points")), "float32")
    if refusal:  # this release cannot run the GatherBlockQuantized ortmem would write: DQ+Gather stays
        assert any(refusal in why for _, why in sess.ortmem_report.skipped), sess.ortmem_report.skipped
        return
    if cache:
        (entry,) = Cache(tmp_path / "cache").entries()
        (gbq,) = _gbq_nodes(entry.model_path)
        m = onnx.load(str(entry.model_path), load_external_data=False)
        # no DQ is left; the one Gather checks the ids (over an arange) before the GBQ reads them
        (check,) = [n for n in m.graph.node if n.op_type in ("DequantizeLinear", "Gather")]
        assert check.op_type == "Gather" and check.output[0] == gbq.input[1]
        # the table is carried, not copied: it stays in the hard-linked source
        table = next(t for t in m.graph.initializer if t.name == gbq.input[0])
        assert dict((e.key, e.value) for e in table.external_data)["location"].startswith("source-")
    else:
        skel = onnx.load_from_string(sess.ortmem_handoff.memory.skeleton)
        assert [n.op_type for n in skel.graph.node].count("GatherBlockQuantized") == 1


def test_gbq_fp16_cast_form(tmp_path):
    """DQ(fp16) -> Cast(float) -> Gather: GBQ in fp16, the Cast moves onto the gathered rows."""
    path = tiny_decoder(tmp_path / "m", embedding="quantized", scale_dtype="float16")
    with ortmem.load(path) as m:
        from ortmem.passes.engine import plan_conversion

        plan = plan_conversion(m)
    (g,) = plan.of_rule(dq_gather.NAME)
    assert g.candidate.cast and g.candidate.cast_to == onnx.TensorProto.FLOAT
    out = tmp_path / "out"
    with ortmem.load(path) as m:
        convert_to(m, out, session_settings())
    (gbq,) = _gbq_nodes(out / "model.onnx")
    conv = onnx.load(str(out / "model.onnx"), load_external_data=False)
    cast = next(n for n in conv.graph.node if n.op_type == "Cast" and list(n.input) == list(gbq.output))
    assert cast.output[0] == g.candidate.output


def test_gbq_int8_and_int2_tables_are_left_and_reported(tmp_path):
    for wtype in ("int8", "int2"):
        path = tiny_decoder(tmp_path / wtype / "m", embedding="quantized", weight_type=wtype)
        with ortmem.load(path) as m:
            from ortmem.passes.engine import plan_conversion

            plan = plan_conversion(m)
        assert not plan.of_rule(dq_gather.NAME)
        assert any("GatherBlockQuantized" in reason and "embed" in node for node, reason in plan.skipped)
        assert np.array_equal(ortmem.InferenceSession(path).run(None, FEEDS)[0], _ort(path)[0])


def test_gbq_respects_disabled_optimizations(tmp_path):
    path = tiny_decoder(tmp_path / "m", embedding="quantized")
    with ortmem.load(path) as m:
        from ortmem.passes.engine import plan_conversion

        assert plan_conversion(m, session_settings()).of_rule(dq_gather.NAME)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        assert not plan_conversion(m, session_settings(so)).of_rule(dq_gather.NAME)


@pytest.mark.parametrize("storage", ["inline", "external"])
def test_gbq_every_matcher_form_converts_bit_identically(tmp_path, storage):
    """Every DQ+Gather form the matcher accepts (scales as-is/reshape/expand, zero points
    as-is/reshape/expand/zeros/repack, uint2 as uint8, tied tables, fp16 + Cast), converted by
    ``ortmem convert``, reproduces ORT's own DQ+Gather run bit for bit; inline (skeleton) tensors
    and external ones (placed in weights.bin) alike."""
    for name, (m, feeds) in hand_gather_models().items():
        src = tmp_path / storage / name / "model.onnx"
        src.parent.mkdir(parents=True)
        if storage == "external":
            onnx.save(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="model.data",
                      size_threshold=0)
        else:
            onnx.save(m, src)
        want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
        out = src.parent / "out"
        with ortmem.load(src) as model:
            convert_to(model, out, session_settings())
        (c,), _ = dq_gather_match(m)
        refused = gather_refusal(onnx_type_name(c.weight_dtype), c.has_zp, onnx_type_name(c.scale_dtype))
        assert len(_gbq_nodes(out / "model.onnx")) == (0 if refused else 1), name
        conv = onnx.load(str(out / "model.onnx"), load_external_data=False)
        dqs = [n for n in conv.graph.node if n.op_type == "DequantizeLinear"]
        assert len(dqs) == (1 if name == "tied_with_matmul" or refused else 0), name  # a tied table keeps its DQ
        got = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
        assert_same_outputs(got, want, name)


def test_gbq_table_is_copied_only_by_convert(tmp_path):
    """``ortmem convert`` output is self-contained (table copied file to file); a cache entry links it."""
    path = tiny_decoder(tmp_path / "m", embedding="quantized", storage="external")
    out = tmp_path / "out"
    with ortmem.load(path) as m:
        convert_to(m, out, session_settings())
    (gbq,) = _gbq_nodes(out / "model.onnx")
    conv = onnx.load(str(out / "model.onnx"), load_external_data=False)
    table = next(t for t in conv.graph.initializer if t.name == gbq.input[0])
    ext = {e.key: e.value for e in table.external_data}
    assert ext["location"] == "weights.bin" and int(ext["offset"]) % 4096 == 0
    assert np.array_equal(ort.InferenceSession(str(out / "model.onnx")).run(None, FEEDS)[0], _ort(path)[0])


@pytest.mark.usefixtures("no_temp_folder")
def test_in_memory_never_releases_gbq_inputs(tmp_path):
    """ORT's GatherBlockQuantized has no PrePack: it reads its inputs from our buffers on every run.
    Nothing of them may be released, and scribbling on them changes the output (proof that ORT
    reads the borrowed bytes, so releasing them would be wrong)."""
    path = tiny_decoder(tmp_path / "m", embedding="quantized", weight_type="uint8", storage="external")
    expected = _ort(path)[0]
    sess = ortmem.InferenceSession(path, cache=False)
    mem = sess.ortmem_handoff.memory
    (g,) = mem.plan.of_rule(dq_gather.NAME)
    # the explicit zero point (GBQ's uint8 default would be 128); the index check's arange beside it
    (made,) = [t for role, t in g.made if role == "zero_points"]
    assert mem.released and mem.releasable
    assert all(off + length <= t.offset or off >= t.offset + t.nbytes
               for t in g.out_tensors() for off, length in mem.releasable)
    assert np.array_equal(sess.run(None, FEEDS)[0], expected)
    buf = np.frombuffer(mem.buffer, np.uint8)
    saved = buf[made.offset : made.offset + made.nbytes].copy()
    buf[made.offset : made.offset + made.nbytes] = 7
    from ortmem.ort.release import capabilities

    borrows = capabilities().borrows_memory_buffers  # before 1.31 ORT copies in-memory external data
    try:
        assert np.array_equal(sess.run(None, FEEDS)[0], expected) != borrows
    finally:
        buf[made.offset : made.offset + made.nbytes] = saved
        del buf
    assert np.array_equal(sess.run(None, FEEDS)[0], expected)


# ---- fp16: the fused node runs in fp32 on x86-64 CPUs, as in ORT's own session ----

@pytest.mark.parametrize("level", [4, 0])
def test_fp16_neighbourhoods_bit_identical_to_ort(tmp_path, level):
    from ortmem.ort.fp16_kernels import runs_fp16_matmulnbits_in_fp32

    if not runs_fp16_matmulnbits_in_fp32("MatMul"):
        pytest.skip("this ORT build keeps the fused fp16 MatMulNBits in fp16 (fp16 MatMul CPU kernel)")
    for name, (m, feeds) in fp16_graphs().items():
        src = tmp_path / name / "model.onnx"
        src.parent.mkdir(parents=True)
        onnx.save(m, src)
        so = ort.SessionOptions()
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
        want = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        with ortmem.load(src) as model:
            convert_to(model, src.parent / "out", session_settings(so))
        conv = onnx.load(str(src.parent / "out" / "model.onnx"), load_external_data=False)
        assert any(n.op_type == "MatMulNBits" for n in conv.graph.node), name
        got = ort.InferenceSession(str(src.parent / "out" / "model.onnx"), so,
                                   providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_fp16_kept_where_the_caller_says_the_ep_runs_fp16(tmp_path):
    """``fp16_in_fp32=False`` (an EP with fp16 kernels) keeps the fp16 node and scales."""
    from ortmem.passes.engine import plan_conversion, rewrite_skeleton

    path = tiny_decoder(tmp_path / "m", scale_dtype="float16")
    with ortmem.load(path) as m:
        kept = plan_conversion(m, fp16_in_fp32=False)
        kept_mm = kept.of_rule(dq_matmul.NAME)
        assert kept_mm and all(not r.fp32 and r.scales.data_type == onnx.TensorProto.FLOAT16 for r in kept_mm)
        as_cpu = plan_conversion(m, fp16_in_fp32=True)
        cpu_mm = as_cpu.of_rule(dq_matmul.NAME)
        assert all(r.fp32 and r.scales.data_type == onnx.TensorProto.FLOAT for r in cpu_mm)
        assert all(r.scales.nbytes == 2 * k.scales.nbytes for r, k in zip(cpu_mm, kept_mm))
        skel = rewrite_skeleton(m, as_cpu, WEIGHTS_FILE)
    casts = [n for n in skel.graph.node if n.op_type == "Cast" and n.name.startswith("InsertedPrecisionFreeCast_")]
    assert len(casts) >= 2 * len(cpu_mm)


@pytest.mark.usefixtures("no_temp_folder")
def test_level2_bias_fold_is_left_to_ort(tmp_path):
    """A bias Add after a 3-D MatMul is folded by ORT's Level-2 MatMulNBitsFusion, *after*
    BiasGeluFusion has taken the Add when a Gelu follows. ortmem leaves that Add in place, so ORT makes
    the same choice on the converted graph (folding it ahead of time changed all-MiniLM-L6-v2's
    outputs by 0.05)."""
    from onnx import TensorProto as T
    from onnx import helper as H
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(3)
    K = N = 64
    codes = rng.integers(0, 256, size=(K * N // 2,), dtype=np.uint8)
    f = lambda v, name: nh.from_array(np.asarray(v, np.float32), name)  # noqa: E731
    inits = [H.make_tensor("W", T.INT4, [K, N], codes.tobytes(), raw=True), f(rng.random((K // 32, N)) * 0.02, "S"),
             f(rng.standard_normal(N), "b"), f(np.sqrt(2.0), "sq2"), f(1.0, "one"), f(0.5, "half")]
    nodes = [H.make_node("DequantizeLinear", ["W", "S"], ["Wd"], axis=0, block_size=32),
             H.make_node("MatMul", ["X", "Wd"], ["y"]), H.make_node("Add", ["y", "b"], ["h"]),
             H.make_node("Div", ["h", "sq2"], ["d"]), H.make_node("Erf", ["d"], ["e"]),
             H.make_node("Add", ["e", "one"], ["e1"]), H.make_node("Mul", ["h", "e1"], ["m"]),
             H.make_node("Mul", ["m", "half"], ["Y"])]
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("X", T.FLOAT, ["b", "s", K])],
                     [H.make_tensor_value_info("Y", T.FLOAT, ["b", "s", N])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(H.make_model(g, ir_version=10, opset_imports=[H.make_opsetid("", 21)]), path)
    x = {"X": rng.standard_normal((2, 5, K)).astype(np.float32)}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    sess = ortmem.InferenceSession(path, cache=False)
    skel = onnx.load_from_string(sess.ortmem_handoff.memory.skeleton)
    ops = [n.op_type for n in skel.graph.node][:2]
    assert np.array_equal(sess.run(None, x)[0], want)
    assert ops == ["MatMulNBits", "Add"]  # the Add is ORT's to fold


@pytest.mark.slow
def test_gbq_first_run_does_not_dequantize_the_table(tmp_path):
    """Fresh processes: ORT's first run dequantizes the whole table (V x D x 4 bytes, 125 MiB here);
    with GatherBlockQuantized the first run costs a few MiB. Numbers for a larger table: docs/fusion.md."""
    from ortmem.measure.probe import probe

    path = tmp_path / "m" / "model.onnx"
    path.parent.mkdir()
    write_model(SynthConfig.tiny(embedding="quantized", vocab=32000, hidden=1024, intermediate=2816, layers=1,
                                 heads=8, storage="external"), path)
    table_fp32 = 32000 * 1024 * 4
    opts = {"dims": {"batch": 1, "seq": 8}}
    ort_run = probe("ort", path, options=opts)
    om_run = probe("ortmem-nocache", path, options=opts)
    assert ort_run.output_hash == om_run.output_hash
    ort_cost = ort_run.peak_run_bytes - ort_run.rss_after_create_bytes
    om_cost = om_run.peak_run_bytes - om_run.rss_after_create_bytes
    assert ort_cost > 0.9 * table_fp32
    assert om_cost < 0.1 * table_fp32


def test_zero_point_shared_with_a_dq_that_stays_is_carried(tmp_path):
    """ORT's rule lets a fused DQ share its zero point (check 8 covers weight and scale only); the DQ
    that stays still reads it, so it must be carried into the converted model (left behind, ORT
    fails with 'External data path does not exist')."""
    from onnx import TensorProto as T
    from onnx import helper as H
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    K = N = 256
    u4 = lambda name, shape: H.make_tensor(name, T.UINT4, shape, rng.integers(0, 256, int(np.prod(shape)) // 2,  # noqa: E731
                                                                              dtype=np.uint8).tobytes(), raw=True)
    inits = [u4("W1", [K, N]), u4("W2", [K, N]), u4("Z", [K // 32, N]),
             nh.from_array((rng.random((K // 32, N)) * 0.01).astype(np.float32), "S1"),
             nh.from_array((rng.random((K // 32, N)) * 0.01).astype(np.float32), "S2")]
    nodes = [H.make_node("DequantizeLinear", ["W1", "S1", "Z"], ["D1"], axis=0, block_size=32),
             H.make_node("MatMul", ["X", "D1"], ["Y1"]),
             H.make_node("DequantizeLinear", ["W2", "S2", "Z"], ["D2"], axis=0, block_size=32),
             H.make_node("Neg", ["D2"], ["Y2"])]
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("X", T.FLOAT, [2, K])],
                     [H.make_tensor_value_info("Y1", T.FLOAT, None), H.make_tensor_value_info("Y2", T.FLOAT, None)], inits)
    path = tmp_path / "m.onnx"
    onnx.save(H.make_model(g, ir_version=10, opset_imports=[H.make_opsetid("", 21)]), path,
              save_as_external_data=True, location="m.data", size_threshold=0)
    x = {"X": rng.standard_normal((2, K)).astype(np.float32)}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)
    for cache in (tmp_path / "cache", False):
        got = ortmem.InferenceSession(path, cache=cache).run(None, x)
        assert_same_outputs(got, want)


def test_cache_prune_keeps_the_most_recently_used_within_the_limit(tmp_path, monkeypatch, capsys):
    """Three models' entries; pruning to the size of about one keeps the one used last. The hard-linked
    source of an entry is not counted (removing the entry would not free it)."""
    from ortmem.cli import main

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "root"))
    paths = []
    for i in range(3):
        (tmp_path / f"m{i}").mkdir()
        paths.append(write_model(SynthConfig.tiny(storage="external", seed=i), tmp_path / f"m{i}" / "model.onnx"))
        ortmem.InferenceSession(paths[-1], prepacked=False)
    cache = Cache()
    entries = {e.manifest()["source"]: e for e in cache.entries()}
    assert len(entries) == 3
    owned = {k: e.owned_bytes() for k, e in entries.items()}
    assert all(0 < n < e.size_bytes() for n, e in zip(owned.values(), entries.values()))  # the link is not owned
    os.utime(entries[str(paths[1])].path / "manifest.json", (1, 1))  # long unused
    assert ortmem.InferenceSession(paths[0], prepacked=False).ortmem_cache_hit  # used just now
    assert main(["cache", "prune", "--max-size", str(owned[str(paths[0])] + 4096)]) == 0
    assert "freed" in capsys.readouterr().out
    left = [e.manifest()["source"] for e in cache.entries()]
    assert left == [str(paths[0])]
    assert ortmem.InferenceSession(paths[0]).ortmem_cache_hit and not ortmem.InferenceSession(paths[2]).ortmem_cache_hit


def test_cache_max_size_applies_after_each_new_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("ORTMEM_CACHE_MAX_SIZE", "1")  # smaller than any entry: only the newest stays
    for i in range(2):
        d = tmp_path / f"m{i}"
        d.mkdir()
        p = write_model(SynthConfig.tiny(storage="external", seed=i), d / "model.onnx")
        s = ortmem.InferenceSession(p)
        assert np.array_equal(s.run(None, FEEDS)[0], _ort(p)[0])
        assert [e.manifest()["source"] for e in Cache().entries()] == [str(p)]
