"""Mutation fuzzing of ortmem against plain ORT, shared by tests/passes/test_validity.py (a few thousand cases)
and bench/fuzz.py (the long run: 1e5 loads, 5e3 sessions).

Each case is a seed model mutated either on the wire (flipped, inserted, deleted bytes; truncation)
or in its structure (the faults a rewrite could hide or create: duplicate attributes and outputs,
dangling inputs, odd axes and block sizes, wrong dims and dtypes). The verdicts:

- ``load``: ``ortmem.load`` returns a model or raises an ``OrtmemError``; nothing else.
- ``session``: ortmem and plain ORT accept exactly the same models, and where both do, their
  outputs are equal (NaN-aware, same count). Any exception out of ortmem that is neither an
  ``OrtmemError`` nor ORT's own refusal is a failure.

Seeds come from ``np.random.default_rng(seed)``: a case is reproduced from its number alone.
"""
from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import ortmem
from ortmem.errors import OrtmemError
from tests.support.builders import make_model

K = 128  # int4 [K, K] codes: 8 KiB, above the loader's inline limit, so it is externalized


def qdq_seed(rng: np.random.Generator, *, subgraph: bool = False) -> onnx.ModelProto:
    """Two int4 DQ+MatMul patterns (one with a bias Add), optionally the second inside an If."""
    inits, nodes = [], []
    for i in range(2):
        packed = rng.integers(0, 256, size=K * K // 2, dtype=np.uint8)
        inits.append(helper.make_tensor(f"W{i}_q", TensorProto.INT4, [K, K], packed.tobytes(), raw=True))
        inits.append(numpy_helper.from_array((rng.random((K // 32, K), dtype=np.float32) * 0.02 + 0.01), f"W{i}_s"))
    inits.append(numpy_helper.from_array(rng.standard_normal(K).astype(np.float32), "bias"))
    nodes += [helper.make_node("DequantizeLinear", ["W0_q", "W0_s"], ["W0"], axis=0, block_size=32, name="dq0"),
              helper.make_node("MatMul", ["x", "W0"], ["h"], name="mm0"),
              helper.make_node("Add", ["h", "bias"], ["hb"], name="add0")]
    second = [helper.make_node("DequantizeLinear", ["W1_q", "W1_s"], ["W1"], axis=0, block_size=32, name="dq1"),
              helper.make_node("MatMul", ["hb", "W1"], ["y"], name="mm1")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, K])
    if subgraph:
        then = helper.make_graph(second, "then", [], [out])
        other = helper.make_graph([helper.make_node("Identity", ["hb"], ["e"])], "else", [],
                                  [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, K])])
        nodes.append(helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="if0"))
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    else:
        nodes += second
    return make_model(helper.make_graph(nodes, "fuzz", inputs, [out], inits))


def feeds_for(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((1, K)).astype(np.float32)}
    if any(i.name == "c" for i in model.graph.input):
        feeds["c"] = np.array(True)
    return feeds


# ------------------------------------------------------------------------------ mutations
def mutate_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    """One to three wire-level edits: flip, set, insert or delete a byte, or truncate."""
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        if not buf:
            break
        kind = int(rng.integers(0, 5))
        pos = int(rng.integers(0, len(buf)))
        if kind == 0:
            buf[pos] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            buf[pos] = int(rng.integers(0, 256))
        elif kind == 2:
            buf.insert(pos, int(rng.integers(0, 256)))
        elif kind == 3:
            del buf[pos]
        else:
            del buf[pos:]
    return bytes(buf)


def flip_weight_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    """A few flipped bits in the last half of the file (mostly weight bytes): a valid model with
    other weights, so both sessions load it and their outputs are compared."""
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        pos = int(rng.integers(len(buf) // 2, len(buf)))
        buf[pos] ^= 1 << int(rng.integers(0, 8))
    return bytes(buf)


def _nodes(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    out = list(m.graph.node)
    for n in m.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out += list(a.g.node)
    return out


def _inits(m: onnx.ModelProto) -> list[TensorProto]:
    out = list(m.graph.initializer)
    for n in m.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out += list(a.g.initializer)
    return out


def _dup_attribute(m, rng):
    n = rng.choice(_nodes(m))
    n.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("axis", 1)])


def _dup_output(m, rng):
    nodes = _nodes(m)
    a, b = rng.choice(len(nodes), 2, replace=False)
    if nodes[b].output:
        nodes[a].output[0] = nodes[b].output[0]


def _dangling_input(m, rng):
    n = rng.choice([n for n in _nodes(m) if n.input])
    n.input[int(rng.integers(0, len(n.input)))] = "dangling"


def _set_attr(m, rng):
    n = rng.choice([n for n in _nodes(m) if n.op_type == "DequantizeLinear"])
    name = str(rng.choice(["axis", "block_size"]))
    value = int(rng.choice([-2, -1, 0, 1, 2, 7, 16, 64, 128, 256]))
    for a in n.attribute:
        if a.name == name:
            a.i = value
            return
    n.attribute.append(helper.make_attribute(name, value))


def _dims(m, rng):
    t = rng.choice(_inits(m))
    if t.dims:
        i = int(rng.integers(0, len(t.dims)))
        t.dims[i] = int(rng.choice([0, 1, 2, 16, 32, 64, 256, t.dims[i] * 2, -1]))


def _dtype(m, rng):
    t = rng.choice(_inits(m))
    t.data_type = int(rng.choice([1, 2, 3, 10, 16, 21, 22, 25, 26]))


def _drop_init(m, rng):
    g = m.graph
    if len(g.initializer):
        del g.initializer[int(rng.integers(0, len(g.initializer)))]


def _swap_inputs(m, rng):
    n = rng.choice([n for n in _nodes(m) if len(n.input) >= 2])
    n.input[0], n.input[1] = n.input[1], n.input[0]


def _op(m, rng):
    n = rng.choice(_nodes(m))
    n.op_type = str(rng.choice(["MatMul", "Gemm", "DequantizeLinear", "Add", "Identity", "Gather"]))


def _shared_weight(m, rng):
    """The second MatMul reads the first's DequantizeLinear output (a DQ with two consumers)."""
    for n in _nodes(m):
        if n.op_type == "MatMul" and n.input[1] == "W1":
            n.input[1] = "W0"


def _scale_fp16(m, rng):
    for t in _inits(m):
        if t.name.endswith("_s") and rng.random() < 0.7:
            arr = numpy_helper.to_array(t).astype(np.float16)
            t.CopyFrom(numpy_helper.from_array(arr, t.name))


STRUCTURAL: list[Callable] = [_dup_attribute, _dup_output, _dangling_input, _set_attr, _dims, _dtype,
                              _drop_init, _swap_inputs, _op, _shared_weight, _scale_fp16]


def mutate_model(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    """One structural edit (the faults conversion could hide or create), sometimes a wire edit on top."""
    m = copy.deepcopy(model)
    STRUCTURAL[int(rng.integers(0, len(STRUCTURAL)))](m, rng)
    data = m.SerializeToString()
    return mutate_bytes(data, rng) if rng.random() < 0.2 else data


# -------------------------------------------------------------------------------- verdicts
@dataclass
class Tally:
    cases: int = 0
    accepted: int = 0
    refused: int = 0
    converted: int = 0  # sessions where ortmem rewrote the model (so the comparison means something)
    failures: list[str] = field(default_factory=list)

    def fail(self, case: int, what: str) -> None:
        self.failures.append(f"case {case}: {what}")


def check_load(path: Path, case: int, tally: Tally) -> None:
    """``ortmem.load``: a model or an OrtmemError."""
    tally.cases += 1
    try:
        with ortmem.load(path) as m:
            m.skeleton.ByteSize()
        tally.accepted += 1
    except OrtmemError:
        tally.refused += 1
    except Exception as exc:  # noqa: BLE001 - the point: anything else is a finding
        tally.fail(case, f"ortmem.load raised {type(exc).__name__}: {exc}")


def _is_ort_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("onnxruntime")


def _outputs(make: Callable[[], object], feeds) -> tuple[Optional[list], Optional[BaseException]]:
    try:
        sess = make()
    except BaseException as exc:  # noqa: BLE001 - classified by the caller
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return None, exc
    try:
        names = {i.name for i in sess.get_inputs()}
        return sess.run(None, {k: v for k, v in feeds.items() if k in names}), None
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return [], exc  # created, but Run failed


def check_session(path: Path, feeds, case: int, tally: Tally, cache) -> None:
    """ortmem and plain ORT accept the same models and agree on outputs."""
    tally.cases += 1
    def options() -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        return so

    made: list = []

    def ours():
        made.append(ortmem.InferenceSession(str(path), options(), providers=["CPUExecutionProvider"], cache=cache))
        return made[-1]

    want, ort_exc = _outputs(lambda: ort.InferenceSession(str(path), options(), providers=["CPUExecutionProvider"]), feeds)
    got, our_exc = _outputs(ours, feeds)
    if made and (made[0].ortmem_report is not None or made[0].ortmem_cache_hit):
        tally.converted += 1
    if our_exc is not None and not isinstance(our_exc, OrtmemError) and not _is_ort_error(our_exc):
        tally.fail(case, f"ortmem raised {type(our_exc).__name__}: {our_exc}")
        return
    ort_created, our_created = want is not None, got is not None
    if ort_created != our_created:
        tally.fail(case, f"plain ORT {'accepts' if ort_created else 'refuses'} the model, ortmem "
                         f"{'accepts' if our_created else 'refuses'} it ({our_exc or ort_exc})")
        return
    if not ort_created:
        tally.refused += 1
        return
    tally.accepted += 1
    if (ort_exc is None) != (our_exc is None):
        tally.fail(case, f"Run: ORT {ort_exc!r}, ortmem {our_exc!r}")
        return
    if len(got) != len(want) or not all(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
                                        for a, b in zip(got, want)):
        tally.fail(case, "outputs differ from plain ORT")


def run_fuzz(*, loads: int, sessions: int, seed: int = 0, folder: Optional[Path] = None,
             progress: Optional[Callable[[str], None]] = None) -> tuple[Tally, Tally]:
    """``loads`` wire/structure mutations through ortmem.load, ``sessions`` through both sessions."""
    rng = np.random.default_rng(seed)
    folder = Path(folder or tempfile.mkdtemp(prefix="ortmem-fuzz-"))
    folder.mkdir(parents=True, exist_ok=True)
    seeds = [qdq_seed(np.random.default_rng(1)), qdq_seed(np.random.default_rng(2), subgraph=True)]
    wire = [s.SerializeToString() for s in seeds]
    load_tally, session_tally = Tally(), Tally()
    path = folder / "case.onnx"
    for case in range(loads):
        i = case % len(seeds)
        data = mutate_bytes(wire[i], rng) if rng.random() < 0.6 else mutate_model(seeds[i], rng)
        path.write_bytes(data)
        check_load(path, case, load_tally)
        if progress and case and case % 10000 == 0:
            progress(f"load {case}/{loads}: {len(load_tally.failures)} failures")
    cache = folder / "cache"
    for case in range(sessions):
        i = case % len(seeds)
        r = rng.random()
        data = (mutate_model(seeds[i], rng) if r < 0.6 else flip_weight_bytes(wire[i], rng) if r < 0.8
                else mutate_bytes(wire[i], rng))
        p = folder / f"s{case % 2}.onnx"
        p.write_bytes(data)
        check_session(p, feeds_for(seeds[i]), case, session_tally, cache if case % 3 == 0 else False)
        if progress and case and case % 500 == 0:
            progress(f"session {case}/{sessions}: {len(session_tally.failures)} failures")
    return load_tally, session_tally
