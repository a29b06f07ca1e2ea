"""Warm starts load ORT's finished model (ortmem.store.finished): the graph ORT optimized at the caller's
settings, every weight its optimizers and constant folding made, and its pre-packed buffers, mapped.

Per model class (a conv net whose filters ORT reorders to NCHWc at ORT_ENABLE_ALL, a GroupQueryAttention
decoder whose tied embedding ORT folds out of a Transpose, a ``quantize_dynamic`` int8 model): a fresh
process's warm start gives plain ORT's outputs and holds far less private memory than plain ORT. The
entry is keyed by what changes the finished model (optimization level, config entries, disabled
optimizers), and the caller's options read back unchanged.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortmem
from ortmem.onnxfile import scan
from ortmem.cli import main as cli_main
from ortmem.session.request import Request
from ortmem.ort import release, settings as ort_settings
from ortmem.ort.release import capabilities
from ortmem.store import finisher
from tests.store.test_finished_saves import mlp
from tests.support.decoders import decoder_feeds, gqa_decoder
from tests.support.reference import CPU, run_plain

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model may get a finished entry (children inherit the variable)."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")


def conv_net(path: Path, layers: int = 6, channels: int = 192) -> Path:
    """A VGG-like stack of 3x3 Convs + Relu (about 7.6 MiB of fp32 filters at the defaults)."""
    rng = np.random.default_rng(4)
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((channels, channels, 3, 3)) * 0.03).astype(np.float32),
                                          f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(channels) * 0.1).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "vgg", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def int8_mlp(path: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = mlp(path.with_name("fp32.onnx"), layers=4, dim=2048)
    quantize_dynamic(str(source), str(path), weight_type=QuantType.QInt8, use_external_data_format=True)
    return path


DECODER = dict(hidden=256, heads=4, kv_heads=2, ffn=1024, vocab=8192)

#: name: (builder, feeds)
CLASSES: dict[str, tuple[Callable[[Path], Path], Callable[[], dict]]] = {
    "conv-nchwc": (conv_net, lambda: {"x": np.random.default_rng(3).standard_normal((1, 192, 8, 8)).astype(np.float32)}),
    "tied-decoder": (lambda p: gqa_decoder(p, **DECODER), lambda: decoder_feeds(**{k: v for k, v in DECODER.items() if k != "ffn"})),
    "int8-dynamic": (int8_mlp, lambda: {"x": np.random.default_rng(7).standard_normal((2, 2048)).astype(np.float32)}),
}

_CHILD = r"""
import json, sys, numpy as np
import onnxruntime as ort
from ortmem.base import procfs
what, model, feeds_file, out_file = sys.argv[1:5]
feeds = dict(np.load(feeds_file))
if what == "empty":
    print(json.dumps({"anon": procfs.read_status("self")["RssAnon"]}))
    raise SystemExit
if what == "ort":
    s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    action = "ort"
else:
    import ortmem
    s = ortmem.InferenceSession(model, providers=["CPUExecutionProvider"], cache=sys.argv[5])
    action = s.ortmem_action
outs = s.run(None, feeds)
np.savez(out_file, *outs)
print(json.dumps({"action": action, "anon": procfs.read_status("self")["RssAnon"]}))
"""


def _child(tmp_path: Path, what: str, model: Path, *extra: str) -> tuple[dict, list[np.ndarray]]:
    out = tmp_path / f"{what}.npz"
    r = subprocess.run([sys.executable, "-c", _CHILD, what, str(model), str(tmp_path / "feeds.npz"), str(out), *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    outs = [v for _, v in sorted(np.load(out).items(), key=lambda kv: int(kv[0].split("_")[1]))] if out.exists() else []
    return result, outs


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_warm_start_maps_what_ort_finishes(name: str, tmp_path: Path, any_size) -> None:
    """Fresh processes, RssAnon after creation and one run: the warm start's outputs are plain ORT's, and it
    holds at most half of plain ORT's private memory above an empty interpreter's (with the previous entry,
    ORT's save of the source graph, the conv net held 77% and the int8 model more than plain ORT)."""
    build, feeds_of = CLASSES[name]
    (tmp_path / "m").mkdir()
    model = build(tmp_path / "m" / "model.onnx")
    np.savez(tmp_path / "feeds.npz", **feeds_of())
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(model), "--cache", str(cache)]) == 0
    empty, _ = _child(tmp_path, "empty", model)
    plain, expected = _child(tmp_path, "ort", model)
    warm, got = _child(tmp_path, "ortmem", model, str(cache))
    assert warm["action"] == "finished"
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))
    plain_above, warm_above = plain["anon"] - empty["anon"], warm["anon"] - empty["anon"]
    assert plain_above >= 4 << 20, plain_above  # the model is big enough to tell
    assert warm_above <= 0.5 * plain_above, (name, warm_above >> 20, plain_above >> 20)


def _level_options(level: ort.GraphOptimizationLevel) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    return so


def test_an_entry_answers_only_the_settings_it_was_finished_at(tmp_path: Path, any_size) -> None:
    """A session at another optimization level, with another config entry that changes the graph, or with
    another optimizer disabled never gets the default session's finished entry; each gets plain ORT's
    outputs under its own options. A session at a level of its own gets an entry of its own, made at that
    level, and its options read back as the caller set them."""
    model = conv_net(tmp_path / "conv.onnx", layers=2, channels=64)
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 64, 8, 8)).astype(np.float32)}
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(model), "--cache", str(cache)]) == 0
    assert ortmem.InferenceSession(model, providers=CPU, cache=cache).ortmem_action == "finished"

    basic = _level_options(ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    no_qdq = ort.SessionOptions()
    no_qdq.add_session_config_entry("session.disable_quant_qdq", "1")
    cases = [(basic, {}), (no_qdq, {}), (None, {"disabled_optimizers": ["NchwcTransformer"]})]
    for options, kwargs in cases:
        s = ortmem.InferenceSession(model, options, providers=CPU, cache=cache, **kwargs)
        assert s.ortmem_action != "finished", (options, kwargs)
        plain = ort.InferenceSession(str(model), options, providers=CPU, **kwargs).run(None, feeds)
        assert all(np.array_equal(a, b) for a, b in zip(s.run(None, feeds), plain))
        assert finisher.wait_background(120)

    s = ortmem.InferenceSession(model, no_qdq, providers=CPU, cache=cache)
    assert s.ortmem_action == "finished"  # its own entry (its first run above left the finishing to the background)
    assert no_qdq.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert no_qdq.get_session_config_entry("session.disable_quant_qdq") == "1"
    plain = ort.InferenceSession(str(model), no_qdq, providers=CPU).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(s.run(None, feeds), plain))
