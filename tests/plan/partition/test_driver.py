"""Partitioning: stages, crossing tensors, the shared weights file, the plan file,
the report, ORT's own settings and the CLI. Running the stages is tested in tests/plan/partition/run/test_pipeline_session.py."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortmem
from ortmem.onnxfile.walk import external_data_dict, iter_tensor_sites
from ortmem.plan.partition import driver as P
from ortmem.plan.partition import stages
from ortmem.errors import PlanError
from ortmem.plan.partition import PartitionPlan, default_provider, partition
from ortmem.plan.partition import add_partition_arguments, main_partition
from ortmem.base.units import parse_bytes
from ortmem.onnxfile.weights import FILE_ALIGN
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.builders import make_model, save, subgraph_model
from tests.support.reference import run_plain

DIMS = {"batch": 2, "seq": 16}
CPUS = {"cpu:0": "CPUExecutionProvider", "cpu:1": "CPUExecutionProvider"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(SynthConfig.tiny(storage="external"), tmp_path_factory.mktemp("tiny") / "tiny.onnx")


@pytest.fixture(scope="module")
def tiny_embedded(tmp_path_factory) -> Path:
    return write_model(SynthConfig.tiny(storage="embedded", name="tinye"), tmp_path_factory.mktemp("tinye") / "t.onnx")


def plan3(model: Path, out: Path | None, **kw) -> PartitionPlan:
    """Three devices: two small ones that split the layers, then a big one (first-order costs only)."""
    kw.setdefault("stage_overhead", 0)
    kw.setdefault("verify", False)
    return partition(model, {"cpu:0": 330_000, "cpu:1": 300_000, "cpu": 10**8}, dims=DIMS, out_dir=out, **kw)


def external_refs(path: Path) -> list[tuple[str, int, int]]:
    m = onnx.load(str(path), load_external_data=False)
    out = []
    for site in iter_tensor_sites(m):
        if site.tensor.data_location == TensorProto.EXTERNAL:
            info = external_data_dict(site.tensor)
            out.append((info["location"], int(info["offset"]), int(info["length"])))
    return out


# ------------------------------------------------------------------------------------------- stages
def test_stages_cover_every_node_once_in_execution_order(tiny, tmp_path):
    plan = plan3(tiny, tmp_path / "out")
    with ortmem.load(tiny) as model:
        names = [n.name for n in model.skeleton.graph.node]
        const = {n.name for n in model.skeleton.graph.node if n.op_type == "DequantizeLinear"}
    placed = [n for s in plan.stages for n in s.nodes]
    assert sorted(placed) == sorted(set(names) - const)  # every planned node exactly once
    assert [names.index(n) for n in placed] == sorted(names.index(n) for n in placed)  # contiguous, in order
    assert all(s.device != t.device for s, t in zip(plan.stages, plan.stages[1:]))  # maximal runs
    # constant chains (a weight's DequantizeLinear) go with the MatMul reading them, never across a cut
    for s in plan.stages:
        for dq in s.replicated:
            assert dq.replace(".dq", ".matmul") in s.nodes
    assert len({s.device for s in plan.stages}) >= 2


def test_budgets_hold_by_first_order_costs(tiny, tmp_path):
    plan = plan3(tiny, None)
    for d in plan.devices:
        assert d.first_order_bytes <= d.budget_bytes
        mine = [s for s in plan.stages if s.device == d.name]
        assert d.weight_bytes == sum(s.weight_bytes for s in mine) - d.shared_credit_bytes


def test_crossing_tensors_are_exactly_what_later_stages_read(tiny, tmp_path):
    plan = plan3(tiny, tmp_path / "out")
    made = {c.name: c for c in plan.crossings}
    for k, st in enumerate(plan.stages):
        for x in st.inputs:
            if x in plan.inputs:
                continue
            assert x in made and made[x].from_stage < k and k in made[x].to_stages
        for x in st.outputs:
            assert x in plan.outputs or (x in made and made[x].from_stage == k)
    for c in plan.crossings:  # typed, sized with the plan's dims
        assert c.elem_type == TensorProto.FLOAT or c.elem_type == TensorProto.INT64 or c.elem_type
        assert c.bytes is not None and c.bytes > 0
    cuts = plan.boundaries()
    assert len(cuts) == len(plan.stages) - 1
    for b in cuts:
        assert b["tensors"] and b["bytes"] == sum(made[t].bytes for t in b["tensors"])


def test_cut_post_pass_finds_the_fewest_crossing_tensors(tiny):
    """A cut inside an MLP (hidden, normed input, gate, mask alive across it) moves to the module
    boundary with the fewest live tensors among those the budgets and the slack allow."""
    with ortmem.load(tiny) as model:
        G = P.PartitionGraph(model)
        act_b, ws_b, _ = P.node_costs(G, model, DIMS, None)
        tree = P.group_modules(G.planned_graph, G.set_costs(act_b, ws_b), by=P.module_names(G.labels, "scope"))
    costs = P.StageCosts(G, [0, 0])
    bounds = P.module_boundaries(G, tree)
    count, _ = stages._live_across(G)
    n = len(G.order)
    start = G.labels.index("model.layers.0.mlp.up_proj.matmul")
    assert count[start] >= 4
    limits = [costs.device_totals([stages.CandidateStage(0, n, 0)], 2)[0][0] * 3 // 4, 10**9]  # dev0 cannot take everything
    budgets = [limits[0], 10**9]
    slack = 0.3
    got = stages._improve_cuts([stages.CandidateStage(0, start, 0), stages.CandidateStage(start, n, 1)], G, costs, bounds, limits, budgets, slack)
    assert len(got) == 2
    cut = got[0].hi
    base = costs.device_totals([stages.CandidateStage(0, start, 0), stages.CandidateStage(start, n, 1)], 2)[0][0]
    allowed = [x for x in bounds if costs.device_totals([stages.CandidateStage(0, x, 0)], 2)[0][0] <= limits[0]
               and base - costs.device_totals([stages.CandidateStage(0, x, 0)], 2)[0][0] <= slack * budgets[0]]
    assert count[cut] == min(count[x] for x in allowed) < count[start]
    # the whole partitioner with no slack never gives up bytes on the first device for a better cut
    strict = partition(tiny, {"cpu:0": 520_000, "cpu": 10**8}, dims=DIMS, stage_overhead=0, verify=False, cut_slack=0.0)
    loose = partition(tiny, {"cpu:0": 520_000, "cpu": 10**8}, dims=DIMS, stage_overhead=0, verify=False, cut_slack=0.3)
    assert strict.devices[0].weight_bytes >= loose.devices[0].weight_bytes
    crossing = lambda p: sum(len(b["tensors"]) for b in p.boundaries())  # noqa: E731
    assert crossing(loose) <= crossing(strict)



def test_cut_between_nodes_moves_the_fewest_bytes(tiny):
    """Between two nodes the post-pass ranks cuts by the bytes alive across them (what the
    network carries) before the tensor count; on one node it keeps ranking by count first."""
    with ortmem.load(tiny) as model:
        G = P.PartitionGraph(model)
        act_b, ws_b, _ = P.node_costs(G, model, DIMS, None)
        tree = P.group_modules(G.planned_graph, G.set_costs(act_b, ws_b), by=P.module_names(G.labels, "scope"))
    bounds = P.module_boundaries(G, tree)
    count, nbytes = stages._live_across(G)
    n = len(G.order)
    start = G.labels.index("model.layers.0.mlp.up_proj.matmul")
    cuts = {}
    for nodes in ([None, None], ["a", "b"]):
        costs = P.StageCosts(G, [0, 0], nodes=nodes)
        limits = [costs.device_totals([stages.CandidateStage(0, n, 0)], 2)[0][0] * 3 // 4, 10**9]
        got = stages._improve_cuts([stages.CandidateStage(0, start, 0), stages.CandidateStage(start, n, 1)], G, costs, bounds, limits,
                                   [limits[0], 10**9], 0.3)
        assert len(got) == 2
        cuts[tuple(nodes)] = got[0].hi
        base = costs.device_totals([stages.CandidateStage(0, start, 0)], 2)[0][0]
        allowed = [x for x in bounds if costs.device_totals([stages.CandidateStage(0, x, 0)], 2)[0][0] <= limits[0]
                   and base - costs.device_totals([stages.CandidateStage(0, x, 0)], 2)[0][0] <= 0.3 * limits[0]]
    local, remote = cuts[(None, None)], cuts[("a", "b")]
    assert count[local] == min(count[x] for x in allowed)
    assert nbytes[remote] == min(nbytes[x] for x in allowed)
    assert nbytes[remote] <= nbytes[local]

def test_modules_by_dotted_scope_stay_whole_and_by_node_can_split_them(tiny):
    names = P.module_names(["model.layers.0.mlp.gate_proj.matmul", "mask.shape", "model.layers.0.mlp.up_proj.matmul",
                             "logits"], "scope")
    # the mask interrupts model.*: the later run is renamed, so every module is contiguous
    assert names == {"model.layers.0.mlp.gate_proj.matmul": "model.layers.0.mlp.gate_proj", "mask.shape": "mask",
                     "model.layers.0.mlp.up_proj.matmul": "model~2.layers.0.mlp.up_proj", "logits": "logits"}
    assert len(set(P.module_names(["a.b.c", "a.b.d"], "node").values())) == 2


# ------------------------------------------------------------------------------------------- weights on disk
def test_no_weight_duplicated_on_disk_link(tiny, tmp_path):
    out = tmp_path / "out"
    plan = plan3(tiny, out)
    assert plan.weights_mode == "link"
    assert os.path.samefile(out / "weights.bin", tiny.parent / (tiny.name + ".data"))  # a hard link: no byte copied
    data_files = [p for p in out.iterdir() if not p.name.endswith((".onnx", ".json", ".txt"))]
    assert data_files == [out / "weights.bin"]
    with ortmem.load(tiny) as m:
        source = {(r.offset, r.length) for r in m.store}
    refs = {(off, n) for st in plan.stages for loc, off, n in external_refs(out / st.file)}
    assert refs <= source and all(loc == "weights.bin" for st in plan.stages for loc, _, _ in external_refs(out / st.file))


def test_no_weight_duplicated_on_disk_copy(tiny_embedded, tmp_path):
    out = tmp_path / "out"
    plan = plan3(tiny_embedded, out)
    assert plan.weights_mode == "copy"
    with ortmem.load(tiny_embedded) as m:
        weight_bytes = m.weight_bytes
        by_name = {r.name: r for r in m.store}
    assert plan.weight_bytes == weight_bytes
    spans = {}
    for st in plan.stages:
        for t in onnx.load(str(out / st.file), load_external_data=False).graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                info = external_data_dict(t)
                spans[t.name] = (int(info["offset"]), int(info["length"]))
    # every weight once: the spans are disjoint, add up to the model's weight bytes, and the file is
    # those bytes plus page alignment between them
    assert set(spans) == set(by_name)
    ordered = sorted(spans.values())
    assert all(a + n <= b for (a, n), (b, _) in zip(ordered, ordered[1:]))
    assert sum(n for _, n in ordered) == weight_bytes
    size = (out / "weights.bin").stat().st_size
    assert size == ordered[-1][0] + ordered[-1][1] and size - weight_bytes < FILE_ALIGN * len(ordered)
    data = (out / "weights.bin").read_bytes()
    with ortmem.load(tiny_embedded) as m:
        for name, (off, n) in spans.items():
            assert data[off:off + n] == m.weight(name).raw().tobytes()
    # the stage files hold no weight bytes of their own beyond the small inline constants
    assert sum((out / s.file).stat().st_size for s in plan.stages) < 64 * 1024


def test_rewriting_a_folder_removes_the_previous_stages(tiny, tmp_path):
    out = tmp_path / "out"
    first = plan3(tiny, out)
    partition(tiny, {"cpu": 10**8}, dims=DIMS, out_dir=out, stage_overhead=0, verify=False)
    left = sorted(p.name for p in out.glob("stage*.onnx"))
    assert left == ["stage0_cpu.onnx"] and len(first.stages) > 1


# ------------------------------------------------------------------------------------------- shared weights
def _tied_model(n: int = 64) -> onnx.ModelProto:
    """Two modules read one weight W (a tied projection); a third module between them has its own."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "W")
    mid = numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "M")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="/enc/MatMul"),
             helper.make_node("MatMul", ["a", "M"], ["b"], name="/mid/MatMul"),
             helper.make_node("MatMul", ["b", "W"], ["y"], name="/dec/MatMul")]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w, mid])
    return make_model(g)


def test_shared_weight_charged_once_per_device(tmp_path):
    path = save(_tied_model(), tmp_path / "tied.onnx")
    wbytes = 64 * 64 * 4
    # one device holds the whole model although its modules' sizes add up to 3 W (W counted twice)
    plan = partition(path, {"cpu:0": 2 * wbytes + 4096, "cpu": 10**8}, stage_overhead=0, verify=False)
    assert [s.device for s in plan.stages] == ["cpu:0"]
    assert plan.devices[0].weight_bytes == 2 * wbytes
    # two stages on one device reading W: the device counts W once (the credit)
    with ortmem.load(path) as model:
        G = P.PartitionGraph(model)
        G.set_costs({}, {})
        costs = P.StageCosts(G, [0, 0])
        totals, credit = costs.device_totals([stages.CandidateStage(0, 1, 0), stages.CandidateStage(1, 2, 1), stages.CandidateStage(2, 3, 0)], 2)
    assert credit == [wbytes, 0]
    assert totals == [wbytes, wbytes]  # W once on device 0 (no activations were given)


# ------------------------------------------------------------------------------------------- subgraphs
def test_subgraphs_stay_whole_with_their_node(tmp_path):
    path = save(subgraph_model(np.random.default_rng(0)), tmp_path / "sub" / "m.onnx")
    out = tmp_path / "out"
    plan = partition(path, {"cpu:0": 140_000, "cpu:1": 140_000, "cpu": 10**8}, by="node", out_dir=out,
                     stage_overhead=0, verify=False)
    assert len(plan.stages) >= 2
    where = {n: s.index for s in plan.stages for n in s.nodes}
    assert where["If#0"] != where["Loop#1"]  # the budgets force the two control-flow nodes apart
    for st in plan.stages:
        onnx.checker.check_model(str(out / st.file))
        m = onnx.load(str(out / st.file), load_external_data=False)
        for node in m.graph.node:
            if node.op_type == "If":  # both branches, each with its own initializer, inside the If
                branches = {a.name: a.g for a in node.attribute}
                assert {t.name for t in branches["then_branch"].initializer} == {"W_then"}
                assert {t.name for t in branches["else_branch"].initializer} == {"W_else"}
            if node.op_type == "Loop":  # the outer-scope weight its body reads comes along
                assert "W_outer" in {t.name for t in m.graph.initializer}
        # initializers are only those the stage's nodes read
        used = {x for n in m.graph.node for x in n.input} | {"W_outer"}
        assert {t.name for t in m.graph.initializer} <= used


# ------------------------------------------------------------------------------------------- errors
def test_nothing_fits_raises_with_the_bytes_each_device_needs(tiny):
    with pytest.raises(PlanError, match="would need") as info:
        partition(tiny, {"cpu:0": 100_000, "cpu": 200_000}, dims=DIMS, stage_overhead=0, verify=False)
    needed = info.value.needed
    assert set(needed) == {"cpu:0", "cpu"}
    assert all(v is None or v > 100_000 for v in needed.values())


def test_bad_arguments():
    with pytest.raises(PlanError, match="names no device"):
        partition("x.onnx", {})
    with pytest.raises(PlanError, match="budget must be"):
        partition("x.onnx", {"cpu": -1})
    with pytest.raises(PlanError, match="cut_slack"):
        partition("x.onnx", {"cpu": 1}, cut_slack=2)


def test_device_names_map_to_providers():
    assert default_provider("cpu") == ("CPUExecutionProvider", {}, True)
    assert default_provider("cuda:1") == ("CUDAExecutionProvider", {"device_id": 1}, True)
    assert default_provider("0") == ("CUDAExecutionProvider", {"device_id": 0}, True)
    assert default_provider("gpu:2")[1] == {"device_id": 2}
    assert default_provider("disk")[0] == "CPUExecutionProvider"
    assert default_provider("npu7") == ("CPUExecutionProvider", {}, False)
    with pytest.warns(UserWarning, match="not a known device"):
        assert P.resolve_provider("npu7", None) == ("CPUExecutionProvider", {})
    assert P.resolve_provider("npu7", {"npu7": ("CUDAExecutionProvider", {"device_id": 3})}) == \
        ("CUDAExecutionProvider", {"device_id": 3})


# ------------------------------------------------------------------------------------------- plan, report
def test_plan_file_round_trips_and_report_says_what_did_not_fit(tiny, tmp_path):
    out = tmp_path / "out"
    plan = plan3(tiny, out)
    again = PartitionPlan.load(out)
    assert again.to_dict() == plan.to_dict()
    d = json.loads((out / "plan.json").read_text())
    for st in d["stages"]:
        assert {"index", "device", "provider", "file", "inputs", "outputs", "weight_bytes", "activation_bytes",
                "workspace_bytes"} <= set(st)
    text = (out / "report.txt").read_text()
    for dev in plan.devices:
        assert dev.name in text
    assert "what did not fit" in text and "cut after stage 0" in text
    rep = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in rep["devices"]] == ["cpu:0", "cpu:1", "cpu"]
    assert rep["devices"][0]["did_not_fit"]  # the small devices left modules to the big one, with the reason
    with pytest.raises(PlanError, match="not an ortmem partition plan"):
        PartitionPlan.from_dict({"format": "other"})


def test_stats_csv_replaces_estimated_activations(tiny, tmp_path):
    from ortmem.ort.graph_index import unique_node_name
    from ortmem.plan.estimate.node_stats import NodeStats, write_csv

    with ortmem.load(tiny) as m:
        node = next(n for n in m.skeleton.graph.node if n.name == "model.layers.1.mlp.silu")
        uname = unique_node_name(node.name, node.op_type, list(node.input), list(node.output))
    csv = tmp_path / "stats.csv"
    write_csv([NodeStats(uname, 0, 0, 5_000_000, 1_000_000)], csv)
    plan = partition(tiny, {"cpu": 10**8}, dims=DIMS, stats_csv=csv, stage_overhead=0, verify=False)
    assert plan.stages[0].activation_bytes + plan.stages[0].workspace_bytes >= 6_000_000
    assert any("measured (stats CSV) for 1 of" in n for n in plan.notes)


def test_cpu_stages_are_verified_with_the_estimator(tiny):
    mib = 1 << 20
    plan = partition(tiny, {"cpu:0": 18 * mib, "cpu": 100 * mib}, dims=DIMS)
    for st in plan.stages:
        assert st.estimated_bytes is not None and st.overhead_bytes > 0
    for d in plan.devices:
        assert d.placed_bytes <= d.budget_bytes


# ------------------------------------------------------------------------------------------- ORT's own settings
def test_ort_settings_for_one_cuda_device(tiny, tmp_path, capfd):
    out = tmp_path / "out"
    plan = partition(tiny, {"cuda:0": 600_000, "cpu": 10**8}, dims=DIMS, out_dir=out, stage_overhead=0, verify=False)
    s = plan.ort
    assert s is not None and s["model"] == "model_annotated.onnx"
    layer = s["session_config"]["session.layer_assignment_settings"]
    assert layer == "gpu:0(=ortmem_cuda_0); cpu(=ortmem_cpu)"
    assert s["alternative_session_config"]["session.resource_cuda_partitioning_settings"] == f"{600_000 // 1024},"
    assert s["providers"][0] == ["CUDAExecutionProvider", {"device_id": 0}]
    annotated = onnx.load(str(out / "model_annotated.onnx"), load_external_data=False)
    anns = {n.name: {p.key: p.value for p in n.metadata_props}.get("layer_ann") for n in annotated.graph.node}
    for st in plan.stages:
        assert {anns[n] for n in st.nodes} == {s["annotations"][st.device]}
    # The installed ORT's own parser accepts the string (the CPU build parses it; the GPU rule finds no EP
    # here) and refuses a malformed one; releases that log the parse (1.31+) say what matched.
    so = ort.SessionOptions()
    so.add_session_config_entry("session.layer_assignment_settings", layer)
    so.log_severity_level = 0
    sess = ort.InferenceSession(str(out / "model_annotated.onnx"), so, providers=["CPUExecutionProvider"])
    err = capfd.readouterr().err
    if "annotation-based layering rules" in err:
        assert "Parsed 2 annotation-based layering rules" in err and "Matched 1 out of 2 rules" in err
    ids = np.arange(32, dtype=np.int64).reshape(2, 16)
    ref = run_plain(tiny, {"input_ids": ids})[0]
    assert np.array_equal(sess.run(None, {"input_ids": ids})[0], ref)
    bad = ort.SessionOptions()
    bad.add_session_config_entry("session.layer_assignment_settings", layer.replace("(", " "))
    with pytest.raises(Exception, match="Invalid layering config"):
        ort.InferenceSession(str(out / "model_annotated.onnx"), bad, providers=["CPUExecutionProvider"])


def test_ort_settings_with_a_stats_file_and_none_without_a_gpu(tiny, tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_text("#name,input_sizes,initializers_sizes,total_dynamic_sizes,total_temp_allocations\n")
    plan = partition(tiny, {"cuda": 1 << 20, "cpu": 10**8}, dims=DIMS, out_dir=tmp_path / "o", stats_csv=csv,
                     stage_overhead=0, verify=False)
    assert plan.ort["alternative_session_config"]["session.resource_cuda_partitioning_settings"] == "1024,node_stats.csv"
    assert (tmp_path / "o" / "node_stats.csv").is_file()
    assert plan.ort["session_config"]["session.layer_assignment_settings"].startswith("cuda(=ortmem_cuda)")
    assert plan3(tiny, None).ort is None


# ------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("text,value", [("1024", 1024), ("512MiB", 512 << 20), ("2GB", 2 * 10**9),
                                        ("1.5GiB", 3 << 29), ("4k", 4096), ("10 KB", 10_000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_nonsense():
    for bad in ("", "MiB", "12XB", "-5"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_partition_arguments(parser)
    return main_partition(parser.parse_args(argv))


def test_cli_writes_a_plan_and_reports_failures(tiny, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = _cli([str(tiny), "--device", "cpu:0=330000", "--device", "cpu:1=300KB", "--device", "cpu=100MiB",
               "--dim", "batch=2", "--dim", "seq=16", "--out", str(out), "--overhead", "0", "--no-verify"])
    text = capsys.readouterr().out
    assert rc == 0 and "cpu:0" in text and (out / "plan.json").is_file()
    assert json.loads((out / "plan.json").read_text())["devices"][1]["budget_bytes"] == 300_000
    rc = _cli([str(tiny), "--device", "cpu=100KB", "--overhead", "0", "--no-verify", "--json"])
    err = capsys.readouterr().err
    assert rc == 1 and "minimum budget per device" in err
    rc = _cli([str(tiny), "--device", "cpu=1GiB", "--device", "cpu=2GiB"])
    assert rc == 2


def test_devices_on_named_nodes(tiny, tmp_path):
    """``node:<NODE>/<device>``: the provider from the local part, the node in plan.json
    for each stage and device, and the bytes each node sends each other node per request."""
    from ortmem.plan.partition import split_node

    assert split_node("node:10.0.0.2/cuda:1") == ("10.0.0.2", "cuda:1")
    assert split_node("node:n1") == ("n1", "cpu") and split_node("cpu:0") == (None, "cpu:0")
    assert default_provider("node:n1/cuda:1")[:2] == ("CUDAExecutionProvider", {"device_id": 1})
    assert default_provider("node:n1/cpu")[2] is True
    on_nodes = {"node:a/cpu": 330_000, "node:b/cpu": 300_000, "node:c/cpu": 100 << 20}
    plan = partition(tiny, on_nodes, dims={"batch": 2, "seq": 16}, stage_overhead=0, verify=False,
                     out_dir=tmp_path / "p")
    assert [s.node for s in plan.stages] == [s.device.split("/")[0][len("node:"):] for s in plan.stages]
    assert [d.node for d in plan.devices] == ["a", "b", "c"]
    back = PartitionPlan.load(tmp_path / "p")
    assert [s.node for s in back.stages] == [s.node for s in plan.stages]
    links = back.links()
    assert links and all(x["from_node"] != x["to_node"] for x in links)
    sent = sum(x["bytes"] for x in links)
    want = sum((c.bytes or 0) * len({plan.stages[t].node for t in c.to_stages} - {plan.stages[c.from_stage].node})
               for c in plan.crossings)
    assert sent == want > 0 and "network a -> b" in back.report()
    local = plan3(tiny, None)  # the same budgets on one machine: no network, no links
    assert local.links() == [] and all(s.node is None for s in local.stages)
