"""ortmem.onnxfile.protowire: the walk over a serialized ModelProto, checked against what onnx (protobuf) parses
from the same bytes.

The bytes are real: models written by ``onnx.helper`` and serialized by protobuf, with large and small
embedded tensors in the graph, in an ``If`` branch, in a ``Constant`` attribute and in a sparse
initializer, beside tensors whose data is already external. For every large embedded tensor the walk
must report the span protobuf reads its ``raw_data`` from, and its skeleton must be exactly the model
onnx parses with those tensors turned into external references to the same spans. Truncated and
corrupted files: the walk raises ``CorruptModelError`` or agrees with onnx, never anything else.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

import ortmem
from ortmem.errors import CorruptModelError, OrtmemError
from ortmem.onnxfile.scan import read_facts
from ortmem.onnxfile.protowire import (DATA_LOCATION_EXTERNAL, GRAPH_INITIALIZER, MODEL_GRAPH, LEN, TENSOR_RAW_DATA, FileBytes, WireReader, encode_len_field, encode_varint, externalize_embedded)
from tests.support.builders import make_model
from tests.support.reference import run_plain

INLINE_MAX = 1023  # the walk's default: raw_data up to this many bytes stays in the skeleton
F = TensorProto.FLOAT


def _weights(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def _external(t: onnx.TensorProto, offset: int) -> onnx.TensorProto:
    """``t`` as a model saved with external data holds it: no raw_data, an EXTERNAL reference."""
    set_external_data(t, "weights.bin", offset=offset, length=len(t.raw_data))
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    return t


def mixed_model(seed: int = 0) -> onnx.ModelProto:
    """Large and small embedded tensors in every place the walk descends into, and external ones."""
    rng = np.random.default_rng(seed)
    then = helper.make_graph([helper.make_node("MatMul", ["x", "W_then"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F, [1, 32])], [_weights(rng, "W_then", 32, 32)])
    other = helper.make_graph([helper.make_node("Add", ["x", "b_else"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", F, [1, 32])], [_weights(rng, "b_else", 32)])
    dense = np.zeros((64, 64), np.float32)
    idx = np.sort(rng.choice(64 * 64, size=400, replace=False))
    dense.flat[idx] = rng.standard_normal(400).astype(np.float32)
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(dense.flat[idx], "S"),
                                       numpy_helper.from_array(idx.astype(np.int64), "S_idx"), [64, 64])
    nodes = [
        helper.make_node("If", ["c"], ["branch"], then_branch=then, else_branch=other),
        helper.make_node("Constant", [], ["C"], value=_weights(rng, "C", 32, 64)),
        helper.make_node("MatMul", ["branch", "C"], ["h"]),
        helper.make_node("MatMul", ["h", "S"], ["h2"]),
        helper.make_node("MatMul", ["h2", "W_ext"], ["h3"]),
        helper.make_node("Add", ["h3", "bias"], ["h4"]),
        helper.make_node("MatMul", ["h4", "W_big"], ["y"]),
    ]
    inits = [_external(_weights(rng, "W_ext", 64, 64), offset=0), _weights(rng, "bias", 64),
             _weights(rng, "W_big", 64, 48), _external(_weights(rng, "b_ext", 300), offset=16384)]
    graph = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info("x", F, [1, 32]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F, [1, 48])], inits, sparse_initializer=[sparse])
    return make_model(graph)


def tensors(model: onnx.ModelProto):
    """Every TensorProto of the model as protobuf parsed it: graphs, subgraphs, attributes, sparse."""
    def of_graph(g: onnx.GraphProto):
        yield from g.initializer
        for s in g.sparse_initializer:
            yield from (s.values, s.indices)
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                if a.HasField("g"):
                    yield from of_graph(a.g)
                for sub in a.graphs:
                    yield from of_graph(sub)
    yield from of_graph(model.graph)


def expected_skeleton(data: bytes, inline_max: int = INLINE_MAX,
                      location: str = "model.onnx") -> tuple[onnx.ModelProto, dict[str, bytes]]:
    """What onnx parses from ``data``, with every embedded raw_data above ``inline_max`` bytes turned into
    an external reference to its own bytes in ``data``; and those tensors' bytes by name."""
    model = onnx.ModelProto.FromString(data)
    moved = {}
    for t in tensors(model):
        if t.data_location != TensorProto.EXTERNAL and len(t.raw_data) > inline_max:
            raw = t.raw_data
            offset = data.find(raw)  # protobuf's raw_data is a verbatim slice of the file
            assert offset >= 0 and data.find(raw, offset + 1) < 0, t.name
            moved[t.name] = raw
            _external(t, offset)
            t.external_data[0].value = location
    return model, moved


def test_varints_are_protobufs_own():
    """A dims value serialized by protobuf is the key (field 1, varint) followed by encode_varint's bytes,
    and the reader decodes it back, up to the 10-byte maximum."""
    for v in (0, 1, 127, 128, 300, 2**31, 2**35 + 7, 2**63 - 1):
        wire = TensorProto(dims=[v]).SerializeToString()
        assert wire == b"\x08" + encode_varint(v), v
        assert WireReader(wire, "t").varint(1, len(wire)) == (v, len(wire))
    negative = TensorProto(dims=[-1]).SerializeToString()  # int64 -1: ten bytes on the wire
    assert negative == b"\x08" + encode_varint(2**64 - 1) and len(negative) == 11


def test_top_level_fields_are_those_protobuf_wrote():
    """The reader's fields of a serialized model: protobuf's own field numbers, in order, one per
    repeated element, ending exactly at the end of the bytes."""
    model = mixed_model()
    data = model.SerializeToString()
    fields = list(WireReader(data, "m").fields(0, len(data)))
    single = (str, bytes, int, float)
    listed = [fd.number for fd, value in model.ListFields()
              for _ in ([value] if isinstance(value, single) or hasattr(value, "ListFields") else value)]
    assert [f.number for f in fields] == listed
    assert fields[-1].end == len(data)
    graph = next(f for f in fields if f.number == 7)
    assert onnx.GraphProto.FromString(data[graph.payload_start:graph.end]) == model.graph


@pytest.mark.parametrize("inline_max", [INLINE_MAX, 0, 255])
def test_skeleton_is_the_parsed_model_with_large_tensors_made_external(inline_max):
    data = mixed_model().SerializeToString()
    result = externalize_embedded(data, file="model.onnx", location="model.onnx", inline_max_bytes=inline_max)
    model, moved = expected_skeleton(data, inline_max)
    assert moved and result.changed
    skeleton = onnx.ModelProto.FromString(result.skeleton)
    assert skeleton == model
    spans = {s.name: s for s in result.spans}
    assert set(spans) == set(moved)
    parsed = {t.name: t for t in tensors(onnx.ModelProto.FromString(data))}
    for name, span in spans.items():
        assert data[span.offset:span.offset + span.length] == moved[name], name
        assert span.data_type == parsed[name].data_type and span.dims == list(parsed[name].dims), name
    assert result.screen.external == 2  # W_ext and b_ext: left as they are, for the loader to check


def test_the_sizes_that_move_are_exactly_those_above_the_limit():
    data = mixed_model().SerializeToString()
    sizes = {t.name: len(t.raw_data) for t in tensors(onnx.ModelProto.FromString(data)) if t.raw_data}
    result = externalize_embedded(data, file="model.onnx", location="model.onnx")
    assert {s.name for s in result.spans} == {n for n, size in sizes.items() if size > INLINE_MAX}
    assert {n for n, size in sizes.items() if size <= INLINE_MAX} >= {"b_else", "bias"}  # these stay inline


def test_a_model_with_nothing_large_embedded_is_its_own_skeleton():
    rng = np.random.default_rng(1)
    graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "small",
                              [helper.make_tensor_value_info("x", F, [8])], [helper.make_tensor_value_info("y", F, [8])],
                              [_weights(rng, "b", 8), _external(_weights(rng, "e", 512), offset=0)])
    data = make_model(graph).SerializeToString()
    result = externalize_embedded(data, file="m", location="m")
    assert not result.changed and result.skeleton is None and result.spans == []
    assert result.screen.external == 1


def test_file_window_walk_equals_the_in_memory_walk(tmp_path: Path):
    """The loader walks a file through FileBytes' small windows: same skeleton, spans and screen."""
    data = mixed_model(seed=3).SerializeToString()
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        windowed = externalize_embedded(FileBytes(fd, len(data), window=4096), file=str(path), location="model.onnx")
    finally:
        os.close(fd)
    in_memory = externalize_embedded(data, file=str(path), location="model.onnx")
    assert windowed.skeleton == in_memory.skeleton
    assert windowed.spans == in_memory.spans
    assert (windowed.screen.external, windowed.screen.unconfirmed) == (in_memory.screen.external,
                                                                        in_memory.screen.unconfirmed)


def test_repeated_raw_data_keeps_the_last_as_protobuf_does():
    """Protobuf keeps the last occurrence of a repeated scalar field: so does the walk's span, and the
    skeleton keeps none of them."""
    big = _weights(np.random.default_rng(2), "W", 40, 40)
    earlier = TensorProto(raw_data=b"\x00" * len(big.raw_data)).SerializeToString()
    tensor_bytes = earlier + big.SerializeToString()  # two raw_data fields: protobuf merges, last wins
    graph = helper.make_graph([], "g", [], [helper.make_tensor_value_info("W", F, [40, 40])])
    model = make_model(graph)
    head = model.SerializeToString()
    graph_bytes = model.graph.SerializeToString() + b"\x2a" + encode_varint(len(tensor_bytes)) + tensor_bytes
    data = head.replace(b"\x3a" + encode_varint(len(model.graph.SerializeToString())) + model.graph.SerializeToString(),
                        b"\x3a" + encode_varint(len(graph_bytes)) + graph_bytes)
    parsed = onnx.ModelProto.FromString(data)
    assert parsed.graph.initializer[0].raw_data == big.raw_data
    result = externalize_embedded(data, file="m", location="m")
    (span,) = result.spans
    assert data[span.offset:span.offset + span.length] == big.raw_data
    (t,) = onnx.ModelProto.FromString(result.skeleton).graph.initializer
    assert not t.HasField("raw_data") and t.data_location == DATA_LOCATION_EXTERNAL


def _walk_or_refusal(data: bytes):
    try:
        return externalize_embedded(data, file="bad.onnx", location="bad.onnx")
    except CorruptModelError as e:
        assert "bad.onnx" in str(e)  # the error names the file
        return None


def _onnx_or_refusal(data: bytes):
    try:
        return onnx.ModelProto.FromString(data)
    except DecodeError:
        return None


def test_truncated_files_are_refused_or_agree_with_onnx():
    """Cuts of a serialized model (every 97th byte, and after each whole top-level field, which leaves a
    valid shorter model): where protobuf refuses the bytes inside what the walk reads (a
    cut inside a weight's raw_data, the common truncated download), the walk refuses too; where both
    accept, they agree on every large tensor. No cut raises anything but CorruptModelError."""
    data = mixed_model(seed=4).SerializeToString()
    big = onnx.ModelProto.FromString(data).graph.initializer[2]  # W_big, embedded
    start = data.find(big.raw_data)
    whole_fields = {f.end for f in WireReader(data, "m").fields(0, len(data))}  # a cut there is a valid model
    cuts = sorted(set(range(1, len(data), 97)) | whole_fields | {start + 1, start + len(big.raw_data) // 2,
                                                                 len(data) - 1})
    refused_inside_raw = agreed = 0
    for cut in cuts:
        walked, parsed = _walk_or_refusal(data[:cut]), _onnx_or_refusal(data[:cut])
        if start < cut < start + len(big.raw_data):
            assert walked is None and parsed is None, cut
            refused_inside_raw += 1
        if walked is not None and parsed is not None:
            expected, moved = expected_skeleton(data[:cut], location="bad.onnx")
            assert {s.name for s in walked.spans} == set(moved), cut
            assert (onnx.ModelProto.FromString(walked.skeleton) if walked.changed else parsed) == expected, cut
            agreed += 1
    assert refused_inside_raw >= 3 and agreed >= len(whole_fields) - 1


@pytest.mark.parametrize("seed", range(4))
def test_corrupted_bytes_are_refused_or_agree_with_onnx(seed):
    """Random byte flips: the walk raises CorruptModelError or returns; when onnx parses the same
    bytes too, the spans the walk found hold exactly the raw_data protobuf parsed for those tensors."""
    data = bytearray(mixed_model(seed=5).SerializeToString())
    rng = np.random.default_rng(seed)
    for _ in range(60):
        bad = bytearray(data)
        for pos in rng.integers(0, len(bad), size=3):
            bad[pos] ^= int(rng.integers(1, 256))
        walked, parsed = _walk_or_refusal(bytes(bad)), _onnx_or_refusal(bytes(bad))
        if walked is None or parsed is None:
            continue
        by_name = {}
        for t in tensors(parsed):
            by_name.setdefault(t.name, []).append(t.raw_data)
        for span in walked.spans:
            assert bytes(bad[span.offset:span.offset + span.length]) in by_name.get(span.name, []), span.name


def _main_graph_tensor_names(model: onnx.ModelProto) -> set[str]:
    """The main graph's initializers and its nodes' attribute tensors (not subgraphs, not sparse)."""
    names = {t.name for t in model.graph.initializer}
    for n in model.graph.node:
        for a in n.attribute:
            if a.HasField("t"):
                names.add(a.t.name)
            names.update(t.name for t in a.tensors)
    return names


def test_the_walk_counts_the_weights_it_moves_outside_the_main_graph():
    model = mixed_model()
    data = model.SerializeToString()
    _, moved = expected_skeleton(data)
    outside = set(moved) - _main_graph_tensor_names(model)
    assert outside, "the model must have a weight outside the main graph worth moving"
    result = externalize_embedded(data, file="m", location="m", inline_max_bytes=INLINE_MAX)
    assert not result.stopped
    assert result.outside_main == len(outside)
    assert sorted(s.name for s in result.spans) == sorted(moved)


def test_the_walk_stops_at_the_first_weight_outside_the_main_graph():
    model = mixed_model()
    data = model.SerializeToString()
    full = externalize_embedded(data, file="m", location="m", inline_max_bytes=INLINE_MAX)
    stopped = externalize_embedded(data, file="m", location="m", inline_max_bytes=INLINE_MAX, stop_outside_main=True)
    assert stopped.stopped and stopped.skeleton is None and stopped.outside_main == 1
    names = [s.name for s in full.spans]
    main = _main_graph_tensor_names(model)
    first_outside = next(i for i, name in enumerate(names) if name not in main)
    assert [s.name for s in stopped.spans] == names[:first_outside]  # what came before it, in file order


def test_a_walk_asked_to_stop_outside_the_main_graph_that_finds_nothing_there_is_the_whole_walk():
    model = mixed_model()
    model.graph.node.remove(model.graph.node[0])  # the If, whose branches hold the subgraph weights
    model.graph.ClearField("sparse_initializer")
    data = model.SerializeToString()
    full = externalize_embedded(data, file="m", location="m", inline_max_bytes=INLINE_MAX)
    asked = externalize_embedded(data, file="m", location="m", inline_max_bytes=INLINE_MAX, stop_outside_main=True)
    assert full.outside_main == 0 and not asked.stopped
    assert asked.skeleton == full.skeleton and asked.spans == full.spans


def test_fields_skipped_inline_leave_the_walk_what_protobuf_parses():
    """Varints, fixed32/64 values and unwanted length-delimited fields with two-byte keys are skipped
    without the checked path (``_skipped``): attributes of every scalar kind, a ``ref_attr_name``
    (field 21), a huge ``i`` (a ten-byte varint) and a negative one; the skeleton still parses to
    exactly what protobuf makes of the bytes, and the big weight behind them still moves."""
    model = mixed_model()
    node = model.graph.node[-1]
    node.attribute.extend([helper.make_attribute("alpha", 0.5), helper.make_attribute("big", 2**62),
                           helper.make_attribute("neg", -3), helper.make_attribute("ints", [1, 2**40, -7]),
                           helper.make_attribute("name", "x" * 300)])
    ref = onnx.AttributeProto(name="r", type=onnx.AttributeProto.INT, ref_attr_name="outer_" + "y" * 200)
    node.attribute.append(ref)
    data = model.SerializeToString()
    result = externalize_embedded(data, file="m", location="m", inline_max_bytes=INLINE_MAX)
    expected, moved = expected_skeleton(data, INLINE_MAX, location="m")
    assert onnx.ModelProto.FromString(result.skeleton) == expected
    assert sorted(s.name for s in result.spans) == sorted(moved)


# ------------------------------------------- a field longer than its message, inside the file
# A length is checked against the end of the message that holds the field, not of the file: protobuf
# (and so ORT) refuses such bytes, and a walk that only checked the file would read the bytes after the
# message as the field's. Built field by field: a graph ``Add(x, W)`` with W (2048 floats, above the
# inline limit) as an embedded initializer, and the model's opset after its graph.

_N = 2048


def _pieces() -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """W's header fields, W's bytes, the rest of the graph, the model's head, its opset field."""
    head = TensorProto(dims=[_N], data_type=F, name="W").SerializeToString()
    raw = np.arange(_N, dtype=np.float32).tobytes()
    rest = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g",
                             [helper.make_tensor_value_info("x", F, [_N])],
                             [helper.make_tensor_value_info("y", F, [_N])]).SerializeToString()
    opset_import = 8  # ModelProto's field: in a TensorProto read past its end, field 8 is the name
    opset = encode_len_field(opset_import, onnx.OperatorSetIdProto(domain="", version=21).SerializeToString())
    return head, raw, rest, onnx.ModelProto(ir_version=10).SerializeToString(), opset


def _well_formed() -> bytes:
    head, raw, rest, model_head, opset = _pieces()
    tensor = head + encode_len_field(TENSOR_RAW_DATA, raw)
    return model_head + encode_len_field(MODEL_GRAPH, encode_len_field(GRAPH_INITIALIZER, tensor) + rest) + opset


def _raw_data_past_its_tensor() -> bytes:
    """W's raw_data claims its 8192 bytes, but W's message ends 4 bytes earlier (the graph's next
    field follows): the right size for its dims if read past the tensor."""
    head, raw, rest, model_head, opset = _pieces()
    tensor = head + bytes([TENSOR_RAW_DATA << 3 | LEN]) + encode_varint(len(raw)) + raw[:-4]
    return model_head + encode_len_field(MODEL_GRAPH, encode_len_field(GRAPH_INITIALIZER, tensor) + rest) + opset


def _initializer_past_its_graph() -> bytes:
    """W, the graph's last field, claims the model's opset field after the graph as part of itself."""
    head, raw, rest, model_head, opset = _pieces()
    tensor = head + encode_len_field(TENSOR_RAW_DATA, raw)
    field = bytes([GRAPH_INITIALIZER << 3 | LEN]) + encode_varint(len(tensor) + len(opset)) + tensor
    return model_head + encode_len_field(MODEL_GRAPH, rest + field) + opset


@pytest.mark.parametrize("crafted", [_raw_data_past_its_tensor, _initializer_past_its_graph],
                         ids=["raw-data-past-its-tensor", "initializer-past-its-graph"])
def test_a_field_longer_than_its_message_but_inside_the_file_is_refused_naming_the_file(tmp_path: Path, crafted):
    x = {"x": np.ones(_N, np.float32)}
    good = tmp_path / "good.onnx"
    good.write_bytes(_well_formed())  # the same pieces with every length right: a model ORT runs
    expected = run_plain(good, x)
    np.testing.assert_array_equal(expected[0], np.arange(_N, dtype=np.float32) + 1)
    with ortmem.load(good) as model:
        assert model.embedded_spans == 1

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(crafted())
    with pytest.raises(Exception, match="(?i)protobuf"):
        ort.InferenceSession(str(bad), providers=["CPUExecutionProvider"])  # plain ORT refuses it
    for refuse in (lambda: ortmem.load(bad), lambda: read_facts(bad),
                   lambda: ortmem.InferenceSession(bad, providers=["CPUExecutionProvider"], cache=False)):
        with pytest.raises(CorruptModelError, match="runs past the end of its message") as refused:
            refuse()
        assert isinstance(refused.value, OrtmemError) and str(bad) in str(refused.value)
