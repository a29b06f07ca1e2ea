"""``import ortmem`` is thin, and creating a session never loads a planner, plotting or memray.

Checked in fresh interpreters by module presence (deterministic); the time and RSS figures are in
``bench/bench_import.py``.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("onnx", "matplotlib", "memray", "rich", "ortmem.plan.estimate", "ortmem.plan.partition",
         "ortmem.plan.recompute", "ortmem.plan.partition.run.pipeline_session", "ortmem.measure")


def _loaded(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_ortmem_loads_nothing_heavy():
    assert _loaded("import ortmem") == []


def test_the_session_path_loads_no_planner_plotting_or_memray():
    assert _loaded("import ortmem; ortmem.InferenceSession; ortmem.load") == ["onnx"]


def _modules_after(code: str) -> list[str]:
    """Every module a fresh interpreter holds after ``code`` (a ``SystemExit`` from ``--help`` included)."""
    probe = f"import sys, json\ntry:\n    {code}\nexcept SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cli_help_loads_under_300_modules_and_no_onnx():
    """``ortmem --help`` builds every subcommand's parser and nothing more: no onnx, no passes, no store."""
    loaded = _modules_after("from ortmem.cli import main; main(['--help'])")
    assert len(loaded) < 300, len(loaded)
    assert [m for m in loaded if m == "onnx" or m.startswith(("ortmem.passes", "ortmem.store", "ortmem.ort.release"))] == []


def test_load_loads_no_passes_store_or_release_code():
    """``ortmem.load`` reads a model: the loading core and ORT's external-data rules, nothing of the passes,
    the store or the release model. onnx itself is inherent: the result holds an onnx ModelProto."""
    loaded = _modules_after("import ortmem; ortmem.load")
    assert "onnx" in loaded
    assert [m for m in loaded if m.startswith(("ortmem.passes", "ortmem.store", "ortmem.intercept", "ortmem.ort.release",
                                               "ortmem.ort.variants", "ortmem.session", "ortmem.session.inference"))] == []


def test_lazy_names_resolve_to_their_owners():
    import ortmem

    for name in ortmem.__all__:
        assert getattr(ortmem, name) is not None
    assert ortmem.InferenceSession.__module__ == "ortmem.session.inference" and ortmem.estimate.__module__.startswith("ortmem.plan.estimate.")
    with pytest.raises(AttributeError):
        ortmem.not_a_name  # noqa: B018


def test_a_warm_start_loads_no_passes_and_no_onnx(tmp_path):
    """A start that finds its converted entry loads it by path: nothing of the conversion (the passes,
    the writer, the publisher) is imported, and not onnx either (its key reads onnx's version from the
    install, recompute metadata is searched in the entry's bytes), so a warm start pays none of it.
    The cold start runs in its own process first, as a user's first start would; the second packs
    ORT's weights on its first hit (which parses the entry); the third only maps. None of them imports
    hashlib (which loads OpenSSL, 3.6 MiB): names and sampled digests are xxhash's (ortmem.base.hashing)."""
    import os

    from ortmem.measure.synth import SynthConfig, write_model

    model = write_model(SynthConfig(storage="external"), tmp_path / "model.onnx")
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(tmp_path / "cache")}
    start = (f"import sys, json, ortmem\ns = ortmem.InferenceSession({str(model)!r}, providers=['CPUExecutionProvider'])\n"
             "print(json.dumps([s.ortmem_action, sorted(m for m in sys.modules if m in ('onnx', 'hashlib') or m.startswith(("
             "'ortmem.passes', 'ortmem.store.writer', 'ortmem.store.publish', 'ortmem.session.cold_start')))]))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", start], env=env, capture_output=True, text=True, check=True,
                                      timeout=300).stdout.strip().splitlines()[-1]) for _ in range(3)]
    assert runs[0][0] == "converted" and "ortmem.store.publish" in runs[0][1] and "hashlib" not in runs[0][1]
    assert runs[1][0] in ("finished", "cache-hit") and [m for m in runs[1][1] if m != "onnx"] == []
    assert runs[2][0] in ("finished", "cache-hit") and runs[2][1] == []


def test_a_prepared_start_loads_no_onnx(tmp_path):
    """A model ortmem does not convert, prepared at deploy time (``ortmem prepare``), starts by mapping
    its prepared entry with no onnx import (on a release that saves no pre-packed weights the entry is
    a marker and ORT gets the model as given), and none of the standard library's process, temporary
    file and logging machinery either (the warm start's own cost). The model is below the finished
    threshold: its handoff record sends the start to the entry."""
    import os
    import time

    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"w{i}") for i in range(4)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"], [f"h{i + 1}" if i < 3 else "y"]) for i in range(4)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 256])], inits)
    path = tmp_path / "mlp.onnx"
    import onnx

    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))  # an installed model's: a file written just now gets no handoff record
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("ORTMEM_PREPARE_MIN_BYTES", None)
    subprocess.run([sys.executable, "-m", "ortmem", "prepare", str(path)], env=env, capture_output=True, check=True,
                   timeout=300)
    heavy = ("onnx", "logging", "subprocess", "tempfile", "uuid", "platform")
    start = (f"import sys, json, numpy, onnxruntime\nbefore = set(sys.modules)\nimport ortmem\n"
             f"s = ortmem.InferenceSession({str(path)!r}, providers=['CPUExecutionProvider'])\n"
             f"print(json.dumps([s.ortmem_action, sorted(m for m in {heavy!r} if m in sys.modules and m not in before)]))")
    action, loaded = json.loads(subprocess.run([sys.executable, "-c", start], env=env, capture_output=True, text=True,
                                               check=True, timeout=300).stdout.strip().splitlines()[-1])
    from ortmem.ort.release import capabilities

    assert "onnx" not in loaded
    if capabilities().prepacked_save:
        assert action == "finished" and loaded == [], loaded


def test_a_small_model_with_nothing_to_convert_imports_no_store(tmp_path):
    """A model file below the finished-entry threshold with no DequantizeLinear is decided from its
    bytes (:mod:`ortmem.onnxfile.scan`): ORT gets it as it is, or its skeleton beside a hard link, and
    nothing of the store, the request or the handoff is imported. The one store module such a start
    uses is its handoff records (the walk's facts kept for the next start, as the hook keeps them);
    without a cache, not even that."""
    import os

    import numpy as np
    from onnx import TensorProto, helper

    from tests.support import builders

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    plain = builders.save(builders.make_model(graph), tmp_path / "relu.onnx")
    embedded = builders.save(builders.matmul_chain(np.random.default_rng(0), [64, 128, 16]), tmp_path / "chain.onnx")
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("ORTMEM_PREPARE_MIN_BYTES", None)
    heavy = ("onnx.", "ortmem.store.", "ortmem.session.request", "ortmem.session.handoff", "ortmem.passes", "ortmem.ort.release")

    def start(path, cache: bool) -> list:
        code = (f"import sys, json, ortmem\ns = ortmem.InferenceSession({str(path)!r}, providers=['CPUExecutionProvider'], "
                f"cache={cache!r})\nloaded = sorted(m for m in sys.modules if m == 'onnx' or m.startswith({heavy!r}))\n"
                "print(json.dumps([s.ortmem_action, loaded]))")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert start(plain, cache=False) == ["as-is", []]
    assert start(embedded, cache=False) == ["mapped", []]
    start(plain, cache=True)  # the first start with a cache opens it (creates its folder)
    for path, action in ((plain, "as-is"), (embedded, "mapped"), (embedded, "mapped")):
        assert start(path, cache=True) == [action, ["ortmem.store.handoff_records"]]
