"""dq_matmul_match / dq_gather_match against ONNX Runtime itself.

Ground truth is ORT 1.31.1, not our reading of its source: every model is optimized by a real session
(``optimized_model_filepath``) and the MatMulNBits nodes ORT produced are compared node by node with the
matcher's candidates (names, K, N, bits, block_size, accuracy_level, zero-point and bias wiring). Where the
matcher claims ORT gets a case wrong, the test measures it. For DQ+Gather (no ORT fusion exists) each
candidate is built as a GatherBlockQuantized node and must reproduce ORT's own DQ+Gather output.
"""
from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as H
from onnx import numpy_helper as nh

import ortmem
from ortmem.passes.rules.dq_gather_match import dq_gather_match
from ortmem.passes.rules.dq_matmul_checks import effective_block_size
from ortmem.passes.rules.dq_matmul_match import dq_matmul_match
from tests.support.dq_graphs import (
    D,
    GATHERS,
    INT2,
    K,
    MS,
    N,
    RANGES,
    UINT2,
    V,
    dq_gather,
    dq_mm,
    dqn,
    mm,
    model,
    rng_for,
    st,
    vi,
    wt,
)
from tests.support.reference import run_plain

EXT = int(ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)  # 2
BASIC = int(ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)  # 1
ALL = 99

ort.set_default_logger_severity(3)


# ------------------------------------------------------------------------------------------------
# asking ORT
# ------------------------------------------------------------------------------------------------

def ort_optimize(m: onnx.ModelProto, tmp_path: Path, level=EXT, config=None, disabled=()) -> onnx.ModelProto:
    d = tmp_path / f"ort{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    src, dst = d / "m.onnx", d / "opt.onnx"
    onnx.save(m, src)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel(level) if level != ALL else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(dst)
    for k_, v_ in (config or {}).items():
        so.add_session_config_entry(k_, v_)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled))
    return onnx.load(dst)


def graphs(g: onnx.GraphProto, path=""):
    yield path, g
    for i, n in enumerate(g.node):
        label = n.name or f"{n.op_type}#{i}"
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from graphs(a.g, f"{path}/{label}/{a.name}" if path else f"{label}/{a.name}")


def nbits_nodes(opt: onnx.ModelProto) -> dict[tuple[str, str], onnx.NodeProto]:
    return {(p, n.name): n for p, g in graphs(opt.graph) for n in g.node if n.op_type == "MatMulNBits"}


def attrs_of(n: onnx.NodeProto) -> dict:
    return {a.name: H.get_attribute_value(a) for a in n.attribute}


def check(m: onnx.ModelProto, tmp_path: Path, *, level=EXT, config=None, disabled=(), fp16=False):
    """Run matcher and ORT; assert they agree node by node; return (candidates, rejected)."""
    cands, rej = dq_matmul_match(m, graph_optimization_level=level, session_config=config or {},
                                 disabled_optimizers=disabled)
    opt = ort_optimize(m, tmp_path, level, config, disabled)
    got = nbits_nodes(opt)
    want = {(c.graph_path, c.ort_node_name): c for c in cands if c.ort_outcome in ("converted", "converted_wrong", "fused_by_ort")}
    assert set(got) == set(want), f"ORT fused {sorted(got)}, matcher predicted {sorted(want)}; rejected={rej}"
    opt_graphs = dict(graphs(opt.graph))
    for key, c in want.items():
        node = got[key]
        a = attrs_of(node)
        assert (a["K"], a["N"], a["bits"], a["block_size"], a["accuracy_level"]) == \
               (c.K, c.N, c.bits, c.block_size, c.accuracy_level), (c, a)
        ins = list(node.input) + [""] * (6 - len(node.input))
        assert ins[1] and ins[2]
        zp_dropped = any("zero point" in n and "outer-scope" in n for n in c.notes)
        assert bool(ins[3]) == ((c.has_zp and not zp_dropped) or not c.signed), (c, list(node.input))
        assert ins[5] == (c.bias or ""), (c, list(node.input))
        if not fp16 and "MatMulAddFusion" not in c.fusion:
            assert ins[0] == c.input_a
        g = opt_graphs[c.graph_path]
        if c.fold_add:  # the Add is gone and its output now comes from MatMulNBits (or MatMulAddFusion's Reshape)
            assert c.fold_add not in {n.name for n in g.node}
            assert c.output in {o for n in g.node for o in n.output}
    for r in rej:
        if r.ort_outcome == "kept" and r.code != "qdq_disabled":
            assert r.node in {n.name for n in opt_graphs[r.graph_path].node}, r
    return cands, rej


def assert_shared(cands, rej, code: str) -> None:
    """With the shared-initializer guard (PR #28326, ORT 1.31 on) the pair is rejected with ``code``;
    without it (1.25) ORT fuses it, the matcher says so, and ortmem leaves it to ORT (``fused_by_ort``)."""
    from ortmem.ort.release import capabilities

    if capabilities().shared_initializer_guard:
        assert not cands and {r.code for r in rej} == {code}
    else:
        assert cands and all(c.ort_outcome == "fused_by_ort" for c in cands)
        assert code not in {r.code for r in rej}


def converted(cands) -> set[str]:
    return {c.node for c in cands if c.ort_outcome == "converted"}


def codes(rej) -> dict[str, str]:
    return {f"{r.node}->{r.consumer}": r.code for r in rej}


# ------------------------------------------------------------------------------------------------
# accepted variants
# ------------------------------------------------------------------------------------------------

ACCEPTED = {
    "int4_blockwise": dict(),
    "int4_zp": dict(zp=True),
    "uint4_no_zp": dict(wtype=T.UINT4),
    "uint4_zp": dict(wtype=T.UINT4, zp=True),
    "int8": dict(wtype=T.INT8),
    "uint8_zp": dict(wtype=T.UINT8, zp=True),
    "uint8_no_zp": dict(wtype=T.UINT8),
    "int2_opset25": dict(wtype=INT2, opset=25),
    "uint2_zp_opset25": dict(wtype=UINT2, zp=True, opset=25),
    "block16": dict(block=16),
    "block256": dict(block=256, k=512),
    "k_not_multiple": dict(k=80),
    "block_gt_k": dict(k=16, block=32),
    "per_tensor": dict(scale_shape=[], attrs={}),
    "per_tensor_zp": dict(scale_shape=[], zp=True, attrs={}),
    "per_tensor_uint4_no_zp": dict(wtype=T.UINT4, scale_shape=[], attrs={}),
    "per_channel_axis_absent": dict(scale_shape=[N], attrs={}),
    "per_channel_axis1_zp": dict(scale_shape=[N], zp=True, attrs=dict(axis=1)),
    "per_channel_block0": dict(scale_shape=[N], attrs=dict(block_size=0)),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_variants(name, tmp_path):
    m = dq_mm(tag=name, **ACCEPTED[name])
    cands, rej = check(m, tmp_path)
    assert converted(cands) == {"mm"} and not rej
    kw = ACCEPTED[name]
    want = "blockwise" if "attrs" not in kw else ("per-tensor" if kw.get("scale_shape") == [] else "per-channel")
    assert cands[0].kind == want


def test_fp16_scales(tmp_path):
    cands, rej = check(dq_mm(stype=T.FLOAT16, tag="fp16"), tmp_path, fp16=True)
    assert converted(cands) == {"mm"} and cands[0].scale_dtype == T.FLOAT16


def test_ms_domain_dq_and_constant_node_weight(tmp_path):
    rng = rng_for("ms")
    w = wt("W", [K, N], T.INT8, rng)
    m = model([H.make_node("Constant", [], ["W"], value=w, name="cw"),
               H.make_node("DequantizeLinear", ["W", "S"], ["Wd"], name="dq", domain="com.microsoft"), mm()],
              [vi("A", [2, K])], [vi("Y", [2, N])], [st("S", [], rng=rng)],
              extra_opsets=[H.make_opsetid("com.microsoft", 1)])
    cands, _ = check(m, tmp_path)
    assert converted(cands) == {"mm"} and cands[0].kind == "per-tensor"


@pytest.mark.parametrize("cfg,k,want", [({"session.qdq_matmulnbits_block_size": "64"}, 64, 64),
                                        ({"session.qdq_matmulnbits_block_size": "-1"}, 80, 16),
                                        ({"session.qdq_matmulnbits_block_size": "-1"}, 96, 32),
                                        ({"session.qdq_matmulnbits_block_size": "-2"}, 64, 32),
                                        ({"session.qdq_matmulnbits_accuracy_level": "0"}, 64, 32)])
def test_session_options(cfg, k, want, tmp_path):
    m = dq_mm(k=k, scale_shape=[], attrs={}, tag=f"opt{k}")
    cands, _ = check(m, tmp_path, config=cfg)
    assert cands[0].block_size == want == effective_block_size(int(cfg.get("session.qdq_matmulnbits_block_size", "0")), k)


def test_explicit_block_size_only_checked_for_expanded_dqs(tmp_path):
    bad = {"session.qdq_matmulnbits_block_size": "48"}
    cands, rej = check(dq_mm(tag="bw48"), tmp_path, config=bad)  # blockwise: option unused
    assert converted(cands) == {"mm"}
    m = dq_mm(scale_shape=[], attrs={}, tag="pt48")
    cands, rej = dq_matmul_match(m, graph_optimization_level=EXT, session_config=bad)
    assert [(r.code, r.ort_outcome) for r in rej] == [("session_block_size", "session_error")]
    with pytest.raises(Exception, match="power-of-(two|2)"):
        ort_optimize(m, tmp_path, config=bad)


def test_invalid_accuracy_level_fails_like_ort(tmp_path):
    with pytest.raises(ValueError):
        dq_matmul_match(dq_mm(), session_config={"session.qdq_matmulnbits_accuracy_level": "5"})
    with pytest.raises(Exception, match="accuracy level must be between 0 and 4"):
        ort_optimize(dq_mm(), tmp_path, config={"session.qdq_matmulnbits_accuracy_level": "5"})


# ------------------------------------------------------------------------------------------------
# rejected variants: one defect each
# ------------------------------------------------------------------------------------------------

REJECTED = {
    "block8": (dict(block=8), "block_size"),
    "block48": (dict(block=48, k=96), "block_size"),
    "axis1_blockwise": (dict(attrs=dict(axis=1, block_size=16), scale_shape=[K, 1]), "axis"),
    "axis_minus2": (dict(attrs=dict(axis=-2, block_size=32)), "axis"),
    "per_channel_axis_minus1": (dict(scale_shape=[N], attrs=dict(axis=-1)), "axis"),
    "per_channel_over_k": (dict(scale_shape=[K], attrs=dict(axis=0)), "granularity"),
    "scale_shape_1": (dict(scale_shape=[1], attrs={}), "granularity"),
    "int16": (dict(wtype=T.INT16), "weight_dtype"),
    "uint16": (dict(wtype=T.UINT16), "weight_dtype"),
}


@pytest.mark.parametrize("block", [256, 512, 1024])
def test_block_size_bound_follows_the_installed_release(block, tmp_path):
    """1.31 stops the rule at 256; 1.25 and 1.32 fuse larger blocks; 1.28 fuses them into a kernel that
    refuses them. The matcher's bound is the probe's (ortmem.ort.release) and must agree with this
    ORT, node by node (check()), or, where ORT fails on its own model, leave it to fail the same way."""
    from ortmem.ort.release import capabilities

    m = dq_mm(tag=f"block{block}", block=block, k=2 * block)
    try:
        ort_optimize(m, tmp_path)
    except Exception as exc:  # noqa: BLE001 - 1.28 fuses a 512 block into a kernel that refuses it
        # ORT fails on its own model: ortmem converts nothing and the session fails the same way
        assert not converted(dq_matmul_match(m, graph_optimization_level=EXT)[0])
        path = tmp_path / "refused.onnx"
        onnx.save(m, path)
        with pytest.raises(type(exc)):
            ortmem.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return
    cands, rej = check(m, tmp_path)
    fused = block <= capabilities().fusion_block_max
    assert bool(cands) == fused
    if not fused:
        assert codes(rej) == {"dq->mm": "block_size"}


@pytest.mark.parametrize("name", list(REJECTED))
def test_rejected_variants(name, tmp_path):
    kw, code = REJECTED[name]
    cands, rej = check(dq_mm(tag=name, **kw), tmp_path)
    assert not cands and codes(rej) == {"dq->mm": code}


def _gemm_model(tag, *, attrs=None, bias=None, bias_input=None, weight_shape=(K, N), dq_attrs=None, a_shape=(2, K)):
    rng = rng_for(tag)
    inits = [wt("W", list(weight_shape), T.INT4, rng), st("S", [2, weight_shape[1]] if not dq_attrs else [weight_shape[0], 2], rng=rng)]
    ins, inputs = ["A", "Wd"], [vi("A", list(a_shape))]
    if bias is not None:
        inits.append(st("C", bias, rng=rng))
        ins.append("C")
    if bias_input is not None:
        inputs.append(vi("C", bias_input))
        ins.append("C")
    nodes = [dqn(**(dq_attrs or dict(axis=0, block_size=32))), H.make_node("Gemm", ins, ["Y"], name="gemm", **(attrs or {}))]
    return model(nodes, inputs, [vi("Y", [a_shape[1 if (attrs or {}).get("transA") else 0], N])], inits)


GEMMS = {
    "plain": (dict(), "ok", None),
    "bias_const": (dict(bias=[N]), "ok", "C"),
    "bias_graph_input": (dict(bias_input=[N]), "ok", "C"),
    "beta_without_bias": (dict(attrs=dict(beta=0.5)), "ok", None),
    "explicit_defaults": (dict(attrs=dict(alpha=1.0, beta=1.0, transA=0, transB=0), bias=[N]), "ok", "C"),
    "alpha2": (dict(attrs=dict(alpha=2.0)), "gemm_alpha", None),
    "beta2_bias": (dict(attrs=dict(beta=2.0), bias=[N]), "gemm_beta", None),
    "transA": (dict(attrs=dict(transA=1), a_shape=(K, 2)), "gemm_transA", None),
    "transB": (dict(attrs=dict(transB=1), weight_shape=(N, K), dq_attrs=dict(axis=1, block_size=32)), "gemm_transB", None),
    "bias_1xN": (dict(bias=[1, N]), "gemm_bias_shape", None),
    "bias_MxN": (dict(bias=[2, N]), "gemm_bias_shape", None),
    "bias_scalar": (dict(bias=[]), "gemm_bias_shape", None),
    "bias_dynamic": (dict(bias_input=["n"]), "gemm_bias_shape", None),
}


@pytest.mark.parametrize("name", list(GEMMS))
def test_gemm(name, tmp_path):
    kw, code, bias = GEMMS[name]
    cands, rej = check(_gemm_model(name, **kw), tmp_path)
    if code == "ok":
        assert converted(cands) == {"gemm"} and cands[0].op == "Gemm" and cands[0].bias == bias and not rej
    else:
        assert not cands and codes(rej) == {"dq->gemm": code}


def test_gemm_bias_from_dq(tmp_path):
    rng = rng_for("gb")
    m = model([dqn(axis=0, block_size=32), H.make_node("DequantizeLinear", ["bq", "bs"], ["C"], name="dqb"),
               H.make_node("Gemm", ["A", "Wd", "C"], ["Y"], name="gemm")],
              [vi("A", [2, K])], [vi("Y", [2, N])],
              [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng), nh.from_array(np.arange(N, dtype=np.int32), "bq"),
               st("bs", [], value=0.1)])
    cands, rej = check(m, tmp_path)
    assert converted(cands) == {"gemm"} and cands[0].bias == "C"
    assert codes(rej) == {"dqb->gemm": "not_weight_input"}


# ------------------------------------------------------------------------------------------------
# structure: constancy, sharing, neighbours
# ------------------------------------------------------------------------------------------------

def _two(tag, *, w2="W2", s2="S2", same_scale_value=None, per_tensor=False):
    rng = rng_for(tag)
    sshape = [] if per_tensor else [2, N]
    attrs = {} if per_tensor else dict(axis=0, block_size=32)
    inits = [wt("W", [K, N], rng=rng), st("S", sshape, rng=rng, value=same_scale_value)]
    if w2 != "W":
        inits.append(wt(w2, [K, N], rng=rng))
    if s2 != "S":
        inits.append(st(s2, sshape, rng=rng, value=same_scale_value))
    return model([dqn(**attrs), dqn(w2, s2, out="Wd2", name="dq2", **attrs), mm(), mm(b="Wd2", y="Y2", name="mm2")],
                 [vi("A", [2, K])], [vi("Y", [2, N]), vi("Y2", [2, N])], inits)


def test_independent_pairs_both_convert(tmp_path):
    cands, rej = check(_two("ind"), tmp_path)
    assert converted(cands) == {"mm", "mm2"} and not rej


def test_weight_shared_by_two_dqs(tmp_path):
    cands, rej = check(_two("ws", w2="W"), tmp_path)
    assert_shared(cands, rej, "weight_shared")


def test_scale_shared_by_two_dqs(tmp_path):
    cands, rej = check(_two("ss", s2="S"), tmp_path)
    assert_shared(cands, rej, "scale_shared")


def test_zero_point_shared_is_fine(tmp_path):
    rng = rng_for("zs")
    m = model([dqn(z="Z", axis=0, block_size=32), dqn("W2", "S2", z="Z", out="Wd2", name="dq2", axis=0, block_size=32),
               mm(), mm(b="Wd2", y="Y2", name="mm2")], [vi("A", [2, K])], [vi("Y", [2, N]), vi("Y2", [2, N])],
              [wt("W", [K, N], rng=rng), wt("W2", [K, N], rng=rng), st("S", [2, N], rng=rng), st("S2", [2, N], rng=rng),
               wt("Z", [2, N], rng=rng)])
    cands, _ = check(m, tmp_path)
    assert converted(cands) == {"mm", "mm2"}


def test_constant_sharing_merges_equal_per_tensor_scales(tmp_path):
    cands, rej = check(_two("cs", per_tensor=True, same_scale_value=0.5), tmp_path)
    assert_shared(cands, rej, "scale_shared_by_constant_sharing")
    cands, rej = check(_two("cs2", per_tensor=True), tmp_path)  # different values: no sharing
    assert converted(cands) == {"mm", "mm2"}


def test_constant_sharing_with_an_unrelated_constant(tmp_path):
    rng = rng_for("cu")
    m = model([dqn(), mm(), H.make_node("Mul", ["A2", "c"], ["Y2"], name="mul")],
              [vi("A", [2, K]), vi("A2", [2, N])], [vi("Y", [2, N]), vi("Y2", [2, N])],
              [wt("W", [K, N], rng=rng), st("S", [], value=0.5), st("c", [], value=0.5)])
    cands, rej = check(m, tmp_path)
    assert_shared(cands, rej, "scale_shared_by_constant_sharing")


@pytest.mark.parametrize("where", ["second_matmul", "other_op", "graph_output", "subgraph"])
def test_dq_output_used_elsewhere(where, tmp_path):
    rng = rng_for(where)
    inits = [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)]
    nodes, outs, ins = [dqn(axis=0, block_size=32), mm()], [vi("Y", [2, N])], [vi("A", [2, K])]
    if where == "second_matmul":
        nodes.append(mm(y="Y2", name="mm2"))
        outs.append(vi("Y2", [2, N]))
    elif where == "other_op":
        nodes.append(H.make_node("Neg", ["Wd"], ["Y2"], name="neg"))
        outs.append(vi("Y2", [K, N]))
    elif where == "graph_output":
        outs.append(vi("Wd", [K, N]))
    else:
        then = H.make_graph([H.make_node("ReduceSum", ["Wd"], ["t"], name="t_sum", keepdims=0)], "then", [], [vi("t", [])])
        other = H.make_graph([H.make_node("Constant", [], ["e"], value=st("ev", [], value=0.0), name="e_c")], "else", [],
                             [vi("e", [])])
        nodes.append(H.make_node("If", ["c"], ["Y2"], then_branch=then, else_branch=other, name="if"))
        ins.append(vi("c", [], T.BOOL))
        outs.append(vi("Y2", []))
    cands, rej = check(model(nodes, ins, outs, inits), tmp_path)
    assert_shared(cands, rej, "dq_output_shared")


def test_weight_also_used_in_subgraph(tmp_path):
    rng = rng_for("wsub")
    then = H.make_graph([H.make_node("Gather", ["W", "i"], ["g"], name="t_g"),
                         H.make_node("Cast", ["g"], ["t"], to=T.FLOAT, name="t_c")], "then", [], [vi("t", [N])])
    other = H.make_graph([H.make_node("Constant", [], ["e"], value=st("ev", [N], value=0.0), name="e_c")], "else", [],
                         [vi("e", [N])])
    m = model([dqn(axis=0, block_size=32), mm(), H.make_node("If", ["c"], ["Y2"], then_branch=then, else_branch=other, name="if")],
              [vi("A", [2, K]), vi("c", [], T.BOOL), vi("i", [], T.INT64)], [vi("Y", [2, N]), vi("Y2", [N])],
              [wt("W", [K, N], T.INT8, rng), st("S", [2, N], rng=rng)])
    cands, rej = check(m, tmp_path)
    assert_shared(cands, rej, "weight_shared")


@pytest.mark.parametrize("what", ["weight_overridable", "weight_input", "scale_overridable", "weight_from_node"])
def test_non_constant_inputs(what, tmp_path):
    rng = rng_for(what)
    inits = [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)]
    ins, nodes = [vi("A", [2, K])], [dqn(axis=0, block_size=32), mm()]
    if what == "weight_overridable":
        ins.append(vi("W", [K, N], T.INT4))
    elif what == "weight_input":
        ins.append(vi("W", [K, N], T.INT4))
        inits = inits[1:]
    elif what == "scale_overridable":
        ins.append(vi("S", [2, N]))
    else:
        nodes.insert(0, H.make_node("Identity", ["W0"], ["W"], name="id"))
        ins.append(vi("W0", [K, N], T.INT4))
        inits = inits[1:]
    cands, rej = check(model(nodes, ins, [vi("Y", [2, N])], inits), tmp_path)
    want = "scale_not_constant" if what.startswith("scale") else "weight_not_constant"
    assert not cands and codes(rej) == {"dq->mm": want}


def test_empty_zero_point_name_counts_as_a_zero_point(tmp_path):
    rng = rng_for("ez")
    m = model([dqn(z="", axis=0, block_size=32), mm()], [vi("A", [2, K])], [vi("Y", [2, N])],
              [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)])
    cands, rej = check(m, tmp_path)
    assert codes(rej) == {"dq->mm": "zero_point_not_constant"}


def test_rank3_weight(tmp_path):
    rng = rng_for("r3")
    m = model([dqn(), mm()], [vi("A", [3, 2, K])], [vi("Y", [3, 2, N])], [wt("W", [3, K, N], rng=rng), st("S", [], value=0.5)])
    cands, rej = check(m, tmp_path)
    assert codes(rej) == {"dq->mm": "weight_rank"}


@pytest.mark.parametrize("what,code", [("activation_dq", "activation_dq"), ("q_after", "q_consumer"),
                                       ("relu_then_op", "relu_clip_consumer"), ("clip_then_op", "relu_clip_consumer"),
                                       ("dq_feeds_a", "not_weight_input")])
def test_neighbours_that_block(what, code, tmp_path):
    rng = rng_for(what)
    inits = [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)]
    ins, outs = [vi("A", [2, K])], [vi("Y", [2, N])]
    nodes = [dqn(axis=0, block_size=32)]
    if what == "activation_dq":
        nodes += [H.make_node("DequantizeLinear", ["Aq", "qs", "qz"], ["A"], name="dqa"), mm()]
        ins = [vi("Aq", [2, K], T.UINT8)]
        inits += [st("qs", [], value=0.1), nh.from_array(np.array(128, np.uint8), "qz")]
    elif what == "q_after":
        nodes += [mm(y="M"), H.make_node("QuantizeLinear", ["M", "qs", "qz"], ["Y"], name="q")]
        inits += [st("qs", [], value=0.1), nh.from_array(np.array(128, np.uint8), "qz")]
        outs = [vi("Y", [2, N], T.UINT8)]
    elif what in ("relu_then_op", "clip_then_op"):
        act = "Relu" if what == "relu_then_op" else "Clip"
        nodes += [mm(y="M"), H.make_node(act, ["M"], ["R"], name="act"), H.make_node("Sigmoid", ["R"], ["Y"], name="sig")]
    else:
        nodes += [mm(a="Wd", b="B")]
        ins = [vi("B", [N, 3])]
        outs = [vi("Y", [K, 3])]
    cands, rej = check(model(nodes, ins, outs, inits), tmp_path)
    assert not cands and codes(rej)[f"dq->{'mm'}"] == code


def test_relu_that_is_the_graph_output_does_not_block(tmp_path):
    rng = rng_for("relu_out")
    m = model([dqn(axis=0, block_size=32), mm(y="M"), H.make_node("Relu", ["M"], ["Y"], name="act")],
              [vi("A", [2, K])], [vi("Y", [2, N])], [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)])
    cands, _ = check(m, tmp_path)
    assert converted(cands) == {"mm"}


# ------------------------------------------------------------------------------------------------
# MatMul + Add: Level-1 MatMulAddFusion, Level-2 MatMulNBitsFusion
# ------------------------------------------------------------------------------------------------

ADDS = {
    # name: (A shape, bias shape, bias is input?, converted?, fusion, code)
    "2d_bias_n": ([2, K], [N], False, True, ("MatMulAddFusion", "DQMatMulToMatMulNBits"), None),
    "2d_dynamic_rows": (["s", K], [N], False, True, ("MatMulAddFusion", "DQMatMulToMatMulNBits"), None),
    "3d_static": ([1, 2, K], [N], False, True, ("MatMulAddFusion", "DQMatMulToMatMulNBits"), None),
    "3d_dynamic": (["b", "s", K], [N], False, True, ("DQMatMulToMatMulNBits", "MatMulNBitsFusion"), None),
    "3d_dynamic_bias_first": (["b", "s", K], [N], False, True, ("DQMatMulToMatMulNBits", "MatMulNBitsFusion"), None),
    "3d_dynamic_bias_input": (["b", "s", K], [N], True, True, ("DQMatMulToMatMulNBits", "MatMulNBitsFusion"), None),
    "no_shape_for_a": (None, [N], False, True, ("DQMatMulToMatMulNBits", "MatMulNBitsFusion"), None),
    "3d_static_bias_input": ([1, 2, K], [N], True, True, ("MatMulAddFusion", "DQMatMulToMatMulNBits"), None),
    "2d_bias_1xN": ([2, K], [1, N], False, False, None, "gemm_bias_shape"),
    "3d_bias_1xN": ([1, 2, K], [1, N], False, True, ("DQMatMulToMatMulNBits",), None),
    "2d_bias_scalar": ([2, K], [], False, True, ("DQMatMulToMatMulNBits",), None),
}


@pytest.mark.parametrize("name", list(ADDS))
def test_matmul_add(name, tmp_path):
    a_shape, b_shape, b_input, ok, fusion, code = ADDS[name]
    rng = rng_for(name)
    inits = [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)]
    ins = [vi("A", a_shape)]
    if b_input:
        ins.append(vi("b", b_shape))
    else:
        inits.append(st("b", b_shape, rng=rng))
    add_in = ["b", "M"] if name.endswith("bias_first") else ["M", "b"]
    out_shape = a_shape[:-1] + [N] if a_shape is not None else None
    m = model([dqn(axis=0, block_size=32), mm(y="M"), H.make_node("Add", add_in, ["Y"], name="add")], ins,
              [vi("Y", out_shape)], inits)
    cands, rej = check(m, tmp_path)
    if ok:
        c = cands[0]
        assert converted(cands) == {"mm"} and c.fusion == fusion
        folded = fusion is not None and len(fusion) > 1
        assert (c.fold_add == "add") == folded and (c.bias == "b") == folded
    else:
        assert codes(rej) == {"dq->mm": code}


def test_matmul_output_also_graph_output_keeps_add(tmp_path):
    rng = rng_for("mmgo")
    m = model([dqn(axis=0, block_size=32), mm(y="M"), H.make_node("Add", ["M", "b"], ["Y"], name="add")],
              [vi("A", ["s", K])], [vi("Y", ["s", N]), vi("M", ["s", N])],
              [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng), st("b", [N], rng=rng)])
    cands, _ = check(m, tmp_path)
    assert converted(cands) == {"mm"} and cands[0].fold_add is None


@pytest.mark.parametrize("attention", [True, False])
def test_matmul_add_fusion_skips_attention_projections(attention, tmp_path):
    """For N-D inputs MatMulAddFusion leaves the Q/K/V MatMul+Add of an attention block alone (AttentionPatternCache:
    a LayerNormalization read by 3 MatMuls and an Add of a residual Add); Level-2 MatMulNBitsFusion folds the bias."""
    rng = rng_for(f"attn{attention}")
    nodes = [H.make_node("Add", ["x", "x0"], ["r"], name="res"),
             H.make_node("LayerNormalization", ["r", "g", "bb"], ["ln"], name="ln", axis=-1)]
    inits, outs = [st("g", [K], value=1.0), st("bb", [K], value=0.0)], []
    for p in "qkv":
        inits += [wt(f"W{p}", [K, N], rng=rng), st(f"S{p}", [2, N], rng=rng), st(f"b{p}", [N], rng=rng)]
        nodes += [dqn(f"W{p}", f"S{p}", out=f"d{p}", name=f"dq_{p}", axis=0, block_size=32), mm("ln", f"d{p}", f"m{p}", f"mm_{p}"),
                  H.make_node("Add", [f"m{p}", f"b{p}"], [f"y{p}"], name=f"add_{p}")]
        outs.append(vi(f"y{p}", None))
    if attention:
        nodes.append(H.make_node("Add", ["ln", "r"], ["z"], name="ln_add"))
        outs.append(vi("z", None))
    m = model(nodes, [vi("x", [1, 4, K]), vi("x0", [1, 4, K])], outs, inits)
    cands, rej = check(m, tmp_path)
    want = ("DQMatMulToMatMulNBits", "MatMulNBitsFusion") if attention else ("MatMulAddFusion", "DQMatMulToMatMulNBits")
    assert not rej and len(cands) == 3 and {c.fusion for c in cands} == {want}


def test_attention_output_projection_is_left_to_matmulnbits_fusion(tmp_path):
    """The output projection whose bias Add feeds the residual Add after the LayerNormalization is in
    AttentionPatternCache's attn_add_nodes: MatMulAddFusion skips it and MatMulNBitsFusion folds its bias."""
    rng = rng_for("oproj")
    nodes = [H.make_node("LayerNormalization", ["x", "g", "bb"], ["ln"], name="ln", axis=-1)]
    inits = [st("g", [K], value=1.0), st("bb", [K], value=0.0)]
    for p in "qkvo":
        kk, nn = (K, K)
        inits += [wt(f"W{p}", [kk, nn], rng=rng), st(f"S{p}", [2, nn], rng=rng), st(f"b{p}", [nn], rng=rng)]
        src = "ln" if p != "o" else "ctx"
        nodes += [dqn(f"W{p}", f"S{p}", out=f"d{p}", name=f"dq_{p}", axis=0, block_size=32), mm(src, f"d{p}", f"m{p}", f"mm_{p}"),
                  H.make_node("Add", [f"m{p}", f"b{p}"], [f"y{p}"], name=f"add_{p}")]
    nodes += [H.make_node("Mul", ["yq", "yk"], ["qk"], name="qk"), H.make_node("Mul", ["qk", "yv"], ["ctx"], name="ctx"),
              H.make_node("Add", ["ln", "yo"], ["z"], name="ln_add")]
    m = model(nodes, [vi("x", [1, 4, K])], [vi("z", [1, 4, K])], inits)
    cands, rej = check(m, tmp_path)
    assert not rej and {c.node: c.fusion[-1] for c in cands} == {f"mm_{p}": "MatMulNBitsFusion" for p in "qkvo"}


def test_attention_projection_input_is_not_special_in_1_31(tmp_path):
    """Newer ORT sources also skip MatMul+Add after Softmax->MatMul->Transpose->Reshape (IsAttentionProjectionInput);
    1.31.1 does not: the pair becomes a Gemm and then MatMulNBits."""
    rng = rng_for("aproj")
    nodes = [H.make_node("Softmax", ["s"], ["p"], name="sm", axis=-1), H.make_node("MatMul", ["p", "v"], ["av"], name="av"),
             H.make_node("Transpose", ["av"], ["t"], name="tr", perm=[0, 2, 1, 3]), H.make_node("Reshape", ["t", "shp"], ["r"], name="rs"),
             dqn(axis=0, block_size=32), mm("r", "Wd", "M", "mm"), H.make_node("Add", ["M", "b"], ["Y"], name="add")]
    m = model(nodes, [vi("s", [1, 2, 4, 4]), vi("v", [1, 2, 4, 32])], [vi("Y", [1, 4, N])],
              [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng), st("b", [N], rng=rng),
               nh.from_array(np.array([1, 4, 64], np.int64), "shp")])
    cands, _ = check(m, tmp_path)
    assert cands[0].fusion == ("MatMulAddFusion", "DQMatMulToMatMulNBits")


@pytest.mark.parametrize("order", ["mm1_first", "mm2_first"])
def test_add_of_two_matmuls_follows_ort_topological_order(order, tmp_path):
    """MatMulAddFusion visits nodes in GraphViewer order: the MatMul it reaches first becomes a Gemm whose bias is
    the other MatMul's [M, N] output (so that Gemm is not fused), and the other MatMul stays and is fused."""
    rng = rng_for(order)
    nodes = [dqn("W1", "S1", out="a", name="dq1", axis=0, block_size=32), dqn("W2", "S2", out="b", name="dq2", axis=0, block_size=32),
             mm("A", "a", "y1", "mm1"), mm("A", "b", "y2", "mm2"), H.make_node("Add", ["y1", "y2"], ["Y"], name="sum")]
    if order == "mm2_first":
        nodes = [nodes[1], nodes[0], nodes[3], nodes[2], nodes[4]]
    m = model(nodes, [vi("A", [2, K])], [vi("Y", [2, N])],
              [wt("W1", [K, N], rng=rng), wt("W2", [K, N], rng=rng), st("S1", [2, N], rng=rng), st("S2", [2, N], rng=rng)])
    cands, rej = check(m, tmp_path)
    assert len(cands) == 1 and len(rej) == 1 and rej[0].code == "gemm_bias_shape"


def test_gemm_without_bias_then_add_folds(tmp_path):
    rng = rng_for("gadd")
    m = model([dqn(axis=0, block_size=32), H.make_node("Gemm", ["A", "Wd"], ["M"], name="gemm"),
               H.make_node("Add", ["M", "b"], ["Y"], name="add")], [vi("A", [2, K])], [vi("Y", [2, N])],
              [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng), st("b", [N], rng=rng)])
    cands, _ = check(m, tmp_path)
    assert cands[0].fold_add == "add" and cands[0].fusion[-1] == "MatMulNBitsFusion"


# ------------------------------------------------------------------------------------------------
# optimization level and switches
# ------------------------------------------------------------------------------------------------

def test_levels_and_switches(tmp_path):
    m = dq_mm(tag="lv")
    cands, rej = check(m, tmp_path, level=BASIC)
    assert not cands and codes(rej) == {"dq->mm": "optimization_level"}
    cands, _ = check(m, tmp_path, level=ALL)
    assert converted(cands) == {"mm"}
    cands, rej = check(m, tmp_path, disabled=("QDQSelectorActionTransformer",))
    assert codes(rej) == {"dq->mm": "qdq_disabled"}
    cands, rej = check(m, tmp_path, config={"session.disable_quant_qdq": "1"})
    assert codes(rej) == {"dq->mm": "qdq_disabled"}
    # the rule's own name is not an optimizer ORT 1.31.1 can disable
    cands, _ = check(m, tmp_path, disabled=("DQMatMulToMatMulNBits",))
    assert converted(cands) == {"mm"}


# ------------------------------------------------------------------------------------------------
# subgraphs
# ------------------------------------------------------------------------------------------------

def _branch(name, inner_inits, w="W", s="S", z=None):
    return H.make_graph([dqn(w, s, z=z, out=f"{name}_Wd", name=f"{name}_dq", axis=0, block_size=32),
                         mm(b=f"{name}_Wd", y=f"{name}_Y", name=f"{name}_mm")], name, [], [vi(f"{name}_Y", [2, N])],
                        inner_inits)


def test_if_branches_and_loop_body(tmp_path):
    rng = rng_for("sub")
    then = _branch("then", [wt("Wt", [K, N], rng=rng), st("St", [2, N], rng=rng)], "Wt", "St")
    other = _branch("else", [wt("We", [K, N], rng=rng), st("Se", [2, N], rng=rng)], "We", "Se")
    body = H.make_graph(
        [dqn("Wl", "Sl", out="Wd_l", name="l_dq", axis=0, block_size=32), mm("x_in", "Wd_l", "x_out", "l_mm"),
         H.make_node("Identity", ["cond_in"], ["cond_out"], name="l_id")], "body",
        [vi("i", [], T.INT64), vi("cond_in", [], T.BOOL), vi("x_in", [2, K])],
        [vi("cond_out", [], T.BOOL), vi("x_out", [2, K])],
        [wt("Wl", [K, K], rng=rng), st("Sl", [2, K], rng=rng)])
    m = model([H.make_node("If", ["c"], ["Y"], then_branch=then, else_branch=other, name="if"),
               H.make_node("Loop", ["M", "", "A"], ["Y2"], body=body, name="loop")],
              [vi("A", [2, K]), vi("c", [], T.BOOL), vi("M", [], T.INT64)], [vi("Y", [2, N]), vi("Y2", [2, K])], [])
    cands, rej = check(m, tmp_path)
    assert {(c.graph_path, c.node) for c in cands} == {("if/then_branch", "then_mm"), ("if/else_branch", "else_mm"),
                                                       ("loop/body", "l_mm")}
    assert not rej


def test_constant_sharing_does_not_reach_subgraphs(tmp_path):
    rng = rng_for("subcs")
    body = H.make_graph([dqn("W1", "S1", out="a", name="dq1"), dqn("W2", "S2", out="b", name="dq2"),
                         mm("A", "a", "y1", "mm1"), mm("A", "b", "y2", "mm2"),
                         H.make_node("Concat", ["y1", "y2"], ["t"], name="cat", axis=0)], "then", [], [vi("t", [4, N])],
                        [wt("W1", [K, N], rng=rng), wt("W2", [K, N], rng=rng), st("S1", [], value=0.5), st("S2", [], value=0.5)])
    other = H.make_graph([H.make_node("Constant", [], ["e"], value=st("ev", [4, N], value=0.0), name="e_c")], "else", [],
                         [vi("e", [4, N])])
    m = model([H.make_node("If", ["c"], ["Y"], then_branch=body, else_branch=other, name="if")],
              [vi("A", [2, K]), vi("c", [], T.BOOL)], [vi("Y", [4, N])], [])
    cands, _ = check(m, tmp_path)
    assert converted(cands) == {"mm1", "mm2"}


def test_dq_outside_the_subgraph_of_its_matmul(tmp_path):
    rng = rng_for("dqout")
    then = H.make_graph([mm("A", "Wd", "t", "then_mm")], "then", [], [vi("t", [2, N])])
    other = H.make_graph([H.make_node("Neg", ["A2"], ["e"], name="e_neg")], "else", [], [vi("e", [2, N])])
    m = model([dqn(axis=0, block_size=32), H.make_node("If", ["c"], ["Y"], then_branch=then, else_branch=other, name="if")],
              [vi("A", [2, K]), vi("A2", [2, N]), vi("c", [], T.BOOL)], [vi("Y", [2, N])],
              [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)])
    cands, rej = check(m, tmp_path)
    assert not cands and [(r.consumer, r.code) for r in rej] == [("if/then_branch:then_mm", "dq_outside_subgraph")]


def test_outer_scope_weight_makes_ort_fail(tmp_path):
    rng = rng_for("outer")
    then = _branch("then", [], "W", "S")
    other = _branch("else", [wt("We", [K, N], rng=rng), st("Se", [2, N], rng=rng)], "We", "Se")
    m = model([H.make_node("If", ["c"], ["Y"], then_branch=then, else_branch=other, name="if")],
              [vi("A", [2, K]), vi("c", [], T.BOOL)], [vi("Y", [2, N])], [wt("W", [K, N], rng=rng), st("S", [2, N], rng=rng)])
    cands, rej = dq_matmul_match(m, graph_optimization_level=EXT)
    by = {c.node: c.ort_outcome for c in cands}
    assert by == {"then_mm": "session_error", "else_mm": "converted"} and not rej
    # in a child process: some releases (1.20) crash on this graph instead of failing cleanly
    src = tmp_path / "outer.onnx"
    onnx.save(m, src)
    code = ("import sys, onnxruntime as ort\n"
            "so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED\n"
            "try:\n    ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])\n"
            "except Exception as e:\n    print(e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "Missing required weight: W" in r.stdout, (r.returncode, r.stdout, r.stderr[-500:])


def test_outer_scope_zero_point_is_silently_dropped_by_ort(tmp_path):
    rng = rng_for("outerzp")
    Wv = rng.integers(-8, 8, (K, N))
    Sv = (rng.random((2, N)) + 0.5).astype(np.float32)
    Zv = np.full((2, N), 3)
    then = _branch("then", [wt("Wt", [K, N], values=Wv), nh.from_array(Sv, "St")], "Wt", "St", z="Z")
    other = H.make_graph([H.make_node("Neg", ["A2"], ["e"], name="e_neg")], "else", [], [vi("e", [2, N])])
    m = model([H.make_node("If", ["c"], ["Y"], then_branch=then, else_branch=other, name="if")],
              [vi("A", [2, K]), vi("A2", [2, N]), vi("c", [], T.BOOL)], [vi("Y", [2, N])], [wt("Z", [2, N], values=Zv)])
    cands, _ = check(m, tmp_path)
    assert cands[0].ort_outcome == "converted_wrong"
    A = (rng.random((2, K)) - 0.5).astype(np.float32)
    ref = A @ ((Wv - np.repeat(Zv, 32, 0)) * np.repeat(Sv, 32, 0))
    fused, unfused = _run_both(m, tmp_path, {"A": A, "A2": np.zeros((2, N), np.float32), "c": np.array(True)})
    assert np.allclose(unfused, ref, rtol=1e-4, atol=1e-3)
    assert not np.allclose(fused, ref, rtol=1e-2, atol=1e-1)


def _run_both(m, tmp_path, feeds):
    p = tmp_path / f"run{len(list(tmp_path.iterdir()))}.onnx"
    onnx.save(m, p)
    outs = []
    for level in (EXT, BASIC):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel(level)
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        outs.append(run_plain(p, feeds, so)[0])
    return outs


@pytest.mark.parametrize("n,wtype", [(5, INT2), (6, UINT2), (8, INT2)])
def test_two_bit_weights_with_n_not_multiple_of_4_are_wrong_in_ort(n, wtype, tmp_path):
    rng = rng_for(f"2bit{n}")
    Wv = rng.integers(*RANGES[wtype], (K, n))
    Sv = (rng.random((2, n)) + 0.5).astype(np.float32)
    m = model([dqn(axis=0, block_size=32), mm()], [vi("A", [3, K])], [vi("Y", [3, n])],
              [wt("W", [K, n], wtype, values=Wv), nh.from_array(Sv, "S")], opset=25)
    cands, _ = check(m, tmp_path)
    want = "converted" if n % 4 == 0 else "converted_wrong"
    assert cands[0].ort_outcome == want
    A = (rng.random((3, K)) - 0.5).astype(np.float32)
    ref = A @ (Wv * np.repeat(Sv, 32, 0))
    fused, unfused = _run_both(m, tmp_path, {"A": A})
    assert np.allclose(unfused, ref, rtol=1e-4, atol=1e-4)
    assert np.allclose(fused, ref, rtol=1e-4, atol=1e-4) == (want == "converted")


def test_bfloat16_scales_are_never_fused(tmp_path):
    """The CPU EP has no bf16 DequantizeLinear kernel, so ORT cannot save the model; that its error names the DQ
    node proves the DQ survived optimization (a fused DQ would be gone)."""
    rng = rng_for("bf16")
    m = model([dqn(axis=0, block_size=32), mm()], [vi("A", [2, K], T.BFLOAT16)], [vi("Y", [2, N], T.BFLOAT16)],
              [wt("W", [K, N], rng=rng), st("S", [2, N], T.BFLOAT16, rng=rng)])
    cands, rej = dq_matmul_match(m, graph_optimization_level=EXT)
    assert not cands and codes(rej) == {"dq->mm": "scale_dtype"}
    with pytest.raises(Exception, match="DequantizeLinear\\(21\\) node with name 'dq'"):
        ort_optimize(m, tmp_path)


@pytest.mark.parametrize("wtype", ["int4", "uint4", "int8", "uint8", "int2", "uint2"])
@pytest.mark.parametrize("zp,scale", [(False, "float32"), (True, "float16")])
def test_synthetic_llama(wtype, zp, scale, tmp_path):
    """ortmem.measure.synth's Llama-shaped QDQ model (tiny preset): every projection and the lm_head, agreed with ORT."""
    from ortmem.measure.synth import SynthConfig, build_model

    m = build_model(SynthConfig.tiny(weight_type=wtype, zero_points=zp, scale_dtype=scale, embedding="quantized"))
    cands, rej = check(m, tmp_path, fp16=scale == "float16")
    assert len(cands) == 15 and not rej and all(c.ort_outcome == "converted" for c in cands)
    gc, gr = dq_gather_match(m)  # the fp16 model reads its table through DQ -> Cast -> Gather
    assert (len(gc), [r.code for r in gr]) == ((0, ["weight_dtype"]) if wtype in ("int8", "int2") else (1, []))
    assert (gc[0].cast is not None) == (scale == "float16") if gc else True


def test_metadata_only_external_weights(tmp_path):
    """The matcher must work on a model whose weights are external (no bytes loaded)."""
    m = dq_mm(k=256, n=64, block=32, tag="ext")
    p = tmp_path / "ext" / "m.onnx"
    p.parent.mkdir()
    onnx.save(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    skel = onnx.load(p, load_external_data=False)
    assert all(t.data_location == T.EXTERNAL for t in skel.graph.initializer)
    cands, _ = dq_matmul_match(skel)
    assert converted(cands) == {"mm"} and (cands[0].K, cands[0].N) == (256, 64)


# ------------------------------------------------------------------------------------------------
# DQ + Gather -> GatherBlockQuantized
# ------------------------------------------------------------------------------------------------

def _pack(vals: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    v = vals.astype(np.int64) & ((1 << bits) - 1)
    v = np.concatenate([v, np.zeros(v.shape[:-1] + ((-v.shape[-1]) % per,), np.int64)], axis=-1)
    v = v.reshape(v.shape[:-1] + (-1, per))
    return (v << (np.arange(per) * bits)).sum(-1).astype(np.uint8)


def _gbq_from_candidate(m: onnx.ModelProto, c) -> onnx.ModelProto:
    """Test-side builder (reads bytes, unlike the matcher) following the candidate's instructions."""
    init = {t.name: t for t in m.graph.initializer}
    W, S = nh.to_array(init[c.weight]), nh.to_array(init[c.scale])
    Z = nh.to_array(init[c.zero_point]) if c.zero_point else None
    tensors = []
    if c.data_dtype == c.weight_dtype:
        data = onnx.TensorProto()
        data.CopyFrom(init[c.weight])  # the DQ weight's bytes, unchanged
        data.name = "data"
        tensors.append(data)
    elif c.bits == 8:
        tensors.append(nh.from_array(W.astype(np.uint8), "data"))
    else:  # uint2 -> uint8 bits=2: the same packed bytes, viewed as [V, D/4]
        raw = init[c.weight].raw_data
        assert raw == _pack(W.astype(np.int64), 2).tobytes()
        tensors.append(nh.from_array(np.frombuffer(raw, np.uint8).reshape(W.shape[0], -1), "data"))
    if c.scale_action == "expand":
        scales = np.full(c.scales_shape, S.reshape(()), S.dtype)
    else:
        scales = S.reshape(c.scales_shape)
    tensors.append(nh.from_array(scales, "scales"))
    inputs = ["data", "ids", "scales"]
    zp = None
    if c.zp_action in ("as-is", "reshape", "expand"):
        zp = Z.reshape(c.scales_shape) if c.zp_action != "expand" else np.full(c.scales_shape, Z.reshape(()), Z.dtype)
    elif c.zp_action == "zeros":
        zp = np.zeros(c.scales_shape, np.uint8)
    elif c.zp_action == "repack":
        zp = Z.reshape(c.scales_shape)
    if zp is not None:
        if c.data_dtype in (T.INT4, T.UINT4):
            tensors.append(nh.from_array(zp.astype(W.dtype), "zp"))
        elif c.bits < 8:
            tensors.append(nh.from_array(_pack(zp.astype(np.int64), c.bits), "zp"))
        else:
            tensors.append(nh.from_array(zp.astype(np.uint8), "zp"))
        inputs.append("zp")
    nodes = [H.make_node("GatherBlockQuantized", inputs, ["G" if c.cast else "Y"], name="gbq", domain="com.microsoft",
                         gather_axis=c.gather_axis, quantize_axis=c.quantize_axis, block_size=c.block_size, bits=c.bits)]
    if c.cast:
        nodes.append(H.make_node("Cast", ["G"], ["Y"], to=c.cast_to))
    idx_t = next(i for i in m.graph.input if i.name == "ids").type.tensor_type.elem_type
    g = H.make_graph(nodes, "gbq", [vi("ids", [5], idx_t)], [vi("Y", None, c.cast_to or c.scale_dtype)], tensors)
    return H.make_model(g, ir_version=10, opset_imports=[H.make_opsetid("", 21), MS])


def _run(m, tmp_path, feeds, level=ALL):
    p = tmp_path / f"g{len(list(tmp_path.iterdir()))}.onnx"
    onnx.save(m, p)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return run_plain(p, feeds, so)[0]


@pytest.mark.parametrize("name", list(GATHERS))
def test_gather_candidates_reproduce_dq_gather(name, tmp_path):
    kw = GATHERS[name]
    m = dq_gather(name, **kw)
    if name == "tied_with_matmul":
        m.graph.input.append(vi("Xa", [2, V]))
    cands, rej = dq_gather_match(m)
    assert len(cands) == 1 and not rej, rej
    c = cands[0]
    assert c.dq_kept == (name == "tied_with_matmul")
    from ortmem.ort.variants import onnx_type_name
    from ortmem.ort.release import capabilities

    refusal = capabilities().gather_refusal(weight_type=onnx_type_name(c.weight_dtype), has_zp=c.has_zp,
                                            scale_type=onnx_type_name(c.scale_dtype))
    if refusal:  # ortmem does not write this GatherBlockQuantized on this release (test_convert checks the hook)
        pytest.skip(refusal)
    ids = np.array([0, 3, -1, 7, 0], np.int64)
    idx_np = np.int32 if kw.get("idx_type") == T.INT32 else np.int64
    feeds = {"ids": ids.astype(idx_np)}
    if name == "tied_with_matmul":
        feeds["Xa"] = np.zeros((2, V), np.float32)
    want = _run(m, tmp_path, feeds)
    got = _run(_gbq_from_candidate(m, c), tmp_path, {"ids": ids.astype(idx_np)})
    assert got.shape == want.shape
    assert np.array_equal(got.astype(np.float32), want.astype(np.float32))


def test_ort_has_no_dq_gather_fusion(tmp_path):
    opt = ort_optimize(dq_gather("nofuse"), tmp_path, level=ALL)
    assert [n.op_type for n in opt.graph.node] == ["DequantizeLinear", "Gather"]


GATHER_REJECTS = {
    "int8": (dict(wtype=T.INT8), "weight_dtype"),
    "int2": (dict(wtype=INT2), "weight_dtype"),
    "int16": (dict(wtype=T.INT16), "weight_dtype"),
    "bf16_scale": (dict(stype=T.BFLOAT16), "scale_dtype"),
    "block8": (dict(attrs=dict(axis=1, block_size=8)), "block_size"),
    "block48": (dict(attrs=dict(axis=1, block_size=48)), "block_size"),
    "uint8_blocks_along_rows": (dict(wtype=T.UINT8, attrs=dict(axis=0, block_size=16), scale_shape=[1, D]), "quantize_axis"),
    "uint8_per_column": (dict(wtype=T.UINT8, attrs=dict(axis=1), scale_shape=[D]), "quantize_axis"),
    "uint8_gather_axis1": (dict(wtype=T.UINT8, gather_axis=1), "gather_axis"),
    "uint2_unaligned": (dict(wtype=UINT2, table=(V, 42)), "unaligned_2bit"),
    "rank3": (dict(table=(2, V, D), attrs=dict(axis=2, block_size=16), scale_shape=[2, V, 4]), "weight_rank"),
}


@pytest.mark.parametrize("name", list(GATHER_REJECTS))
def test_gather_rejections(name, tmp_path):
    kw, code = GATHER_REJECTS[name]
    cands, rej = dq_gather_match(dq_gather(name, **kw))
    assert not cands and [r.code for r in rej] == [code]


@pytest.mark.parametrize("attrs,qaxis,wtype,msg", [
    (dict(block_size=8), 1, np.uint8, "power of 2 and not (less|smaller) than 16"),
    (dict(block_size=16), 0, np.uint8, "quantize_axis must be the last dimension"),
])
def test_gbq_kernel_refuses_what_we_reject(attrs, qaxis, wtype, msg, tmp_path):
    scales = np.ones((V, D // attrs["block_size"]) if qaxis == 1 else (1, D), np.float32)
    node = H.make_node("GatherBlockQuantized", ["data", "ids", "scales"], ["Y"], domain="com.microsoft",
                       gather_axis=0, quantize_axis=qaxis, bits=8, **attrs)
    g = H.make_graph([node], "g", [vi("ids", [2], T.INT64)], [vi("Y", None)],
                     [nh.from_array(np.zeros((V, D), wtype), "data"), nh.from_array(scales, "scales")])
    m = H.make_model(g, ir_version=10, opset_imports=[H.make_opsetid("", 21), MS])
    with pytest.raises(Exception, match=msg):
        _run(m, tmp_path, {"ids": np.array([0, 1], np.int64)})


def test_gather_non_constant_table():
    m = dq_gather("nc")
    m.graph.input.append(vi("W", [V, D], T.INT4))
    cands, rej = dq_gather_match(m)
    assert [r.code for r in rej] == ["weight_not_constant"]
