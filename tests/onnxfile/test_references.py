"""External-data references checked from a model file's bytes (:mod:`ortmem.onnxfile.references`): on
every reference the loader accepts the walk accepts it too, and on every one the loader refuses the walk
sends the model to the loader, so a start refuses it as before, naming the tensor. A model whose
references hold is handed to ORT without onnx, in fresh processes, with ORT's outputs; a data file
changed after a record was made is checked again."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import ortmem
from ortmem.errors import OrtmemError
from ortmem.onnxfile.loader import load
from ortmem.onnxfile.scan import needs_session_path, read_facts
from ortmem.ort.release import capabilities
from tests.support import builders as mb
from tests.support.builders import matmul_chain, save
from tests.support.reference import run_plain

N = 2048  # float32 elements of the external weight: 8 KiB, above the inline limit
DATA = np.arange(N, dtype=np.float32)
Entries = list[tuple[Optional[str], Optional[str]]]


def _tensor(name: str, entries: Entries, *, data_type: int = TensorProto.FLOAT, dims: Optional[list[int]] = None
            ) -> TensorProto:
    t = TensorProto(name=name, data_type=data_type, dims=[N] if dims is None else dims)
    t.data_location = TensorProto.EXTERNAL
    for key, value in entries:
        e = t.external_data.add()
        if key is not None:
            e.key = key
        if value is not None:
            e.value = value
    return t


def _entries(location: str = "w.bin", offset: Optional[str] = "8192", length: Optional[str] = str(DATA.nbytes)
             ) -> Entries:
    return [("location", location)] + ([("offset", offset)] if offset is not None else []) + (
        [("length", length)] if length is not None else [])


def _identity_model(folder: Path, tensor: TensorProto, *, where: str = "initializer") -> Path:
    """``y = W`` with W an initializer, a Constant's value, or an initializer of an If branch."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "w.bin").write_bytes(b"\0" * 8192 + DATA.tobytes())
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    if where == "initializer":
        graph = helper.make_graph([helper.make_node("Identity", [tensor.name], ["y"])], "g", [], [out], [tensor])
    elif where == "constant":
        graph = helper.make_graph([helper.make_node("Constant", [], ["y"], value=tensor)], "g", [], [out])
    else:
        branch = helper.make_graph([helper.make_node("Identity", [tensor.name], ["t"])], "b", [],
                                   [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)], [tensor])
        other = helper.make_graph([helper.make_node("Constant", [], ["e"], value_floats=[0.0])], "e", [],
                                  [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
        cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
        graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)],
                                  "g", [cond], [out])
    path = folder / "m.onnx"
    onnx.save(mb.make_model(graph), path)
    return path


def _short(folder: Path) -> None:
    data = (folder / "w.bin").read_bytes()
    (folder / "w.bin").write_bytes(data[:-1])


def _outside(folder: Path) -> None:
    (folder.parent / "elsewhere.bin").write_bytes((folder / "w.bin").read_bytes())
    os.symlink(folder.parent / "elsewhere.bin", folder / "link.bin")


#: name -> (entries, tensor keywords, what to do to the folder afterwards, where the tensor sits)
CASES: dict[str, tuple[Entries, dict, Optional[Callable[[Path], None]], str]] = {
    "plain": (_entries(), {}, None, "initializer"),
    "no-length": (_entries(length=None), {}, None, "initializer"),
    "no-offset-at-zero": ([("location", "w0.bin"), ("length", str(DATA.nbytes))], {},
                          lambda f: (f / "w0.bin").write_bytes(DATA.tobytes()), "initializer"),
    "checksum-and-prepacked-keys": (_entries() + [("checksum", "abc"), ("prepacked_w", "1")], {}, None, "initializer"),
    "repeated-key-last-wins": ([("offset", "0")] + _entries(), {}, None, "initializer"),
    "constant-value": (_entries(), {}, None, "constant"),
    "if-branch": (_entries(), {}, None, "subgraph"),
    "nested-folder": (_entries(location="sub/w.bin"), {},
                      lambda f: ((f / "sub").mkdir(), (f / "sub" / "w.bin").write_bytes((f / "w.bin").read_bytes())),
                      "initializer"),
    # refused by the loader
    "one-byte-short": (_entries(), {}, _short, "initializer"),
    "length-mismatch": (_entries(length=str(DATA.nbytes - 4)), {}, None, "initializer"),
    "offset-with-space": (_entries(offset=" 8192"), {}, None, "initializer"),
    "offset-with-plus": (_entries(offset="+8192"), {}, None, "initializer"),
    "negative-offset": (_entries(offset="-4"), {}, None, "initializer"),
    "length-not-a-number": (_entries(length="8k"), {}, None, "initializer"),
    "unknown-key": (_entries() + [("basepath", "x")], {}, None, "initializer"),
    "empty-value": (_entries() + [("checksum", "")], {}, None, "initializer"),
    "entry-without-value": (_entries() + [("checksum", None)], {}, None, "initializer"),
    "entry-without-key": (_entries() + [(None, "x")], {}, None, "initializer"),
    "no-location": (_entries()[1:], {}, None, "initializer"),
    "absolute": (_entries(location="/etc/hostname"), {}, None, "initializer"),
    "escaping": (_entries(location="../w.bin"), {}, lambda f: (f.parent / "w.bin").write_bytes(b"\0" * 20000),
                 "initializer"),
    "symlink-outside": (_entries(location="link.bin"), {}, _outside, "initializer"),
    "reserved-marker": (_entries(location="_ORT_MEM_ADDR_w.bin"), {},
                        lambda f: (f / "_ORT_MEM_ADDR_w.bin").write_bytes((f / "w.bin").read_bytes()), "initializer"),
    "missing-file": (_entries(location="gone.bin"), {}, None, "initializer"),
    "a-folder": (_entries(location="sub"), {}, lambda f: (f / "sub").mkdir(), "initializer"),
    "unknown-dtype": (_entries(), {"data_type": 999}, None, "initializer"),
    "negative-dim": (_entries(), {"dims": [-1, N]}, None, "initializer"),
    "wrong-dims": (_entries(), {"dims": [N, 2]}, None, "initializer"),
    "subgraph-short": (_entries(), {}, _short, "subgraph"),
}


def _build(tmp_path: Path, name: str) -> Path:
    entries, kw, after, where = CASES[name]
    path = _identity_model(tmp_path / "m", _tensor("W", entries, **kw), where=where)
    if after is not None:
        after(path.parent)
    return path


def _loader_accepts(path: Path) -> bool:
    try:
        with load(path):
            return True
    except OrtmemError:
        return False


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_walk_accepts_exactly_what_the_loader_accepts(tmp_path: Path, name: str):
    path = _build(tmp_path, name)
    facts = read_facts(path)
    by_bytes = not needs_session_path(path, facts, converting=False)
    assert by_bytes == _loader_accepts(path), name
    if by_bytes:
        assert facts.external_bytes == DATA.nbytes


@pytest.mark.parametrize("name", ["plain", "if-branch", "one-byte-short", "offset-with-plus", "escaping",
                                  "entry-without-value"])
def test_a_start_refuses_what_the_loader_refuses_and_runs_the_rest_as_ort(tmp_path: Path, name: str):
    path = _build(tmp_path, name)
    feeds = {"c": np.array(True)} if CASES[name][3] == "subgraph" else {}
    cache = str(tmp_path / "cache")
    if _loader_accepts(path):
        for _ in range(2):  # the walk, then its record
            got = ortmem.InferenceSession(str(path), providers=["CPUExecutionProvider"], cache=cache).run(None, feeds)
            np.testing.assert_array_equal(got[0], run_plain(path, feeds)[0])
    else:
        for _ in range(2):
            with pytest.raises(OrtmemError) as ei:
                ortmem.InferenceSession(str(path), providers=["CPUExecutionProvider"], cache=cache)
            assert "'W'" in str(ei.value)


def test_a_data_file_cut_after_its_record_is_refused(tmp_path: Path):
    """The record keeps the model file's facts; the data files are checked again at every start."""
    path = _build(tmp_path, "plain")
    cache = str(tmp_path / "cache")
    ortmem.InferenceSession(str(path), providers=["CPUExecutionProvider"], cache=cache)
    _short(path.parent)
    with pytest.raises(OrtmemError) as ei:
        ortmem.InferenceSession(str(path), providers=["CPUExecutionProvider"], cache=cache)
    assert "'W'" in str(ei.value) and "past the end" in str(ei.value)


_START = """
import os, sys
import numpy as np
import onnxruntime as ort
import ortmem
path, cache = sys.argv[1], sys.argv[2]
x = {"x": np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)}
s = ortmem.InferenceSession(path, providers=["CPUExecutionProvider"], cache=cache)
loaded = sorted(m for m in sys.modules if m == "onnx" or m.startswith(("ortmem.passes", "ortmem.onnxfile.loader")))
later = s.ortmem_handoff.later is not None
got = s.run(None, x)[0]
want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, x)[0]
print(s.ortmem_action, loaded, later, np.array_equal(got, want))
"""


@pytest.mark.parametrize("finished", [False, True])
def test_an_external_data_model_starts_without_onnx(tmp_path: Path, finished: bool):
    """Fresh processes on an fp32 chain saved with external data: no onnx, loader or pass imported on its
    first start or later ones, outputs ORT's own. Below the finished-entry threshold nothing is left for
    later; at or above it (``ORTMEM_PREPARE_MIN_BYTES`` lowered here) the first start leaves the
    finished entry's build for after its first run, as a loaded model's start does (on a release that
    saves finished models)."""
    path = save(matmul_chain(np.random.default_rng(5), [64, 512, 256, 8]), tmp_path / "x" / "model.onnx",
                external=True)
    env = {**os.environ, "ORTMEM_PREPARE_MIN_BYTES": str(1 << 16 if finished else 1 << 30)}
    out = subprocess.run([sys.executable, "-c", _START, str(path), str(tmp_path / "cache")], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    later = finished and capabilities().prepacked_save  # a release that saves no finished model leaves nothing
    assert out[0] == "as-is" and out[1] == "[]" and out[2] == str(later) and out[3] == "True", out
    if not finished:
        again = subprocess.run([sys.executable, "-c", _START, str(path), str(tmp_path / "cache")],
                               capture_output=True, text=True, check=True, env=env).stdout.split()
        assert again == out
