"""Prepared entries: warm starts for models ortmem does not convert (ortmem.store.finished, ortmem.store.finished_entries).

Every model is checked against plain ORT on its source, for the cold start, the background-prepared
entry and the warm start; memory in fresh processes; a changed source, a tampered file and a read-only
cache folder; ``ortmem prepare`` on a file and a folder.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortmem
from ortmem.errors import OrtmemError
from ortmem.onnxfile import scan
from ortmem.store import finisher, finished, finished_entries
from ortmem.cli import main as cli_main
from ortmem.ort.release import capabilities
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.builders import elementwise
from tests.support.reference import run_plain

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")

CPU = ["CPUExecutionProvider"]


def mlp(path: Path, layers: int = 4, dim: int = 1024, seed: int = 0) -> Path:
    """An fp32 MLP (MatMul + Relu), weights as external data: 4 x 1024x1024 = 16 MiB by default."""
    rng = np.random.default_rng(seed)
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((dim, dim)) * 0.03).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]), helper.make_node("Relu", [f"h{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", dim])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def conv(path: Path) -> Path:
    """Two Convs (plain Conv packs nothing at ORT_DISABLE_ALL: the NCHWc one ORT makes at level 3 does)."""
    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array((rng.standard_normal((64, 32, 3, 3)) * 0.1).astype(np.float32), "cw")
    w2 = numpy_helper.from_array((rng.standard_normal((64, 64, 3, 3)) * 0.1).astype(np.float32), "cw2")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "cb")
    nodes = [helper.make_node("Conv", ["x", "cw", "cb"], ["y"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["y"], ["r"]),
             helper.make_node("Conv", ["r", "cw2"], ["z"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 16, 16])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [w1, b, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))
    return path


def mlp_feeds(dim: int = 1024) -> dict:
    return {"x": np.random.default_rng(7).standard_normal((2, dim)).astype(np.float32)}


def entries(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")] if cache.is_dir() else []


@pytest.fixture
def any_size(monkeypatch):
    """Every model gets a prepared entry, whatever its size (the tests' models are small)."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")


def _int8(folder: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = mlp(folder / "fp32.onnx", layers=3, dim=512)
    quantize_dynamic(str(source), str(folder / "int8.onnx"), weight_type=QuantType.QInt8)
    return folder / "int8.onnx"


MODELS = {
    "fp32-mlp": (lambda d: mlp(d / "mlp.onnx"), mlp_feeds, "finished"),
    "native-int4": (lambda d: write_model(SynthConfig.tiny(form="native", storage="external"), d / "native.onnx"),
                    lambda: {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}, "finished"),
    "int8-qoperator": (_int8, lambda: mlp_feeds(512), "finished"),
    # plain Conv packs nothing: the NCHWc Conv ORT makes at ORT_ENABLE_ALL does, and its filters are finished weights
    "conv": (conv, lambda: {"x": np.random.default_rng(3).standard_normal((1, 32, 16, 16)).astype(np.float32)},
             "finished"),
}


def ort_reload_is_identical(model: Path, feeds: dict, folder: Path) -> bool:
    """Plain ORT's own answer, without ortmem: the model ORT finishes at its default level, saved with its
    pre-packed weights and reloaded with optimizations off, gives the source's outputs (onnxruntime
    1.28.0 reloads a native MatMulNBits model's blobs as NaN; ortmem must then refuse it)."""
    folder.mkdir()
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(folder / "saved.onnx")
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "saved.data")
    ort.InferenceSession(str(model), so, providers=CPU)
    off = ort.SessionOptions()
    off.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(folder / "saved.onnx"), off, providers=CPU).run(None, feeds)[0]
    return np.array_equal(got, run_plain(model, feeds)[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_cold_prepared_and_warm_starts_equal_plain_ort(name, tmp_path, any_size):
    build, feeds_of, warm_action = MODELS[name]
    folder = tmp_path / "model"
    folder.mkdir()
    model = build(folder) if name != "conv" else build(folder / "conv.onnx")
    feeds = feeds_of()
    expected = run_plain(model, feeds)[0]
    cache = tmp_path / "cache"
    cold = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert cold.ortmem_action in ("as-is", "mapped")  # mapped: an embedded model (int8, conv)
    assert np.array_equal(cold.run(None, feeds)[0], expected)  # the first run leaves the builder
    assert len(finisher.started_finishers()) >= 1 and finisher.wait_background(120)
    (entry,) = entries(cache)
    marker = finished_entries.is_marker(finished_entries.lookup_finished(ortmem.store.cache.Cache(cache), entry.name))
    if warm_action == "finished" and not ort_reload_is_identical(model, feeds, tmp_path / "ort-save"):
        warm_action = cold.ortmem_action  # this ORT reloads it wrong: a marker, today's start again
    assert marker == (warm_action != "finished")
    if not marker:  # the entry itself, loaded by plain ORT with optimizations off
        off = ort.SessionOptions()
        off.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        assert np.array_equal(ort.InferenceSession(str(entry / "model.onnx"), off, providers=CPU).run(None, feeds)[0],
                              expected)
    before = len(finisher.started_finishers())
    warm = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert warm.ortmem_action == warm_action
    assert np.array_equal(warm.run(None, feeds)[0], expected)
    assert len(finisher.started_finishers()) == before  # nothing left to build


def test_a_small_model_gets_no_entry_and_no_process(tmp_path):
    model = mlp(tmp_path / "small.onnx", layers=2, dim=256)  # 0.5 MiB, under MIN_FINISHED_BYTES
    cache = tmp_path / "cache"
    before = len(finisher.started_finishers())
    s = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    s.run(None, mlp_feeds(256))
    assert s.ortmem_action == "as-is" and len(finisher.started_finishers()) == before
    assert entries(cache) == []


def test_bytes_models_and_cache_false_prepare_nothing(tmp_path, any_size):
    model = mlp(tmp_path / "m.onnx", layers=2, dim=256)
    before = len(finisher.started_finishers())
    for s in (ortmem.InferenceSession(model, providers=CPU, cache=False),
              ortmem.InferenceSession(onnx.load(str(model)), providers=CPU, cache=tmp_path / "cache")):
        s.run(None, mlp_feeds(256))
    assert len(finisher.started_finishers()) == before and entries(tmp_path / "cache") == []


def _prepared_cache(tmp_path: Path, model: Path) -> Path:
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(model), "--cache", str(cache)]) == 0
    return cache


def test_cache_list_names_what_each_entry_is(tmp_path, any_size, capsys):
    model = mlp(tmp_path / "m.onnx", layers=2, dim=256)
    cache = _prepared_cache(tmp_path, model)
    capsys.readouterr()
    assert cli_main(["cache", "list", "--cache", str(cache)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(rows) == 1 and "  finished  " in rows[0] and str(model) in rows[0]


def test_a_changed_source_is_never_served_stale(tmp_path, any_size):
    model = mlp(tmp_path / "m.onnx", layers=2, dim=256)
    cache = _prepared_cache(tmp_path, model)
    assert ortmem.InferenceSession(model, providers=CPU, cache=cache).ortmem_action == "finished"
    data = tmp_path / "m.onnx.data"
    st = data.stat()
    with open(data, "r+b") as f:  # new weights in place, same size, mtime set back: only ctime tells
        f.seek(4096)
        f.write(np.full(256, 0.5, np.float32).tobytes())
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    feeds = mlp_feeds(256)
    s = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert s.ortmem_action == "as-is"
    assert np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])
    finisher.wait_background(120)
    mlp(tmp_path / "m.onnx", layers=2, dim=256, seed=5)  # replaced outright
    s = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert s.ortmem_action == "as-is" and np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])
    finisher.wait_background(120)


def test_a_tampered_prepared_file_is_refused_and_rebuilt(tmp_path, any_size, caplog):
    model = mlp(tmp_path / "m.onnx", layers=2, dim=256)
    cache = _prepared_cache(tmp_path, model)
    (entry,) = entries(cache)
    with open(entry / "model.data", "r+b") as f:  # a weight byte, keys intact: ORT would map it silently
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    feeds = mlp_feeds(256)
    s = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert s.ortmem_action == "as-is" and "unusable" in caplog.text
    assert np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])
    assert finisher.wait_background(120)
    warm = ortmem.InferenceSession(model, providers=CPU, cache=cache)  # rebuilt after that first run
    assert warm.ortmem_action == "finished" and np.array_equal(warm.run(None, feeds)[0], run_plain(model, feeds)[0])


def test_a_prepared_model_ort_refuses_falls_back_to_the_source(tmp_path, any_size, caplog):
    model = mlp(tmp_path / "m.onnx", layers=2, dim=256)
    cache = _prepared_cache(tmp_path, model)
    (entry,) = entries(cache)
    m = onnx.load(str(entry / "model.onnx"), load_external_data=False)
    m.graph.node[0].op_type = "NoSuchOp"  # still a well-formed file; ORT refuses the graph
    (entry / "model.onnx").chmod(0o600)
    onnx.save_model(m, str(entry / "model.onnx"))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(finished_entries, "finished_problem", lambda *a, **k: None)
    try:  # the cache's digest would refuse the edit first; here ORT is the one that refuses
        from ortmem.store import cache as cache_mod
        monkey.setattr(cache_mod.Cache, "verify", lambda self, e, mode=None: None)
        s = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    finally:
        monkey.undo()
    assert "could not load the finished model" in caplog.text
    assert s.ortmem_action == "as-is" and entries(cache) == []
    feeds = mlp_feeds(256)
    assert np.array_equal(s.run(None, feeds)[0], run_plain(model, feeds)[0])
    finisher.wait_background(120)


def test_prepare_a_folder_converts_qdq_and_prepares_the_rest(tmp_path, any_size, capsys):
    from ortmem.store.finished_entries import finished_stems

    folder = tmp_path / "models"
    folder.mkdir()
    fp32 = mlp(folder / "mlp.onnx", layers=2, dim=256)
    qdq = write_model(SynthConfig.tiny(storage="external"), folder / "qdq.onnx")
    cnv = conv(folder / "conv.onnx")
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(folder), "--cache", str(cache)]) == 0
    found = entries(cache)
    assert len(found) == 3
    assert sum(any((e / f"{stem}.onnx").exists() for stem in finished_stems(e)) for e in found) == 1  # the converted QDQ entry, finished
    before = len(finisher.started_finishers())
    assert ortmem.InferenceSession(fp32, providers=CPU, cache=cache).ortmem_action == "finished"
    assert ortmem.InferenceSession(qdq, providers=CPU, cache=cache).ortmem_action == "finished"  # its converted entry's finished model
    assert ortmem.InferenceSession(cnv, providers=CPU, cache=cache).ortmem_action == "finished"  # NCHWc filters mapped
    assert len(finisher.started_finishers()) == before
    assert "finished entry" in capsys.readouterr().err
    assert cli_main(["prepare", str(folder), "--cache", str(cache)]) == 0  # again: all there already
    assert sorted(entries(cache)) == sorted(found)


def test_prepare_names_a_broken_genai_folder_without_a_traceback(tmp_path, capsys):
    """A genai folder whose config cannot be read: one line naming it, exit 1, nothing written."""
    folder = tmp_path / "genai"
    folder.mkdir()
    (folder / "genai_config.json").write_text("{not json")
    mlp(folder / "decoder.onnx", layers=1, dim=64)
    assert cli_main(["prepare", str(tmp_path), "--cache", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert "onnxruntime-genai folder" in err and "not prepared" in err and "Traceback" not in err
    assert entries(tmp_path / "cache") == []


_START = r"""
import json, sys, numpy as np
import ortmem
from ortmem.store import finisher
from ortmem.base import procfs
dim = int(sys.argv[3])
feeds = {"x": np.random.default_rng(7).standard_normal((2, dim)).astype(np.float32)}
if sys.argv[1] == "ort":
    import onnxruntime as ort
    s = ort.InferenceSession(sys.argv[2], providers=["CPUExecutionProvider"])
    action = "ort"
else:
    s = ortmem.InferenceSession(sys.argv[2], providers=["CPUExecutionProvider"], cache=sys.argv[4])
    action = s.ortmem_action
out = s.run(None, feeds)[0]
print(json.dumps({"action": action, "anon": procfs.read_status("self")["RssAnon"], "out": out.tolist(),
                  "finishers": len(finisher.started_finishers())}))
"""


def _start(*args: str, prefix: tuple[str, ...] = ()) -> dict:
    r = subprocess.run([*prefix, sys.executable, "-c", _START, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    result["stderr"] = r.stderr
    return result


@pytest.mark.slow
def test_a_warm_start_holds_far_less_private_memory_than_plain_ort(tmp_path):
    """Fresh processes, RssAnon after the first run: the MLP's 96 MiB of packed MatMul weights are
    mapped from the prepared entry instead of living on the heap (measured on 1.32.0: 216 vs 23 MiB
    at 192 MiB of weights, docs/finished.md)."""
    model = mlp(tmp_path / "m.onnx", layers=6, dim=2048)
    cache = _prepared_cache(tmp_path, model)
    base = _start("ort", str(model), "2048")
    warm = _start("ortmem", str(model), "2048", str(cache))
    assert warm["action"] == "finished" and warm["finishers"] == 0
    assert warm["out"] == base["out"]
    assert warm["anon"] <= 0.5 * base["anon"], (warm["anon"] >> 20, base["anon"] >> 20)


def _read_only_prefix(folder: Path) -> tuple[str, ...]:
    """A command prefix that runs the child with ``folder`` mounted read-only (a private mount
    namespace: even root cannot write it); skips when this machine cannot."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    probe = subprocess.run(["unshare", "-m", "sh", "-c", script, str(folder), "touch",
                            str(folder / ".w")], capture_output=True) if shutil.which("unshare") else None
    if probe is None or (folder / ".w").exists() or b"Read-only" not in probe.stderr:
        (folder / ".w").unlink(missing_ok=True)
        pytest.skip("no read-only bind mount possible here (unshare -m and mount need CAP_SYS_ADMIN)")
    return ("unshare", "-m", "sh", "-c", script, str(folder))


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in [folder, *folder.rglob("*")]}


def test_a_read_only_cache_warm_starts_with_no_write(tmp_path, any_size):
    """After `ortmem prepare`, a process that cannot write the cache folder maps the entry: no
    finisher, no warning, nothing in the folder touched (not even the recency mtime), every byte still
    verified (a byte flipped is refused the same way)."""
    model = mlp(tmp_path / "m.onnx", layers=2, dim=256)
    cache = _prepared_cache(tmp_path, model)
    prefix = _read_only_prefix(cache)
    before = _tree(cache)
    warm = _start("ortmem", str(model), "256", str(cache), prefix=prefix)
    assert warm["action"] == "finished" and warm["finishers"] == 0
    assert "ortmem" not in warm["stderr"] and "WARNING" not in warm["stderr"], warm["stderr"]
    assert _tree(cache) == before
    assert warm["out"] == run_plain(model, mlp_feeds(256))[0].tolist()
    (entry,) = entries(cache)
    with open(entry / "model.data", "r+b") as f:
        f.seek(50)
        b = f.read(1)
        f.seek(50)
        f.write(bytes([b[0] ^ 1]))
    before = _tree(cache)
    damaged = _start("ortmem", str(model), "256", str(cache), prefix=prefix)
    assert damaged["action"] == "as-is" and damaged["finishers"] == 0 and _tree(cache) == before
    assert damaged["out"] == warm["out"]


def test_a_prepared_model_that_differs_or_saves_nothing_is_not_worth_mapping(tmp_path):
    """worth_mapping asks the installed ORT: another model's outputs are refused (ORT 1.28 reloads a
    native MatMulNBits model's blobs as NaN), and so is a 'prepared' model that keeps as much private
    memory as the source (here: the source itself, nothing mapped)."""
    from ortmem.ort.settings import OrtSettings
    from ortmem.store.finished import worth_mapping

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = mlp(tmp_path / "a" / "mlp.onnx")
    other = mlp(tmp_path / "b" / "mlp.onnx", seed=1)
    assert "other outputs" in worth_mapping(first, other, OrtSettings())
    assert "nothing ORT keeps is mapped" in worth_mapping(first, first, OrtSettings())


def test_a_settled_model_with_external_data_goes_to_ort_unloaded(tmp_path, any_size):
    """A model whose finished entry is a marker (ORT makes and packs nothing of it) was loaded once, converted
    nothing, and its files are unchanged: later starts give ORT the file as it is, without the loader
    or onnx (the store's ``"unconverted"`` verdict), in a fresh process, with plain ORT's outputs. An
    edit of its external data undoes that: its references are checked again (from the file's bytes,
    and a data file cut short is refused)."""
    folder = tmp_path / "model"
    folder.mkdir()
    model = elementwise(folder / "scale.onnx", external=False)
    proto = onnx.load(str(model))
    onnx.save_model(proto, str(model), save_as_external_data=True, location="conv.data", size_threshold=0)
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 32, 16, 16)).astype(np.float32)}
    cache = tmp_path / "cache"
    assert cli_main(["prepare", str(model), "--cache", str(cache)]) == 0
    assert finished_entries.is_marker(next(iter(ortmem.store.cache.Cache(cache).entries())))
    np.save(tmp_path / "x.npy", feeds["x"])
    start = (f"import sys, json, numpy as np, ortmem\n"
             f"s = ortmem.InferenceSession({str(model)!r}, providers=['CPUExecutionProvider'], cache={str(cache)!r})\n"
             f"y = s.run(None, {{'x': np.load({str(tmp_path / 'x.npy')!r})}})[0]\n"
             f"np.save({str(tmp_path / 'y.npy')!r}, y)\n"
             "print(json.dumps([s.ortmem_action, 'onnx' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["as-is", False]
    assert np.array_equal(np.load(tmp_path / "y.npy"), run_plain(model, feeds)[0])
    data = folder / "conv.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))  # same size, new content: the marker's sources check fails
    edited = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert edited.ortmem_action == "as-is"
    assert np.array_equal(edited.run(None, feeds)[0], run_plain(model, feeds)[0])
    del edited
    data.write_bytes(bytes(raw[:-1]))
    with pytest.raises(OrtmemError, match="past the end"):
        ortmem.InferenceSession(model, providers=CPU, cache=cache)
