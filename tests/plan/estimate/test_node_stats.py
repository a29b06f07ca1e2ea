"""ortmem.plan.estimate.node_stats: ORT's node-stats CSV round trip, unique names, the initializer column, activations."""
from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortmem.ort import graph_index as og
from ortmem.plan.estimate import add_stats_arguments, main_stats
from ortmem.plan.estimate.node_stats import CSV_HEADER, NodeStats, read_csv, stats, write_csv

F = TensorProto.FLOAT


def test_csv_round_trip(tmp_path):
    rows = [NodeStats("mm1_13959969776829551232", 1024, 32768, 2048, 0), NodeStats("Relu_163", 2048, 0, 0, 64)]
    path = tmp_path / "s.csv"
    write_csv(rows, path)
    assert path.read_text().splitlines()[0] == CSV_HEADER
    assert read_csv(path) == rows
    # a repeated name keeps the maxima, as ORT's recorder does across runs
    with open(path, "a") as f:
        f.write("Relu_163,4096,0,0,8\n")
    back = {r.name: r for r in read_csv(path)}
    assert back["Relu_163"] == NodeStats("Relu_163", 4096, 0, 0, 64)


def test_unique_name_matches_ort_hash():
    # values read off ORT 1.31.1's own node-stats file for these nodes
    assert og.unique_node_name("", "Relu", ["h"], ["r"]) == "Relu_16305242092062633390"
    assert og.unique_node_name("mm1", "MatMul", ["x", "W1"], ["h"]) == "mm1_13959969776829551232"
    assert og.unique_node_name("mm2", "MatMul", ["r2", "W2"], ["y"]) == "mm2_199679383839106450"


def _model(rng) -> onnx.ModelProto:
    """Unnamed nodes, a weight shared by two MatMuls, and an If whose branch reads an outer weight."""
    W = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "W")
    Wo = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "W_outer")
    Wt = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "Wt")
    then_g = helper.make_graph([helper.make_node("MatMul", ["h2", "Wt"], ["t0"], name="then_mm"),
                                helper.make_node("MatMul", ["t0", "W_outer"], ["t1"], name="then_outer")],
                               "then", [], [helper.make_tensor_value_info("t1", F, [4, 32])], [Wt])
    else_g = helper.make_graph([helper.make_node("Identity", ["h2"], ["e0"], name="else_id")],
                               "else", [], [helper.make_tensor_value_info("e0", F, [4, 32])])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Relu", ["h"], ["h1"]),
             helper.make_node("MatMul", ["h1", "W"], ["h2"]),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4, 32]),
                                       helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F, [4, 32])], [W, Wo])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def test_stats_rows_names_and_initializers(tmp_path, rng):
    import onnxruntime as ort

    path = tmp_path / "m.onnx"
    onnx.save_model(_model(rng), path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feeds = {"x": np.ones((4, 32), np.float32), "c": np.array(True)}
    res = stats(path, feeds, runs=2, out_csv=tmp_path / "s.csv", out_json=tmp_path / "s.json", session_options=so)
    assert res.node_stats_source == "ort"
    root = og.build(_model(rng).graph)
    expected = {n.unique_name for g in og.walk(root) for n in g.nodes if n.label != "else_id"}
    rows = {r.name: r for r in read_csv(tmp_path / "s.csv")}
    assert set(rows) == expected  # executed nodes only: the else branch never ran
    by_label = {n.label: n for g in og.walk(root) for n in g.nodes}
    init = {label: rows[by_label[label].unique_name].initializers_sizes
            for label in ("MatMul_0", "Relu_1", "MatMul_2", "branch", "then_mm", "then_outer")}
    # W (4096 B) charged once, to its first consumer; W_outer to the If that reads it from outside
    assert init == {"MatMul_0": 4096, "Relu_1": 0, "MatMul_2": 0, "branch": 4096, "then_mm": 4096, "then_outer": 0}
    assert rows[by_label["MatMul_0"].unique_name].input_sizes == 4 * 32 * 4
    # the per-node arena figures come from ORT's profiler, which reports them from 1.31 on (not on 1.25)
    reported = any(n.mem_bytes_in_use is not None for n in res.nodes)
    assert res.liveness_peak_bytes > 0 and (res.activation_peak_bytes is not None) == reported
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["runs"] == 2 and {n["name"] for n in data["nodes"]} >= {"MatMul_0", "then_mm", "branch"}


def test_stats_cli_generates_missing_inputs(tmp_path, rng, capsys):
    path = tmp_path / "m.onnx"
    onnx.save_model(_model(rng), path)
    np.save(tmp_path / "x.npy", np.ones((4, 32), np.float32))
    p = argparse.ArgumentParser()
    add_stats_arguments(p)
    out = tmp_path / "out.csv"
    assert main_stats(p.parse_args([str(path), "--input", f"x={tmp_path / 'x.npy'}", "--out", str(out)])) == 0
    assert out.read_text().startswith(CSV_HEADER) and len(read_csv(out)) >= 4
    assert "nodes" in capsys.readouterr().out
