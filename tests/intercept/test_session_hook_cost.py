"""A hook that costs nothing where it does nothing: a hooked process whose model ortmem
leaves to ORT (or maps from its own file) imports neither onnx nor ortmem's passes, and pays at most a
few MiB of peak and private memory over a plain process; the default ``trim`` leaves no more private
memory at exit than plain ORT. Every figure comes from a fresh process's /proc/self/status."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.builders import matmul_chain, save, subgraph_model

#: The test's margin over the +2 MiB the hook is held to (docs/hook.md): fresh processes of the same
#: program differ by a fraction of a MiB on a quiet machine, more on a shared one.
MARGIN_MIB = 4.0

#: Standard-library modules the hook leaves out of a process whose models go to ORT as they are
#: (about 20 ms of imports and class creation together): logging and json are imported on first use;
#: shutil and tempfile only where a skeleton is linked (a mapped handoff); its records are named
#: tuples, not dataclasses.
LAZY_STDLIB = {"as-is": ["dataclasses", "json", "logging", "shutil", "tempfile"],
               "mapped": ["dataclasses", "json", "logging"]}

CHILD = """
import sys
import numpy as np
import onnxruntime as ort
if sys.argv[2] != "plain":
    import ortmem
    ortmem.hook(trim=sys.argv[2] == "hooked")
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
out = s.run(None, {"x": np.ones((4, 64), dtype=np.float32)})[0]
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
kib = lambda k: int(status[k].split()[0])
report = [r["action"] for r in __import__("ortmem.intercept.session_hook").intercept.session_hook.report()] if sys.argv[2] != "plain" else []
stdlib = sorted(m for m in ("dataclasses", "json", "logging", "shutil", "tempfile") if m in sys.modules)
import json
print(json.dumps({"stdlib": stdlib, "peak": kib("VmHWM") / 1024, "private": (kib("RssAnon") + kib("RssShmem")) / 1024,
                  "onnx": "onnx" in sys.modules, "passes": "ortmem.passes" in sys.modules,
                  "session": "ortmem.session.inference" in sys.modules, "actions": report, "sum": float(out.sum())}))
"""


def _run(model: Path, side: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), side], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # the hook prints nothing
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 chains ortmem leaves to ORT: one whose weights are all small enough to stay inline
    (ORT gets the file as it is) and one with embedded weights above the inline limit (mapped from
    the file itself through a hard-linked skeleton)."""
    folder = tmp_path_factory.mktemp("hook-cost")
    rng = np.random.default_rng(0)
    return {"as-is": save(matmul_chain(rng, [64, 16, 16, 8]), folder / "small.onnx"),
            "mapped": save(matmul_chain(rng, [64, 256, 256, 8]), folder / "embedded.onnx")}


@pytest.mark.parametrize("kind", ["as-is", "mapped"])
def test_a_model_left_to_ort_imports_no_onnx_and_costs_no_memory(models: dict[str, Path], kind: str) -> None:
    plain, hooked = _run(models[kind], "plain"), _run(models[kind], "hooked")
    assert hooked["actions"] == [kind]
    assert hooked["sum"] == plain["sum"]
    assert not hooked["onnx"] and not hooked["passes"] and not hooked["session"], hooked
    assert not set(hooked["stdlib"]) - set(plain["stdlib"]) & set(LAZY_STDLIB[kind]), (plain, hooked)
    assert hooked["peak"] <= plain["peak"] + MARGIN_MIB, (plain, hooked)
    assert hooked["private"] <= plain["private"] + MARGIN_MIB, (plain, hooked)


def test_trim_leaves_no_more_private_memory_than_plain(models: dict[str, Path]) -> None:
    """The hook's default trim (``malloc_trim`` after creation, glibc's thresholds left alone) against
    the same hooked process without it and against plain ORT, at the end of a process that created
    and ran the session. Why trim rather than pin the thresholds: pinned thresholds restored to
    glibc's dynamic ceiling leave more private memory at exit than plain ORT does."""
    plain, untrimmed, trimmed = (_run(models["mapped"], side) for side in ("plain", "hooked-notrim", "hooked"))
    assert trimmed["private"] <= untrimmed["private"] + 0.5, (untrimmed, trimmed)
    assert trimmed["private"] <= plain["private"] + MARGIN_MIB, (plain, trimmed)


SUBGRAPH_CHILD = """
import json, sys
import numpy as np
import onnxruntime as ort
if sys.argv[2] == "hooked":
    import ortmem
    ortmem.hook()
s = ort.InferenceSession(sys.argv[1], ort.SessionOptions(), providers=["CPUExecutionProvider"])
feed = {"x": np.ones((1, 128), np.float32), "c": np.array(True), "trip": np.array(2, np.int64)}
out = s.run(None, feed)[0]
actions = ([r["action"] for r in __import__("ortmem.intercept.session_hook").intercept.session_hook.report()]
           if sys.argv[2] == "hooked" else [])
print(json.dumps({"actions": actions, "out": out.tolist(), "onnx": "onnx" in sys.modules}))
"""


def test_weights_inside_subgraphs_with_the_callers_options_go_to_ort_as_given(tmp_path: Path) -> None:
    """Such a model cannot be mapped (ORT's checker refuses external data in a subgraph read from a
    hard-linked file, and only the caller's options could carry the folder key): ORT gets it as it
    is, the hook imports no onnx, and the outputs are ORT's own."""
    path = save(subgraph_model(np.random.default_rng(0)), tmp_path / "sub" / "model.onnx")
    runs = {}
    for side in ("plain", "hooked"):
        done = subprocess.run([sys.executable, "-c", SUBGRAPH_CHILD, str(path), side], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        runs[side] = json.loads(done.stdout)
    assert runs["hooked"]["actions"] == ["untouched: weights inside subgraphs, with the caller's SessionOptions"]
    assert runs["hooked"]["out"] == runs["plain"]["out"]
    assert not runs["hooked"]["onnx"]
