"""Grouping ONNX nodes into modules by name scope, and what each module's bytes mean."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from ortmem.errors import PlanError
from ortmem.plan.partition.device_map import infer_device_map
from ortmem.ort.graph_index import topological_order as execution_order
from ortmem.plan.partition.graph_modules import NodeCost, group_modules, scope_of
from tests.support.builders import make_model
from tests.support.reference import run_plain

mk = helper.make_node
F = TensorProto.FLOAT


def _vi(name: str, shape=(1, 4)):
    return helper.make_tensor_value_info(name, F, list(shape))


def tiny_decoder() -> onnx.ModelProto:
    """embed -> attention (q, k projections, an Add) -> residual Add -> lm_head tied to the embedding."""
    rng = np.random.default_rng(0)
    w = lambda name, shape: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)  # noqa: E731
    nodes = [
        mk("MatMul", ["x", "emb"], ["h0"], name="/model/embed_tokens/MatMul"),
        mk("MatMul", ["h0", "Wq"], ["q"], name="/model/layers.0/attn/q_proj/MatMul"),
        mk("MatMul", ["h0", "Wk"], ["k"], name="/model/layers.0/attn/k_proj/MatMul"),
        mk("Add", ["q", "k"], ["a"], name="/model/layers.0/attn/Add"),
        mk("Add", ["a", "h0"], ["h1"], name="/model/layers.0/Add"),
        mk("MatMul", ["h1", "emb_t"], ["y"], name="/lm_head/MatMul"),
    ]
    inits = [w("emb", (4, 4)), w("Wq", (4, 4)), w("Wk", (4, 4)), w("emb_t", (4, 4))]
    return make_model(helper.make_graph(nodes, "tiny", [_vi("x")], [_vi("y")], inits))


# hand-made costs: the lm_head reads the embedding table (a tied weight, named "emb" by both)
COSTS = [
    NodeCost("/model/embed_tokens/MatMul", {"emb": 1000}, 10),
    NodeCost("/model/layers.0/attn/q_proj/MatMul", {"Wq": 100}, 10),
    NodeCost("/model/layers.0/attn/k_proj/MatMul", {"Wk": 100}, 10, workspace_bytes=5),
    NodeCost("/model/layers.0/attn/Add", {}, 10),
    NodeCost("/model/layers.0/Add", {}, 10),
    NodeCost("/lm_head/MatMul", {"emb": 1000}, 10),
]


def test_hand_built_model_is_valid_for_ort():
    model = tiny_decoder()
    onnx.checker.check_model(model)
    assert run_plain(model.SerializeToString(), {"x": np.ones((1, 4), np.float32)})[0].shape == (1, 4)


@pytest.mark.parametrize("name,expected", [
    ("/model/layers.3/self_attn/q_proj/MatMul", (("model", "layers", "3", "self_attn", "q_proj"), "MatMul")),
    ("/model/layers.3/self_attn/Reshape_1", (("model", "layers", "3", "self_attn"), "Reshape_1")),
    ("MatMul_12", ((), "MatMul_12")),
    ("/lm_head/MatMul", (("lm_head",), "MatMul")),
    ("model//norm/Mul", (("model", "norm"), "Mul")),
])
def test_scope_of(name, expected):
    assert scope_of(name) == expected


def test_modules_sizes_and_order():
    tree = group_modules(tiny_decoder(), COSTS)
    assert list(tree.sizes) == [
        "", "model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.0.attn",
        "model.layers.0.attn.q_proj", "model.layers.0.attn.k_proj", "model.layers.0.attn.Add",
        "model.layers.0.Add", "lm_head",
    ]
    # weights: the tied table counts once in the whole model, and once in each module using it
    assert tree.weight_bytes[""] == 1200
    assert tree.weight_bytes["model.embed_tokens"] == 1000 and tree.weight_bytes["lm_head"] == 1000
    assert tree.shared_weights == {"emb": ("model.embed_tokens", "lm_head")}
    # activations (hand-walked): whole graph peaks at the attention Add with h0, q, k and a live
    assert tree.activation_bytes[""] == 40
    # attention alone: h0 comes in (10) and lives until k_proj; at k_proj h0+q+k+workspace = 35
    assert tree.activation_bytes["model.layers.0.attn"] == 35
    assert tree.activation_bytes["model.embed_tokens"] == 10
    assert tree.activation_bytes["lm_head"] == 20  # h1 in, y out
    assert tree.sizes[""] == 1240
    assert tree.nodes["model.layers.0.attn.Add"] == ("/model/layers.0/attn/Add",)
    assert tree.module_of["/lm_head/MatMul"] == "lm_head"
    assert tree.order[0] == "/model/embed_tokens/MatMul"


def test_children_never_undercount_their_parent():
    tree = group_modules(tiny_decoder(), COSTS)
    for name, size in tree.sizes.items():
        kids = [k for k in tree.sizes if k != name and k.rpartition(".")[0] == name]
        if kids:
            assert sum(tree.sizes[k] for k in kids) >= size


def test_planner_on_grouped_model():
    tree = group_modules(tiny_decoder(), COSTS)
    assert infer_device_map(tree.sizes, {"0": 1300, "cpu": 10_000}) == {"": "0"}
    # a budget below the whole model: the tied embedding is charged to each half that needs it
    got = infer_device_map(tree.sizes, {"0": 1100, "cpu": 10_000})
    on_gpu = sum(tree.sizes[m] for m, d in got.items() if d == "0")
    assert on_gpu <= 1100
    assert got == {"model": "cpu", "lm_head": "0"}  # 1,240 off the GPU beats 1,260 (embed on it)


def test_one_by_one():
    tree = group_modules(tiny_decoder(), COSTS, by="node")
    assert list(tree.sizes)[1:] == [
        "model_embed_tokens_MatMul", "model_layers_0_attn_q_proj_MatMul", "model_layers_0_attn_k_proj_MatMul",
        "model_layers_0_attn_Add", "model_layers_0_Add", "lm_head_MatMul",
    ]
    assert tree.sizes["model_layers_0_attn_k_proj_MatMul"] == 100 + 10 + 10 + 5  # h0 in, k out, workspace
    with pytest.raises(PlanError, match="by must be"):
        group_modules(tiny_decoder(), COSTS, by="layer")


def test_nodes_beside_subscopes_become_their_own_modules_and_names_stay_unique():
    nodes = [
        mk("Relu", ["x"], ["a"], name="/blk/b"),            # op named like the sub-scope below
        mk("Relu", ["a"], ["b"], name="/blk/b/Relu"),
        mk("Relu", ["b"], ["c"], name="/blk/b/Relu.1"),     # dots in an op name are not scopes
        mk("Relu", ["c"], ["d"], name="top"),
        mk("Relu", ["d"], ["y"], name=""),                  # unnamed
    ]
    model = make_model(helper.make_graph(nodes, "g", [_vi("x")], [_vi("y")]))
    tree = group_modules(model, [])
    assert list(tree.sizes) == ["", "blk", "blk.b_1", "blk.b", "top", "Relu#4"]
    assert tree.nodes["blk.b"] == ("/blk/b/Relu", "/blk/b/Relu.1")
    assert set(tree.sizes.values()) == {0}


def test_unsorted_graph_gets_a_topological_order():
    nodes = [
        mk("Relu", ["b"], ["y"], name="/m/last"),
        mk("Relu", ["x"], ["a"], name="/m/first"),
        mk("Relu", ["a"], ["b"], name="/m/second"),
    ]
    model = make_model(helper.make_graph(nodes, "g", [_vi("x")], [_vi("y")]))
    assert execution_order(model) == [1, 2, 0]
    tree = group_modules(model, [NodeCost("/m/first", {}, 4), NodeCost("/m/second", {}, 4), NodeCost("/m/last", {}, 4)])
    assert tree.order == ("/m/first", "/m/second", "/m/last")
    assert tree.activation_bytes[""] == 8


def test_cycle_is_an_error():
    nodes = [mk("Relu", ["b"], ["a"], name="p"), mk("Relu", ["a"], ["b"], name="q")]
    g = helper.make_graph(nodes, "g", [_vi("x")], [_vi("b")])
    with pytest.raises(PlanError, match="cycle"):
        execution_order(g)


def test_subgraph_reads_keep_a_tensor_alive():
    """A tensor read only inside an If branch is still an input of the If node."""
    then = helper.make_graph([mk("Identity", ["big"], ["t"])], "then", [], [_vi("t")])
    other = helper.make_graph([mk("Identity", ["x"], ["e"])], "else", [], [_vi("e")])
    nodes = [
        mk("Relu", ["x"], ["big"], name="/a/make_big"),
        mk("Relu", ["x"], ["small"], name="/a/small"),
        mk("Greater", ["x", "x"], ["cond_full"], name="/b/cmp"),
        mk("ReduceMax", ["cond_full"], ["cond"], name="/b/reduce", keepdims=0),
        mk("If", ["cond"], ["y"], name="/b/if", then_branch=then, else_branch=other),
    ]
    g = helper.make_graph(nodes, "g", [_vi("x")], [_vi("y")])
    costs = [NodeCost("/a/make_big", {}, 100), NodeCost("/a/small", {}, 1), NodeCost("/b/if", {}, 1)]
    tree = group_modules(g, costs)
    # in module "a", big is needed by a later module (the If), so it stays to the end of "a"
    assert tree.activation_bytes["a"] == 101
    # in module "b", big comes in and lives until the If that reads it
    assert tree.activation_bytes["b"] == 101


def test_bad_costs():
    with pytest.raises(PlanError, match="does not have"):
        group_modules(tiny_decoder(), [NodeCost("/nope", {}, 1)])
    with pytest.raises(PlanError, match="two costs"):
        group_modules(tiny_decoder(), [COSTS[0], COSTS[0]])
    with pytest.raises(PlanError, match="non-negative"):
        group_modules(tiny_decoder(), [NodeCost("/lm_head/MatMul", {"emb": -1}, 1)])
    dup = [mk("Relu", ["x"], ["a"], name="n"), mk("Relu", ["a"], ["y"], name="n")]
    with pytest.raises(PlanError, match="two nodes"):
        group_modules(helper.make_graph(dup, "g", [_vi("x")], [_vi("y")]), [])


# --------------------------------------------------------------------------------------------------
# Property: random graphs, random scopes


SCOPES = ["/m/l0/attn", "/m/l0/mlp", "/m/l0", "/m/l1/attn", "/m/l1", "/m", "/head", ""]


@st.composite
def random_graphs(draw):
    n = draw(st.integers(min_value=1, max_value=12))
    nodes, costs = [], []
    for i in range(n):
        k = draw(st.integers(min_value=0, max_value=min(i, 3)))
        ins = draw(st.lists(st.integers(min_value=0, max_value=i - 1), min_size=k, max_size=k, unique=True)) if i else []
        inputs = [f"v{j}" for j in ins] or ["x"]
        scope = draw(st.sampled_from(SCOPES))
        name = f"{scope}/op{i}"
        nodes.append(mk("Sum", inputs, [f"v{i}"], name=name))
        weights = {f"w{w}": 10 * (w + 1) for w in draw(st.lists(st.integers(0, 4), max_size=2, unique=True))}
        costs.append(NodeCost(name, weights, draw(st.integers(0, 50)), draw(st.integers(0, 20))))
    used = {x for node in nodes for x in node.input}
    outputs = [f"v{i}" for i in range(n) if f"v{i}" not in used]
    g = helper.make_graph(nodes, "rand", [_vi("x")], [_vi(o) for o in outputs])
    return g, costs


def _whole_graph_peak(g, costs) -> int:
    """Brute-force liveness over the whole graph, tensor by tensor."""
    act = {c.name: c.activation_bytes for c in costs}
    ws = {c.name: c.workspace_bytes for c in costs}
    outs = {o.name for o in g.output}
    last = {}
    for i, node in enumerate(g.node):
        for x in node.input:
            last[x] = i
    peak, live = 0, {}
    for i, node in enumerate(g.node):
        v = node.output[0]
        peak = max(peak, sum(live.values()) + act[node.name] + ws[node.name])
        live[v] = act[node.name]
        for x in list(live):
            if x not in outs and last.get(x, -1) <= i:
                del live[x]
    return peak


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_graphs(graph_costs):
    g, costs = graph_costs
    tree = group_modules(g, costs)
    names = list(tree.sizes)
    assert names[0] == ""
    for name in names:  # every prefix present, and before its descendants
        if name:
            parent = name.rpartition(".")[0]
            assert parent in tree.sizes and names.index(parent) < names.index(name)
    for name, size in tree.sizes.items():
        kids = [k for k in names if k and k.rpartition(".")[0] == name and k != name]
        if kids:
            assert sum(tree.sizes[k] for k in kids) >= size
        assert size == tree.weight_bytes[name] + tree.activation_bytes[name]
    all_weights = {w: b for c in costs for w, b in c.weight_bytes.items()}
    assert tree.weight_bytes[""] == sum(all_weights.values())
    assert tree.activation_bytes[""] == _whole_graph_peak(g, costs)
    assert sorted(tree.module_of) == sorted(c.name for c in costs)
    # and the planner takes it as it is
    infer_device_map(tree.sizes, {"0": tree.sizes[""] // 2, "cpu": 10 * tree.sizes[""] + 1})
