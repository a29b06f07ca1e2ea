"""ortmem.load on real files: every storage form, zero-copy views, the lifecycle, and bad input."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortmem.onnxfile import protowire as pw
import ortmem
from ortmem.errors import CorruptModelError, ExternalDataError, TensorShapeError, UnsafePathError, UnsupportedDtypeError
from ortmem.onnxfile.weights import WeightState
from tests.support import builders as mb
from tests.support.reference import run_plain


def _reference_arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("external", [False, True])
def test_views_equal_onnx_and_are_zero_copy(tmp_path, rng, external):
    m = mb.matmul_chain(rng, [64, 128, 32])
    path = mb.save(m, tmp_path / "m.onnx", external=external)
    ref = _reference_arrays(m)
    with ortmem.load(path) as model:
        assert {w.name for w in model.weights} == set(ref)
        for w in model.weights:
            view = w.array()
            np.testing.assert_array_equal(view, ref[w.name])
            assert not view.flags.owndata, "a weight view must not own a copy"
            assert w.embedded is (not external)
            assert w.state is WeightState.MAPPED
        # the skeleton carries no weight bytes
        assert model.skeleton.ByteSize() < 4096
        assert all(not t.raw_data for t in model.skeleton.graph.initializer)


def test_embedded_span_points_into_the_file(tmp_path, rng):
    m = mb.matmul_chain(rng, [64, 64])
    path = mb.save(m, tmp_path / "m.onnx")
    with ortmem.load(path) as model:
        w = model.weight("W0")
        data = path.read_bytes()
        assert data[w.offset : w.offset + w.length] == m.graph.initializer[0].raw_data
        assert model.embedded_spans == 1 and not model.pristine


def test_subgraphs_sparse_and_constants_are_all_found(tmp_path, rng):
    m = mb.subgraph_model(rng)
    path = mb.save(m, tmp_path / "s.onnx")
    with ortmem.load(path, inline_max_bytes=1023) as model:  # the sparse parts are 1.2 and 2.4 KiB
        kinds = {(w.graph, w.kind, w.name) for w in model.weights}
    assert ("", "initializer", "W_outer") in kinds
    assert ("If#0/then_branch", "initializer", "W_then") in kinds
    assert ("If#0/else_branch", "initializer", "W_else") in kinds
    assert ("Constant#2.value", "attribute", "C") in kinds
    assert ("", "sparse_values", "S") in kinds and ("", "sparse_indices", "S_idx") in kinds


def test_small_tensors_stay_inline_and_nothing_is_dropped(tmp_path, rng):
    m = mb.many_small(rng, 60)
    path = mb.save(m, tmp_path / "small.onnx")
    with ortmem.load(path) as model:
        names = [t.name for t in model.skeleton.graph.initializer]
        assert names == [t.name for t in m.graph.initializer]
        for orig, skel in zip(m.graph.initializer, model.skeleton.graph.initializer):
            np.testing.assert_array_equal(numpy_helper.to_array(orig), numpy_helper.to_array(skel))


def test_int4_stays_packed_with_logical_shape(tmp_path, rng):
    m = mb.int4_model(rng, k=256, n=128)
    path = mb.save(m, tmp_path / "q.onnx")
    with ortmem.load(path) as model:
        w = model.weight("Wq")
        assert w.shape == (256, 128) and w.dtype_name == "int4"
        view = w.array()
        assert view.dtype == np.uint8 and view.size == 256 * 128 // 2
        assert view.tobytes() == m.graph.initializer[0].raw_data


def _resident_bytes(start: int, length: int) -> int:
    """Resident bytes of [start, start+length) in this process (mincore via /proc/self/pagemap-free smaps)."""
    total = 0
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo < start + length and hi > start:
                for j in range(i + 1, min(i + 30, len(lines))):
                    if lines[j].startswith("Rss:"):
                        total += int(lines[j].split()[1]) * 1024
                        break
    return total


def test_release_really_drops_pages_and_blocks_reuse(tmp_path, rng):
    m = mb.embedding_model(rng, vocab=4096, hidden=256, out=16)  # 4 MiB table
    path = mb.save(m, tmp_path / "e.onnx", external=True)
    model = ortmem.load(path)
    table = model.weight("table")
    view = table.array()
    assert float(np.abs(view).sum()) > 0  # touch every page
    addr = view.__array_interface__["data"][0]
    mapped = next(mf for mf in model.store.files if mf.path == table.file)
    before = _resident_bytes(addr, table.length)
    assert before >= table.length * 0.9
    del view
    freed = model.store.release(table)
    assert freed >= table.length - 2 * 4096
    assert table.state is WeightState.RELEASED
    with pytest.raises(ortmem.errors.WeightStateError, match="table"):
        table.array()
    # the table was the file's big span: the page range is gone from the resident set
    assert _resident_bytes(addr, table.length) <= 3 * 4096 or not mapped.is_mapped
    model.close()


def test_models_over_2gb_external(tmp_path):
    """External data past 2 GiB: offsets beyond int32 and a sparse file, no protobuf limit."""
    from onnx import TensorProto, helper

    data = tmp_path / "big.onnx.data"
    size = (2 << 30) + (64 << 20)
    with open(data, "wb") as f:
        f.truncate(size)  # sparse: costs no disk
        f.seek(size - 4096)
        f.write(np.arange(1024, dtype=np.float32).tobytes())
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[1024])
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", data.name), ("offset", str(size - 4096)), ("length", "4096")):
        e = t.external_data.add(); e.key, e.value = k, v
    big = TensorProto(name="Big", data_type=TensorProto.FLOAT, dims=[(2 << 30) // 4])
    big.data_location = TensorProto.EXTERNAL
    for k, v in (("location", data.name), ("offset", "0"), ("length", str(2 << 30))):
        e = big.external_data.add(); e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])], [t, big])
    path = tmp_path / "big.onnx"
    onnx.save(mb.make_model(g), path)
    with ortmem.load(path) as model:
        np.testing.assert_array_equal(model.weight("W").array(), np.arange(1024, dtype=np.float32))
        assert model.weight("Big").length == 2 << 30
        assert model.weight_bytes == (2 << 30) + 4096


# ---- bad input: each gets an OrtmemError naming the tensor and the file ----

def _external(tmp_path, rng):
    m = mb.matmul_chain(rng, [64, 64])
    return mb.save(m, tmp_path / "m.onnx", external=True), m


def _set_external(path: Path, **changes) -> None:
    m = onnx.load(path, load_external_data=False)
    t = m.graph.initializer[0]
    for e in t.external_data:
        if e.key in changes:
            e.value = changes[e.key]
    onnx.save(m, path)


def test_truncated_protobuf(tmp_path, rng):
    path = mb.save(mb.matmul_chain(rng, [64, 64]), tmp_path / "m.onnx")
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 3, 7):
        bad = tmp_path / f"cut{cut}.onnx"
        bad.write_bytes(data[:cut])
        with pytest.raises(CorruptModelError) as ei:
            ortmem.load(bad)
        assert str(bad) in str(ei.value)


def test_garbage_and_empty_files(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(CorruptModelError, match="junk.onnx"):
        ortmem.load(junk)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(CorruptModelError, match="empty"):
        ortmem.load(empty)
    with pytest.raises(CorruptModelError, match="not found"):
        ortmem.load(tmp_path / "missing.onnx")


def test_missing_external_file(tmp_path, rng):
    path, _ = _external(tmp_path, rng)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(ExternalDataError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == "W0" and "m.onnx.data" in str(ei.value)


def test_short_external_file(tmp_path, rng):
    path, _ = _external(tmp_path, rng)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(ExternalDataError, match="past the end") as ei:
        ortmem.load(path)
    assert ei.value.tensor == "W0"


def test_offset_past_end(tmp_path, rng):
    path, _ = _external(tmp_path, rng)
    _set_external(path, offset=str(10**9))
    with pytest.raises(ExternalDataError, match="W0"):
        ortmem.load(path)


@pytest.mark.parametrize("location", ["/etc/passwd", "../outside.data", "sub/../../outside.data"])
def test_unsafe_locations(tmp_path, rng, location):
    (tmp_path.parent / "outside.data").write_bytes(b"\0" * 64 * 64 * 4)
    path, _ = _external(tmp_path, rng)
    _set_external(path, location=location)
    with pytest.raises(UnsafePathError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == "W0" and ei.value.file == str(path)


def test_symlink_leaving_folder(tmp_path, rng):
    inner = tmp_path / "model"
    path, _ = _external(inner, rng)
    outside = tmp_path / "elsewhere.data"
    os.replace(inner / "m.onnx.data", outside)
    os.symlink(outside, inner / "m.onnx.data")
    with pytest.raises(UnsafePathError, match="outside the model folder"):
        ortmem.load(path)


def test_symlink_inside_folder_is_fine(tmp_path, rng):
    path, m = _external(tmp_path, rng)
    os.replace(tmp_path / "m.onnx.data", tmp_path / "real.data")
    os.symlink(tmp_path / "real.data", tmp_path / "m.onnx.data")
    with ortmem.load(path) as model:
        np.testing.assert_array_equal(model.weight("W0").array(), numpy_helper.to_array(m.graph.initializer[0]))


def test_length_not_matching_dtype_and_shape(tmp_path, rng):
    path, _ = _external(tmp_path, rng)
    _set_external(path, length="100")
    with pytest.raises(TensorShapeError, match="does not match") as ei:
        ortmem.load(path)
    assert ei.value.tensor == "W0"


def test_embedded_raw_data_of_wrong_size(tmp_path, rng):
    m = mb.matmul_chain(rng, [64, 64])
    m.graph.initializer[0].dims[0] = 65
    path = tmp_path / "bad.onnx"
    onnx.save(m, path)
    with pytest.raises(TensorShapeError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == "W0" and "bad.onnx" in str(ei.value)


def test_unknown_dtype(tmp_path, rng):
    m = mb.matmul_chain(rng, [64, 64])
    m.graph.initializer[0].data_type = 99
    path = tmp_path / "u.onnx"
    onnx.save(m, path)
    with pytest.raises(UnsupportedDtypeError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == "W0" and "u.onnx" in str(ei.value)


def test_corrupt_inner_message_names_file(tmp_path, rng):
    """Flip the length prefix of the big raw_data so it claims more bytes than its message holds."""
    m = mb.matmul_chain(rng, [64, 64])
    path = mb.save(m, tmp_path / "m.onnx")
    data = bytearray(path.read_bytes())
    raw = m.graph.initializer[0].raw_data
    pos = bytes(data).find(raw)
    # raw_data length varint for 16384 is two bytes right before the payload: make it huge
    data[pos - 2] = 0xFF
    data[pos - 1] = 0x7F
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match="m.onnx"):
        ortmem.load(path)


# ------------------------------------------------ inline raw_data: the walk's screen and the loader
# The walk screens every tensor it leaves inline (a learned header makes runs of same-shaped tensors a
# byte comparison); when anything is unconfirmed, the loader checks every inline tensor from the parsed
# skeleton and names the one at fault. These tests make the screen's shortcuts meet bad tensors.

def _tensor_bytes(fields: list[tuple[str, object]]) -> bytes:
    """A TensorProto serialized field by field, in the order given (protobuf accepts any order)."""
    out = b""
    for kind, value in fields:
        if kind == "dims":
            out += pw.encode_varint(pw.TENSOR_DIMS << 3 | pw.VARINT) + pw.encode_varint(value)
        elif kind == "packed_dims":
            out += pw.encode_len_field(pw.TENSOR_DIMS, b"".join(pw.encode_varint(d) for d in value))
        elif kind == "data_type":
            out += pw.encode_varint(pw.TENSOR_DATA_TYPE << 3 | pw.VARINT) + pw.encode_varint(value)
        elif kind == "name":
            out += pw.encode_len_field(pw.TENSOR_NAME, value.encode())
        elif kind == "raw":
            out += pw.encode_len_field(pw.TENSOR_RAW_DATA, value)
        elif kind == "data_location":
            out += pw.encode_varint(pw.TENSOR_DATA_LOCATION << 3 | pw.VARINT) + pw.encode_varint(value)
        elif kind == "doc":
            out += pw.encode_len_field(12, value.encode())
    return out


def _model_with_tensors(path: Path, tensors: list[bytes], output: int = 0) -> Path:
    """A graph whose initializers are the given serialized tensors; its output is ``tensors[output]``
    (ORT drops initializers no node uses before it reads them)."""
    out = onnx.TensorProto()
    out.ParseFromString(tensors[output])
    g = onnx.helper.make_graph([onnx.helper.make_node("Identity", [out.name], ["y"])], "g", [],
                               [onnx.helper.make_tensor_value_info("y", out.data_type, None)])
    graph = g.SerializeToString() + b"".join(pw.encode_len_field(pw.GRAPH_INITIALIZER, t) for t in tensors)
    model = mb.make_model(onnx.GraphProto())
    path.write_bytes(model.SerializeToString() + pw.encode_len_field(pw.MODEL_GRAPH, graph))
    return path


def _ort_refuses(path: Path) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - ORT raises its own pybind types; the verdict is all we need
        return True
    return False


def _ok(name: str, dims=(256,), data_type=onnx.TensorProto.FLOAT) -> bytes:
    n = int(np.prod(dims))
    return _tensor_bytes([*(("dims", d) for d in dims), ("data_type", data_type), ("name", name),
                          ("raw", np.arange(n, dtype=np.float32).tobytes())])


@pytest.mark.parametrize("bad", [
    "dims_off_by_one",       # same raw size, a different header: the fast path must not match
    "raw_short",             # same header as the run, raw_data 4 bytes short
    "shape_after_name",      # the header of the run, but a dim after the name changes the shape
    "long_name",             # a two-byte name length through the fast path
])
def test_a_bad_inline_tensor_in_a_run_of_good_ones_is_named(tmp_path, bad):
    good = [_ok(f"c{i}") for i in range(40)]
    raw = np.arange(256, dtype=np.float32).tobytes()
    name = "x" * 200 if bad == "long_name" else "bad"
    bad_tensor = {
        "dims_off_by_one": _tensor_bytes([("dims", 255), ("data_type", 1), ("name", name), ("raw", raw)]),
        "raw_short": _tensor_bytes([("dims", 256), ("data_type", 1), ("name", name), ("raw", raw[:-4])]),
        "shape_after_name": _tensor_bytes([("dims", 256), ("data_type", 1), ("name", name), ("dims", 2), ("raw", raw)]),
        "long_name": _tensor_bytes([("dims", 256), ("data_type", 1), ("name", name), ("raw", raw + b"\0" * 4)]),
    }[bad]
    path = _model_with_tensors(tmp_path / "run.onnx", good[:20] + [bad_tensor] + good[20:], output=20)
    assert _ort_refuses(path), "ORT itself refuses a raw_data of the wrong size"
    with pytest.raises(TensorShapeError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == name and "run.onnx" in str(ei.value)


def test_a_header_learned_from_a_tensor_with_late_dims_confirms_nothing_wrong(tmp_path):
    """[dims 4][float][name][dims 64][1 KiB raw] is valid; [dims 4][float][name][1 KiB raw] after it is
    not (4 floats): a header learned from the first with the first's size would pass the second."""
    raw = np.zeros(256, np.float32).tobytes()
    late = _tensor_bytes([("dims", 4), ("data_type", 1), ("name", "late"), ("dims", 64), ("raw", raw)])
    short = _tensor_bytes([("dims", 4), ("data_type", 1), ("name", "short"), ("raw", raw)])
    path = _model_with_tensors(tmp_path / "late.onnx", [late, late, short], output=2)
    assert _ort_refuses(path)
    with pytest.raises(TensorShapeError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == "short"


@pytest.mark.parametrize("location", [7, 1 << 40])
def test_a_data_location_protobuf_does_not_know_leaves_the_tensor_inline_and_checked(tmp_path, location):
    """A closed proto2 enum keeps an unknown value aside: the tensor is inline as protobuf parses it, so
    its raw_data must still match its shape, whatever the walk made of the odd field."""
    raw = np.zeros(256, np.float32).tobytes()
    odd = _tensor_bytes([("dims", 255), ("data_type", 1), ("name", "odd"), ("raw", raw),
                         ("data_location", location)])
    path = _model_with_tensors(tmp_path / "loc.onnx", [_ok("c0"), odd, _ok("c1")], output=1)
    parsed = onnx.load(str(path), load_external_data=False).graph.initializer[1]
    assert parsed.data_location == onnx.TensorProto.DEFAULT and parsed.raw_data == raw
    with pytest.raises(TensorShapeError) as ei:
        ortmem.load(path)
    assert ei.value.tensor == "odd"


@pytest.mark.parametrize("doc", [0, 5000])  # a short tensor message, and one the walk reads field by field
def test_external_then_an_unknown_data_location_is_still_external_and_checked(tmp_path, doc):
    """[EXTERNAL, 7]: protobuf keeps EXTERNAL (7 goes aside), so the reference must be checked."""
    t = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[256], doc_string="d" * doc)
    for k, v in (("location", "missing.bin"), ("length", "1024")):
        e = t.external_data.add()
        e.key, e.value = k, v
    t.data_location = onnx.TensorProto.EXTERNAL
    odd = t.SerializeToString() + _tensor_bytes([("data_location", 7)])
    path = _model_with_tensors(tmp_path / "ext.onnx", [_ok("c0"), odd], output=1)
    assert onnx.load(str(path), load_external_data=False).graph.initializer[1].data_location == t.EXTERNAL
    assert _ort_refuses(path)
    with pytest.raises(ExternalDataError, match="missing.bin") as ei:
        ortmem.load(path)
    assert ei.value.tensor == "W"


def test_odd_but_valid_tensor_layouts_load_and_agree_with_ort(tmp_path, rng):
    """Field orders protobuf accepts but onnx never writes: every one loads, with ORT's output."""
    values = rng.standard_normal(256).astype(np.float32)
    raw = values.tobytes()
    layouts = [
        [("name", "a"), ("dims", 256), ("data_type", 1), ("raw", raw)],
        [("raw", raw), ("name", "a"), ("packed_dims", [16, 16]), ("data_type", 1)],
        [("packed_dims", [256]), ("data_type", 7), ("data_type", 1), ("doc", "d"), ("name", "a"), ("raw", raw)],
        [("dims", 256), ("data_type", 1), ("name", "a"), ("raw", b"\0" * 16), ("raw", raw)],  # the last wins
    ]
    for i, fields in enumerate(layouts):
        tensors = [_tensor_bytes(fields)] + [_ok(f"c{j}") for j in range(5)]
        path = _model_with_tensors(tmp_path / f"odd{i}.onnx", tensors)
        with ortmem.load(path) as model:
            assert len(model.skeleton.graph.initializer) == 6
        (got,) = run_plain(path, {})
        np.testing.assert_array_equal(got.reshape(-1), values)


def test_screen_agrees_with_an_exact_check_on_random_tensors(tmp_path):
    """Property: ``ortmem.load`` raises TensorShapeError exactly when some inline tensor's raw_data does
    not match its dtype x shape as protobuf parses it (random field orders, repeats, packed dims)."""
    rng = np.random.default_rng(13)
    for case in range(150):
        tensors = []
        for j in range(int(rng.integers(1, 12))):
            dims = [int(d) for d in rng.integers(1, 9, size=int(rng.integers(0, 3)))]
            n = int(np.prod(dims)) * 4 + int(rng.choice([0, 0, 0, 0, -4, 4]))
            fields = [("dims", d) for d in dims] if rng.random() < 0.7 else [("packed_dims", dims)]
            fields += [("data_type", 1), ("name", f"t{j}"), ("raw", bytes(max(n, 0)))]
            if rng.random() < 0.2:
                fields.insert(int(rng.integers(0, len(fields) + 1)), ("doc", "x"))
            if rng.random() < 0.2:
                fields = [fields[k] for k in rng.permutation(len(fields))]
            tensors.append(_tensor_bytes(fields))
        path = _model_with_tensors(tmp_path / f"r{case}.onnx", tensors)
        parsed = onnx.load(str(path), load_external_data=False).graph.initializer
        bad = [t.name for t in parsed
               if t.raw_data and len(t.raw_data) != 4 * int(np.prod(list(t.dims), dtype=np.int64))]
        try:
            ortmem.load(path).close()
            raised = None
        except TensorShapeError as exc:
            raised = exc.tensor
        assert (raised is not None) == bool(bad), f"case {case}: exact check says {bad}, ortmem raised {raised}"
        assert raised is None or raised in bad


# ------------------------------------------------------------------------------ cost
def test_load_of_many_tiny_initializers_stays_near_onnx_load(tmp_path):
    """Issue 13's target is ``ortmem.load`` <= 2x ``onnx.load`` at 1e5 tiny initializers (wall clock,
    ``python -m bench.scaling --only load``). This is the regression ceiling: 2e4 initializers, CPU
    time of this process (steadier than wall on a shared machine), best of 5, the two alternating.
    Measured with onnxruntime 1.32.0 / onnx 1.23.2: 0.8-1.2x on a quiet machine, up to 1.65x with
    other jobs running; the loader before its speed work (a field object per field, a second pass
    over every parsed tensor): 3.2-4.2x. The ceiling, 3x, is far above the noise and below the old
    loader."""
    from bench import scaling  # the test times the loader exactly as the benchmark does

    n = 20000
    path = scaling.write_initializers_model(n, tmp_path)
    with ortmem.load(path) as model:  # the timed load is a real one: every tensor there, nothing mapped
        assert len(model.skeleton.graph.initializer) == n and len(model.store) == 0 and model.pristine
    timing = scaling.time_load_file(path, n, repeat=5)
    assert timing.cpu_ratio <= 3.0, (f"ortmem.load took {timing.ortmem_cpu:.3f} s CPU for {n} initializers, "
                                     f"onnx.load {timing.onnx_cpu:.3f} s: {timing.cpu_ratio:.2f}x")
