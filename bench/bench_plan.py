"""Planning time on a 10,000-node graph (the target: under a second).

Run with ``pytest bench/bench_plan.py --benchmark-only``. The graph is a synthetic Llama-shaped ONNX
graph named the way exporters name nodes (``/model/layers.3/self_attn/q_proj/MatMul``), about
10,000 nodes; grouped by name scopes it gives about 10,000 modules, so the heuristic path of
:func:`ortmem.plan.partition.device_map.infer_device_map` is what is timed (the exact search stops at
``EXACT_MAX_MODULES``).
"""
from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from ortmem.plan.partition.device_map import infer_device_map, plan_placement
from ortmem.plan.partition.graph_modules import NodeCost, group_modules

HIDDEN, INTER, KV, VOCAB, LAYERS = 4096, 11008, 1024, 32000, 32
SHAPE_OPS = ("Shape", "Gather", "Unsqueeze", "Concat", "Reshape", "Transpose", "Cast", "Slice")
LIMIT_S = 1.0


def llama_like_graph(layers: int = LAYERS, shape_ops_per_layer: int = 296):
    """A chain of named nodes shaped like an exported decoder, with per-node costs (fp16)."""
    nodes, costs = [], []
    cur = "input_ids"
    act = HIDDEN * 2 * 128  # one 128-token sequence of fp16 activations

    def add(op: str, name: str, weights: dict[str, int] | None = None, act_bytes: int = act, ws: int = 0):
        nonlocal cur
        out = f"{name}_out"
        ins = [cur, *(weights or {})]
        nodes.append(helper.make_node(op, ins, [out], name=name))
        costs.append(NodeCost(name, dict(weights or {}), act_bytes, ws))
        cur = out

    add("Gather", "/model/embed_tokens/Gather", {"embed": VOCAB * HIDDEN * 2})
    for i in range(layers):
        p = f"/model/layers.{i}"
        add("SimplifiedLayerNormalization", f"{p}/input_layernorm/LayerNorm", {f"ln1.{i}": HIDDEN * 2})
        for proj, n in (("q_proj", HIDDEN), ("k_proj", KV), ("v_proj", KV)):
            add("MatMul", f"{p}/self_attn/{proj}/MatMul", {f"{proj}.{i}": HIDDEN * n * 2})
        for j in range(shape_ops_per_layer):
            add(SHAPE_OPS[j % len(SHAPE_OPS)], f"{p}/self_attn/{SHAPE_OPS[j % len(SHAPE_OPS)]}_{j}", act_bytes=64)
        add("RotaryEmbedding", f"{p}/self_attn/rotary_emb/RotaryEmbedding", {"cos_cache": 1 << 20, "sin_cache": 1 << 20})
        add("MatMul", f"{p}/self_attn/MatMul", act_bytes=32 * 128 * 128 * 2, ws=1 << 16)
        add("Softmax", f"{p}/self_attn/Softmax", act_bytes=32 * 128 * 128 * 2)
        add("MatMul", f"{p}/self_attn/MatMul_1")
        add("MatMul", f"{p}/self_attn/o_proj/MatMul", {f"o_proj.{i}": HIDDEN * HIDDEN * 2})
        add("Add", f"{p}/Add")
        add("SimplifiedLayerNormalization", f"{p}/post_attention_layernorm/LayerNorm", {f"ln2.{i}": HIDDEN * 2})
        add("MatMul", f"{p}/mlp/gate_proj/MatMul", {f"gate.{i}": HIDDEN * INTER * 2}, act_bytes=INTER * 2 * 128)
        add("Sigmoid", f"{p}/mlp/act_fn/Sigmoid", act_bytes=INTER * 2 * 128)
        add("Mul", f"{p}/mlp/act_fn/Mul", act_bytes=INTER * 2 * 128)
        add("MatMul", f"{p}/mlp/up_proj/MatMul", {f"up.{i}": HIDDEN * INTER * 2}, act_bytes=INTER * 2 * 128)
        add("Mul", f"{p}/mlp/Mul", act_bytes=INTER * 2 * 128)
        add("MatMul", f"{p}/mlp/down_proj/MatMul", {f"down.{i}": HIDDEN * INTER * 2})
        add("Add", f"{p}/Add_1")
    add("SimplifiedLayerNormalization", "/model/norm/LayerNorm", {"norm": HIDDEN * 2})
    add("MatMul", "/lm_head/MatMul", {"lm_head": VOCAB * HIDDEN * 2}, act_bytes=VOCAB * 2 * 128)
    graph = helper.make_graph(
        nodes, "llama_like",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT16, ["batch", "seq", VOCAB])],
    )
    return graph, costs


@pytest.fixture(scope="module")
def graph_and_costs():
    graph, costs = llama_like_graph()
    assert len(graph.node) >= 10_000
    return graph, costs


@pytest.fixture(scope="module")
def module_sizes(graph_and_costs):
    tree = group_modules(*graph_and_costs)
    assert len(tree.sizes) >= 10_000
    return tree.sizes


def _budgets(total: int) -> dict[str, int]:
    return {"cuda:0": int(0.45 * total), "cuda:1": int(0.3 * total), "cpu": total}


def _check(benchmark) -> None:
    median = benchmark.stats.stats.median
    print(f"\nmedian {median * 1000:.0f} ms")
    assert median < LIMIT_S, f"planning took {median:.2f} s (limit {LIMIT_S} s)"


def test_plan_10k_modules(benchmark, module_sizes):
    """The planner alone, default semantics, three devices."""
    total = module_sizes[""]
    result = benchmark.pedantic(infer_device_map, args=(module_sizes, _budgets(total)), rounds=5, iterations=1)
    assert result
    placement = plan_placement(module_sizes, _budgets(total))
    print(f"\n{len(module_sizes)} modules, {total / 2**30:.2f} GiB: bytes per device {placement.loads} of "
          f"{list(_budgets(total).values())}, {placement.switches} device changes, {len(result)} map entries")
    _check(benchmark)


def test_plan_10k_modules_two_switches(benchmark, module_sizes):
    result = benchmark.pedantic(infer_device_map, args=(module_sizes, _budgets(module_sizes[""])),
                                kwargs={"max_switches": 2}, rounds=5, iterations=1)
    assert result
    _check(benchmark)


def test_plan_10k_modules_offload(benchmark, module_sizes):
    """accelerate's semantics: cpu modules run on cuda:0, which keeps room for the largest."""
    total = module_sizes[""]
    budgets = {"cuda:0": int(0.45 * total), "cpu": total}
    result = benchmark.pedantic(infer_device_map, args=(module_sizes, budgets), kwargs={"reserve": "offload"},
                                rounds=5, iterations=1)
    assert result
    _check(benchmark)


def test_group_and_plan_10k_nodes(benchmark, graph_and_costs):
    """Grouping a 10,000-node graph by name scopes, sizing every module, and planning."""
    graph, costs = graph_and_costs

    def run():
        tree = group_modules(graph, costs)
        return infer_device_map(tree.sizes, _budgets(tree.sizes[""]))

    assert benchmark.pedantic(run, rounds=3, iterations=1)
    median = benchmark.stats.stats.median
    print(f"\ngroup + plan median {median * 1000:.0f} ms")
