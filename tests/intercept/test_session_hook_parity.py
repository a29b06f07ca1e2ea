"""Under the hook, every input plain ORT refuses is refused exactly as plain ORT refuses it.

Why a table run in real processes: the hook sits between an unmodified program and ORT, so for a bad
input the program must see what it saw before: the same exception type and message, the same chained
exception, and not one more line on stdout or stderr (ORT's own C++ log lines and its "EP Error" banner
included, which only a process's real file descriptors show). Each input is created once in a plain
interpreter and once in one hooked through the launcher's sitecustomize (``ORTMEM_HOOK=1``), each with
its own file descriptors 1 and 2 captured, and the two records must be equal. A few valid inputs ride
along as controls: both sides succeed, silently.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ortmem.base.child_env import ENV_SWITCH, SITE_DIR
from ortmem.intercept.session_hook import MIN_BYTES, ORIGINAL
from tests.support import builders as mb

ORT_SESSION_MODULE = ORIGINAL.__module__

#: The child: builds each case's arguments from the prepared files, creates the session with fds 1 and 2
#: redirected to a file of its own, and prints one JSON record per case.
CHILD = r'''
import json, os, sys
from pathlib import Path
import onnxruntime as ort

folder = Path(sys.argv[1])
big = (folder / "big.onnx").read_bytes()
qdq = str(folder / "qdq.onnx")

def options(**config):
    so = ort.SessionOptions()
    for key, value in config.items():
        so.add_session_config_entry(key, value)
    return so

CASES = {
    "missing path": lambda: ((str(folder / "missing.onnx"),), {}),
    "missing pathlib.Path": lambda: ((folder / "missing.onnx",), {}),
    "directory": lambda: ((str(folder),), {}),
    "/dev/null": lambda: (("/dev/null",), {}),
    "empty file": lambda: ((str(folder / "empty.onnx"),), {}),
    "garbage file": lambda: ((str(folder / "garbage.onnx"),), {}),
    "truncated model file": lambda: ((str(folder / "truncated.onnx"),), {}),
    "garbage bytes (large)": lambda: ((b"not a model at all" * (len(big) // 18),), {}),
    "truncated model bytes (large)": lambda: ((big[: len(big) // 2],), {}),
    "bytearray of a valid model (large)": lambda: ((bytearray(big),), {}),
    "memoryview of a valid model (large)": lambda: ((memoryview(big),), {}),
    "bytearray (small)": lambda: ((bytearray(b"\x08\x07"),), {}),
    "int": lambda: ((5,), {}),
    "None": lambda: ((None,), {}),
    "no model at all": lambda: ((), {}),
    "five positional arguments": lambda: ((str(folder / "chain.onnx"), None, None, None, 1), {}),
    "unknown operator": lambda: ((str(folder / "unknown_op.onnx"),), {}),
    "external data outside the folder": lambda: ((str(folder / "outside" / "m.onnx"),), {}),
    "QDQ model with a dangling input": lambda: ((str(folder / "dangling.onnx"),), {}),
    "QDQ model, config value ORT refuses": lambda: (
        (qdq, options(**{"session.qdq_matmulnbits_accuracy_level": "abc"})), {}),
    "two TensorRT providers": lambda: (
        (str(folder / "chain.onnx"),), {"providers": ["TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider"]}),
    "control: valid path": lambda: ((str(folder / "chain.onnx"),), {}),
    "control: valid QDQ path": lambda: ((qdq,), {}),
    "control: valid bytes (large)": lambda: ((big,), {}),
}

records = {}
for name, build in CASES.items():
    args, kwargs = build()
    capture = folder / "captured.txt"
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(capture, "wb") as f:
        os.dup2(f.fileno(), 1); os.dup2(f.fileno(), 2)
    try:
        outcome = ["ok", type(ort.InferenceSession(*args, **kwargs)).__module__]
    except BaseException as exc:
        chained = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        outcome = [type(exc).__module__ + "." + type(exc).__qualname__, str(exc),
                   type(chained).__qualname__ if chained is not None else None]
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])
    records[name] = {"outcome": outcome, "output": capture.read_text(errors="replace")}
print(json.dumps(records))
'''

#: ORT's log lines start with a timestamp: the only part two faithful runs may differ in.
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+")


def _prepare(folder: Path, rng: np.random.Generator) -> None:
    """The files the child's cases name (see CHILD)."""
    big = mb.matmul_chain(rng, [512, 1024]).SerializeToString()
    assert len(big) > MIN_BYTES  # large enough that the hook would hand bytes to ortmem
    (folder / "big.onnx").write_bytes(big)
    (folder / "empty.onnx").write_bytes(b"")
    (folder / "garbage.onnx").write_bytes(b"not a model at all" * 10)
    (folder / "truncated.onnx").write_bytes(big[: len(big) // 2])
    mb.save(mb.matmul_chain(rng, [64, 128, 16]), folder / "chain.onnx")
    qdq = mb.int4_model(rng)
    mb.save(qdq, folder / "qdq.onnx")
    dangling = onnx.ModelProto()
    dangling.CopyFrom(qdq)
    next(n for n in dangling.graph.node if n.op_type == "MatMul").input[0] = "nothing_defines_this"
    onnx.save(dangling, folder / "dangling.onnx")
    unknown = mb.matmul_chain(rng, [64, 128])
    unknown.graph.node.append(helper.make_node("NoSuchOperator", [unknown.graph.output[0].name], ["z"]))
    unknown.graph.output[0].name = "z"
    onnx.save(unknown, folder / "unknown_op.onnx")
    _outside_model(folder / "outside", rng)


def _outside_model(folder: Path, rng: np.random.Generator) -> None:
    """An Identity over an initializer whose external data lies in the parent folder (ORT refuses it)."""
    folder.mkdir()
    data = rng.standard_normal(2048).astype(np.float32)
    (folder.parent / "w.bin").write_bytes(data.tobytes())
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[2048], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "../w.bin"), ("offset", "0"), ("length", str(data.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2048])], [t])
    onnx.save(mb.make_model(g), folder / "m.onnx")


def _run(folder: Path, hooked: bool, session_path: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_SWITCH}
    if hooked:
        env[ENV_SWITCH] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH")) if p)
        if session_path:  # every model takes ortmem's session path, not the light route of models left to ORT
            env["ORTMEM_PREPARE_MIN_BYTES"] = "0"
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    records = json.loads(out.stdout)
    for record in records.values():
        record["output"] = _TIMESTAMP.sub("<time>", record["output"])
    return records


@pytest.mark.parametrize("session_path", [True, False], ids=["session-path", "light-route"])
def test_hook_refuses_what_ort_refuses_exactly_as_ort_does(tmp_path, rng, session_path):
    """Both ways a hooked creation can go: ortmem's session path, and the light route that hands a
    model needing nothing to ORT's own class."""
    _prepare(tmp_path, rng)
    plain, hooked = _run(tmp_path, hooked=False), _run(tmp_path, hooked=True, session_path=session_path)
    assert plain.keys() == hooked.keys()
    controls = [name for name in plain if name.startswith("control")]
    for name in controls:  # both succeed silently; on the session path the hooked child really uses ortmem
        assert plain[name]["outcome"] == ["ok", ORT_SESSION_MODULE], plain[name]
        if session_path:
            assert hooked[name]["outcome"] == ["ok", "ortmem.session.inference"], hooked[name]
        else:
            assert hooked[name]["outcome"][0] == "ok", hooked[name]
        assert plain[name]["output"] == hooked[name]["output"] == "", (plain[name], hooked[name])
    refused = [name for name in plain if name not in controls]
    assert all(plain[name]["outcome"][0] != "ok" for name in refused), {n: plain[n] for n in refused}
    different = {name: {"plain": plain[name], "hooked": hooked[name]} for name in refused if plain[name] != hooked[name]}
    assert not different, json.dumps(different, indent=1)
