"""ortmem.plan.recompute: candidates, savings and plans on graphs whose answer is known by hand, the
peak-minimizing order against exhaustive search, bit-identical outputs through ORT, plan strings,
the CLI, and the settings a rewritten model records replayed by the session."""
from __future__ import annotations

import argparse
import json
import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortmem.plan import recompute as rc
from ortmem.plan.estimate.liveness import analyze, context, load_proto
from ortmem.plan.recompute import add_recompute_arguments, main_recompute
from ortmem.base.units import bytes_arg
from tests.support.recompute_models import LlamaMaskConfig, llama_shared_mask
from tests.support.planner_graphs import graph_model, i64, long_cast, two_branches
from tests.support.compare import assert_same_outputs

F = TensorProto.FLOAT
N = 1024
KiB = 1024


def _save(m: onnx.ModelProto, tmp_path, name: str) -> str:
    p = tmp_path / name
    onnx.save(m, p)
    return str(p)


def tile_three_layers() -> onnx.ModelProto:
    """T = Tile(s, 4) (4 KiB) is read by three layers; each layer a = Add(h, T), b = Tile(a, 4)
    (16 KiB), h = Slice(b) (4 KiB)."""
    nodes = [helper.make_node("Tile", ["s", "four"], ["T"], name="T")]
    h = "x"
    for i in (1, 2, 3):
        nodes += [helper.make_node("Add", [h, "T"], [f"a{i}"], name=f"a{i}"),
                  helper.make_node("Tile", [f"a{i}", "four"], [f"b{i}"], name=f"b{i}"),
                  helper.make_node("Slice", [f"b{i}", "zero", "n"], [f"h{i}"], name=f"h{i}")]
        h = f"h{i}"
    return graph_model(nodes, [helper.make_tensor_value_info("x", F, [N]), helper.make_tensor_value_info("s", F, [N // 4])],
                       [helper.make_tensor_value_info(h, F, [N])], [i64("four", [4]), i64("zero", [0]), i64("n", [N])])


def no_gain_chain() -> onnx.ModelProto:
    """T = Slice(Expand(s)) (1 KiB) is read early (u) and late (w); the peak is where T is built:
    Expand's 40 KiB + T. Rebuilding T for w would need the 40 KiB Expand again next to v: the peak
    rises to 42 KiB, so it must not be chosen. ``w`` sits early in the file so that DEFAULT's reverse
    DFS (highest index first) runs it last."""
    nodes = [helper.make_node("Expand", ["s", "shape"], ["e"], name="e"),
             helper.make_node("Slice", ["e", "zero", "one", "zero"], ["T"], name="T"),
             helper.make_node("Neg", ["T"], ["w"], name="w"),
             helper.make_node("Neg", ["T"], ["u"], name="u"),
             helper.make_node("Tile", ["u", "tile"], ["B"], name="B"),
             helper.make_node("Slice", ["B", "zero", "n256", "one"], ["v"], name="v"),
             helper.make_node("Add", ["v", "w"], ["y"], name="y")]
    return graph_model(nodes, [helper.make_tensor_value_info("s", F, [1, 256])], [helper.make_tensor_value_info("y", F, [1, 256])],
                       [i64("shape", [40, 256]), i64("zero", [0]), i64("one", [1]), i64("tile", [1, 32]),
                        i64("n256", [256])])


def _run(path: str, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    rc.apply_session_changes(so, rc.recorded_settings(onnx.load(path, load_external_data=False)))
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _identical(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


# ----------------------------------------------------------------------------------- by hand
def test_long_lived_cast_recomputed(tmp_path):
    path = _save(long_cast(), tmp_path, "c.onnx")
    res = rc.plan(path)
    assert res.original_peak_bytes == 80 * KiB
    assert res.plan == "Cast+:1:-1"
    assert res.peak_bytes == 72 * KiB  # Tile and Slice no longer see the 8 KiB Cast
    row = next(r for r in res.clusters if r.pattern == "Cast+")
    assert row.chosen and row.occurrences == 1 and row.saved_bytes == 8 * KiB and row.cost_class == "cheap"
    assert row.tensors[0]["resolved"] == [N] and row.extra_flops == N
    assert res.session_changes() == {"execution_order": "DEFAULT",
                                     "session_config": {rc.DISABLE_OPTIMIZERS_KEY: rc.CSE}}
    out = _save(rc.materialize(res, onnx.load(path)), tmp_path, "c_rc.onnx")
    assert sum(n.op_type == "Cast" for n in onnx.load(out).graph.node) == 2
    assert analyze(context(out)).peak_bytes == 72 * KiB  # the written file replays to the prediction
    feeds = {"x": np.random.default_rng(0).standard_normal(N).astype(np.float32)}
    assert _identical(_run(path, feeds), _run(out, feeds))


def test_tile_used_by_three_layers(tmp_path):
    path = _save(tile_three_layers(), tmp_path, "t.onnx")
    ctx = context(path)
    lv = analyze(ctx)
    # T 4K; T+a1 8K; T+a1+b1 24K (peak, layer 1); ... layer 3 reads T last
    assert lv.peak_bytes == 24 * KiB and lv.peak_node == "b1"
    assert [t.name for t in lv.across_peak] == ["T"]
    occ = rc.discover(rc.initial_state(ctx))
    t_occ = [o for o in occ if o.tensor == "T"]
    assert [o.group for o in t_occ] == [1, 2] and all(o.pattern == "Tile+" for o in t_occ)
    res = rc.plan(path)
    assert res.plan == "Tile+:1:-1" and res.peak_bytes == 20 * KiB  # T lives only inside each layer's Add
    assert res.clusters[0].occurrences == 2
    out = _save(rc.materialize(res, onnx.load(path)), tmp_path, "t_rc.onnx")
    assert sum(n.op_type == "Tile" and n.input[0] == "s" for n in onnx.load(out).graph.node) == 3
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal(N).astype(np.float32), "s": rng.standard_normal(N // 4).astype(np.float32)}
    assert _identical(_run(path, feeds), _run(out, feeds))
    # a budget reached by the first choice stops there; one below what recompute can do is reported
    assert rc.plan(path, budget=22 * KiB).peak_bytes == 20 * KiB
    low = rc.plan(path, budget=10 * KiB)
    assert low.peak_bytes == 20 * KiB and any("budget" in n for n in low.notes)


def test_recompute_that_does_not_lower_the_peak_is_not_chosen(tmp_path):
    path = _save(no_gain_chain(), tmp_path, "n.onnx")
    res = rc.plan(path)
    # e 40K + T 1K at T is the peak; T is read by u and, after a 33 KiB Tile, by w
    assert res.original_peak_bytes == 41 * KiB
    row = next(r for r in res.clusters if r.tensors[0]["name"] == "T")
    assert row.pattern == "Expand+Slice+" and row.saved_bytes < 0  # discovered, and it would hurt
    assert not row.chosen and res.plan == "" and not res.changed
    assert rc.materialize(res, onnx.load(path)).graph == onnx.load(path).graph
    forced = rc.plan(path, plan_text="Expand+Slice+:1:-1")  # asked for: applied, re-verified, refused
    assert not forced.changed and forced.peak_bytes == res.original_peak_bytes
    assert any("does not lower" in n for n in forced.notes)


def test_plan_string_round_trip(tmp_path):
    path = _save(tile_three_layers(), tmp_path, "t.onnx")
    res = rc.plan(path)
    entries = rc.parse_plan(res.plan)
    assert rc.format_plan(entries) == res.plan
    again = rc.plan(path, plan_text=res.plan)
    assert again.peak_bytes == res.peak_bytes and again.plan == res.plan
    assert [n.name for n in rc.materialize(again).graph.node] == [n.name for n in rc.materialize(res).graph.node]
    one = rc.plan(path, plan_text="Tile+:1:1")  # only the clone nearest the end: layer 3
    assert one.peak_bytes == 24 * KiB  # layers 1 and 2 still hold T
    assert rc.parse_plan(" A+B+:1:-1 , C+:0:2") == [rc.PlanEntry("A+B+", 1, -1), rc.PlanEntry("C+", 0, 2)]
    for bad in ("A+", "A:1:-1", "A+:2:1", "A+:1:0"):
        with pytest.raises(ValueError):
            rc.parse_plan(bad)
    assert "matches nothing" in " ".join(rc.plan(path, plan_text="Gelu+:1:-1").notes)


def test_summary_lists_every_pattern_and_how_to_enable_it(tmp_path):
    res = rc.plan(_save(tile_three_layers(), tmp_path, "t.onnx"))
    text = rc.render(res)
    assert "Recompute Tile+" in text and "Enabled (chosen)" in text and "Extra compute" in text
    d = json.loads(res.to_json())
    assert d["plan"] == "Tile+:1:-1" and d["session_changes"]["execution_order"] == "DEFAULT"


def test_expensive_ops_only_when_asked(tmp_path):
    # c = Softmax(x) read before and after a big Tile: expensive class
    m = long_cast()
    m.graph.node[0].CopyFrom(helper.make_node("Softmax", ["x"], ["c0"], name="softmax", axis=-1))
    m.graph.node.insert(1, helper.make_node("Cast", ["c0"], ["c"], name="cast", to=TensorProto.DOUBLE))
    path = _save(m, tmp_path, "s.onnx")
    cheap = rc.plan(path)
    assert "Softmax" not in cheap.plan
    dear = rc.plan(path, expensive=True)
    assert "Softmax+Cast+" in dear.plan and dear.peak_bytes < cheap.peak_bytes
    assert rc.cost_class(context(path).root.nodes[0]) == "expensive"


# ----------------------------------------------------------------------------------- order
def _random_dag(seed: int, n_nodes: int) -> onnx.ModelProto:
    """1-D float tensors; each node Neg, Concat of two earlier tensors, or the first half (Slice)."""
    rnd = random.Random(seed)
    vals = [("x", N)]
    nodes, inits, used = [], [i64("zero", [0])], set()
    for k in range(n_nodes):
        kind = rnd.choice(["neg", "concat", "half", "concat"])
        a, sa = rnd.choice(vals)
        name = f"n{k}"
        if kind == "neg":
            nodes.append(helper.make_node("Neg", [a], [name], name=name))
            size = sa
        elif kind == "concat":
            b, sb = rnd.choice(vals)
            nodes.append(helper.make_node("Concat", [a, b], [name], name=name, axis=0))
            size = sa + sb
            used.add(b)
        else:
            inits.append(i64(f"h{k}", [sa // 2]))
            nodes.append(helper.make_node("Slice", [a, "zero", f"h{k}"], [name], name=name))
            size = sa // 2
        used.add(a)
        vals.append((name, size))
    outs = [v for v, _ in vals[1:] if v not in used]
    return graph_model(nodes, [helper.make_tensor_value_info("x", F, [N])],
                       [helper.make_tensor_value_info(o, F, None) for o in outs], inits)


@pytest.mark.parametrize("seed", range(6))
def test_order_heuristic_against_exhaustive(tmp_path, seed):
    path = _save(_random_dag(seed, 8), tmp_path, f"r{seed}.onnx")
    ctx = context(path)
    best, best_peak = rc.exhaustive_order(ctx)
    res = rc.best_order(ctx)
    assert best_peak <= res.peak_bytes <= min(res.default_peak_bytes, res.priority_peak_bytes)
    assert res.peak_bytes <= 1.15 * best_peak, (res.tried, best_peak)
    assert rc.evaluate_order(ctx, best) == best_peak


def test_order_picks_the_branch_that_frees_first(tmp_path):
    # DEFAULT builds the 16 KiB branch first (40 KiB peak); the best order builds the 32 KiB one
    # first (36 KiB), which exhaustive search confirms
    m = two_branches()
    path = _save(m, tmp_path, "b.onnx")
    ctx = context(path)
    assert rc.exhaustive_order(ctx)[1] == 36 * KiB
    assert rc.best_order(ctx).peak_bytes == 36 * KiB
    res = rc.plan(path, order=True, plan_text="")
    assert res.original_peak_bytes == 40 * KiB and res.peak_bytes == 36 * KiB
    assert res.changed and res.execution_order == "PRIORITY_BASED"
    out = _save(rc.materialize(res, onnx.load(path)), tmp_path, "b_order.onnx")
    assert rc.recorded_settings(onnx.load(out)) == {"execution_order": "PRIORITY_BASED"}  # no clones: CSE stays on
    assert analyze(context(out), "PRIORITY_BASED").peak_bytes == 36 * KiB
    feeds = {"x": np.random.default_rng(2).standard_normal(N).astype(np.float32)}
    assert _identical(_run(path, feeds), _run(out, feeds))


# ----------------------------------------------------------------------------------- ORT end to end
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    m = llama_shared_mask(LlamaMaskConfig(layers=3, hidden=64, heads=1, intermediate=96, vocab=128))
    path = d / "model.onnx"
    onnx.save(m, path)
    return path


def test_shared_mask_llama_bit_identical_and_lower(tiny_llama, tmp_path):
    from ortmem.plan.estimate.liveness import ort_optimized

    S = 1024
    dims = {"batch": 2, "seq": S}
    opt_path = tmp_path / "opt.onnx"
    opt = ort_optimized(tiny_llama, opt_path)
    res = rc.plan(str(opt_path), dims)
    assert res.changed and res.saved_bytes >= 2 * S * S * 4  # at least the [2, 1, S, S] fp32 mask
    assert "Where" in res.plan and "Expand" in res.plan
    out = _save(rc.materialize(res, opt), tmp_path, "rw.onnx")
    rng = np.random.default_rng(3)
    feeds = {"input_ids": rng.integers(0, 128, (2, S), dtype=np.int64), "attention_mask": np.ones((2, S), np.int64)}
    feeds["attention_mask"][1, 900:] = 0
    assert _identical(_run(str(tiny_llama), feeds), _run(out, feeds))
    # ORT's profile of the rewritten model (defaults, patterns off) agrees with the prediction
    so = ort.SessionOptions()
    so.enable_mem_pattern = False
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    so.log_severity_level = 3
    peaks = []
    for p in (str(opt_path), out):
        s2 = ort.SessionOptions()
        for k in ("enable_mem_pattern", "enable_profiling", "profile_file_prefix", "log_severity_level"):
            setattr(s2, k, getattr(so, k))
        rc.apply_session_changes(s2, rc.recorded_settings(onnx.load(p, load_external_data=False)))
        sess = ort.InferenceSession(p, s2, providers=["CPUExecutionProvider"])
        sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            ev = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        if "mem_bytes_in_use" not in ev[0]["args"]:  # outputs were checked above
            pytest.skip(f"onnxruntime {ort.__version__}'s profiler reports no arena figures per node")
        base = int(ev[0]["args"]["mem_bytes_in_use"]) - int(ev[0]["args"]["mem_in_use_delta"])
        peaks.append(max(int(e["args"]["mem_in_use_peak"]) for e in ev) - base)
    measured = peaks[0] - peaks[1]
    assert abs(measured - res.saved_bytes) <= 0.1 * res.saved_bytes, (peaks, res.saved_bytes)


def test_recorded_settings_merge_with_the_users():
    """What a rewrite records comes back from its metadata; a user's own disabled optimizers stay."""
    m = onnx.ModelProto()
    for k, v in (("execution_order", "PRIORITY_BASED"), ("disabled_optimizers", rc.CSE)):
        p = m.metadata_props.add()
        p.key, p.value = rc.META_PREFIX + k, v
    changes = rc.recorded_settings(m)
    assert changes == {"execution_order": "PRIORITY_BASED", "session_config": {rc.DISABLE_OPTIMIZERS_KEY: rc.CSE}}
    assert rc.recorded_settings(onnx.ModelProto()) == {}
    so = ort.SessionOptions()
    so.add_session_config_entry(rc.DISABLE_OPTIMIZERS_KEY, "ConstantFolding")
    rc.apply_session_changes(so, changes)
    assert so.get_session_config_entry(rc.DISABLE_OPTIMIZERS_KEY) == "ConstantFolding;" + rc.CSE
    assert so.execution_order == ort.ExecutionOrder.PRIORITY_BASED


def test_cli(tiny_llama, tmp_path, capsys):
    ap = argparse.ArgumentParser()
    add_recompute_arguments(ap)
    out = tmp_path / "out" / "model.onnx"
    args = ap.parse_args([str(tiny_llama), "--dim", "batch=2", "--dim", "seq=256", "-o", str(out), "--no-verify"])
    assert main_recompute(args) == 0
    text = capsys.readouterr().out
    assert "ortmem recompute summary" in text and "wrote" in text
    assert out.exists() and (out.parent / "model.onnx.data").exists()
    assert rc.recorded_settings(onnx.load(out, load_external_data=False))["execution_order"] in ("DEFAULT", "PRIORITY_BASED")
    plan = next(p.value for p in onnx.load(out, load_external_data=False).metadata_props
                if p.key == "ortmem.recompute.plan")
    args = ap.parse_args([str(tiny_llama), "--dim", "batch=2", "--dim", "seq=256", "--plan", plan, "--json"])
    assert main_recompute(args) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == plan
    assert bytes_arg("64MiB") == 64 << 20 and bytes_arg("1.5GB") == 1_500_000_000 and bytes_arg("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        bytes_arg("lots")


def test_session_replays_recorded_settings(tiny_llama, tmp_path):
    """A model written by ``ortmem recompute`` runs through ``ortmem.InferenceSession`` with the order
    and settings it records (merged with the user's disabled optimizers, for the creation call only),
    and gives what plain ORT with :func:`apply_session_changes` gives, and ORT's outputs on the original."""
    import ortmem
    from ortmem.ort.feeds import make_inputs

    dims = {"batch": 2, "seq": 64}
    out = tmp_path / "out" / "model.onnx"
    ap = argparse.ArgumentParser()
    add_recompute_arguments(ap)
    args = ap.parse_args([str(tiny_llama), "--dim", "batch=2", "--dim", "seq=64", "-o", str(out), "--no-verify"])
    assert main_recompute(args) == 0
    changes = rc.recorded_settings(onnx.load(out, load_external_data=False))
    assert changes["session_config"] == {rc.DISABLE_OPTIMIZERS_KEY: rc.CSE}

    original = ort.InferenceSession(str(tiny_llama), providers=["CPUExecutionProvider"])
    feeds = make_inputs(original, {"dims": dims})
    expected = original.run(None, feeds)
    plain_so = ort.SessionOptions()
    plain_so.add_session_config_entry(rc.DISABLE_OPTIMIZERS_KEY, "ConstantFolding")
    rc.apply_session_changes(plain_so, changes)
    plain = ort.InferenceSession(str(out), plain_so, providers=["CPUExecutionProvider"]).run(None, feeds)

    so = ort.SessionOptions()
    so.add_session_config_entry(rc.DISABLE_OPTIMIZERS_KEY, "ConstantFolding")
    sess = ortmem.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    assert sess.ortmem_recompute == changes
    used = sess.get_session_options()
    assert used.get_session_config_entry(rc.DISABLE_OPTIMIZERS_KEY) == "ConstantFolding;" + rc.CSE
    assert used.execution_order == getattr(ort.ExecutionOrder, changes["execution_order"])
    got = sess.run(None, feeds)
    assert_same_outputs(got, plain)
    assert_same_outputs(got, expected)
    assert so.execution_order == ort.ExecutionOrder.DEFAULT  # the caller's options read back unchanged
    assert so.get_session_config_entry(rc.DISABLE_OPTIMIZERS_KEY) == "ConstantFolding"
    assert ortmem.InferenceSession(tiny_llama).ortmem_recompute == {}  # nothing recorded, nothing replayed
