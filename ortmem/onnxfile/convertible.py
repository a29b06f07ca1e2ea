"""Whether a model file holds a DequantizeLinear that ortmem could convert, read from the file's
structure alone (no onnx): the question that decides whether a start loads and plans the model or
hands it to ORT from its bytes.

Why a module of its own: a byte search finds the op's name in every QDQ model, and sent each of them
the loader's and the passes' way (onnx imported, the model parsed and planned: 1.8-1.9x of ORT's
whole-process wall on every start of a 3.6 MB int8 QDQ model, docs/benchmarks.md), though most int8 QDQ models
hold nothing ortmem converts: ORT's quantizer quantizes activations too, so every MatMul whose
weight comes from a DequantizeLinear reads its other input from one as well, and ORT's rule (so
ortmem's, :mod:`ortmem.passes.rules`) takes a MatMul or Gemm only with its weight's DQ alone.

What is checked, graph by graph as the rules see them (the main graph and every subgraph; model
functions and training graphs are not converted), is what every conversion needs:

- a DequantizeLinear with an output and at least two inputs, whose output a MatMul or Gemm of the
  onnx domain reads as input B, while its input A does not come from a DequantizeLinear of the same
  graph, and whose weight is not an initializer of a type the rule refuses
  (:data:`MATMUL_WEIGHT_TYPES`);
- or whose output a Gather reads as its table, or a Cast reads (the fp16 exporters' ``DQ -> Cast ->
  Gather``), with a weight not of a type GatherBlockQuantized refuses (:data:`GATHER_WEIGHT_TYPES`).

True is no promise (the rules decide exactly, after loading); False is certain, so the model goes
the way of a model without the op. A structure the reader cannot follow answers True.
"""
from __future__ import annotations

from typing import Optional

from ortmem.errors import CorruptModelError
from ortmem.onnxfile import DEQUANTIZE
from ortmem.onnxfile.protowire import (ATTR_G, ATTR_GRAPHS, GRAPH_INITIALIZER, GRAPH_NODE, GRAPH_SPARSE_INITIALIZER, LEN,
                                       MODEL_GRAPH, NODE_ATTRIBUTE, NODE_DOMAIN, NODE_INPUT, NODE_OP_TYPE, NODE_OUTPUT,
                                       SPARSE_VALUES, TENSOR_DATA_TYPE, TENSOR_NAME, VARINT, WireReader)

#: TensorProto data types a DequantizeLinear weight of a MatMul may have for ORT's rule (int2, uint2,
#: int4, uint4, int8, uint8: ``qdq_selectors.cc`` IsNBitsIntType, :mod:`ortmem.passes.rules.dq_matmul_checks`).
MATMUL_WEIGHT_TYPES = frozenset({26, 25, 22, 21, 3, 2})
#: ... and of a Gather's table for GatherBlockQuantized (uint2 as uint8, int4, uint4, uint8:
#: :func:`ortmem.passes.rules.dq_gather_match.data_type`).
GATHER_WEIGHT_TYPES = frozenset({25, 22, 21, 2})
_ONNX_DOMAINS = (b"", b"ai.onnx")


def may_convert(buf, file: str) -> bool:
    """Whether the serialized ModelProto in ``buf`` (bytes, or :class:`~ortmem.onnxfile.protowire.FileBytes`)
    may hold a DequantizeLinear ortmem converts (see the module docstring). ``file`` names the model in
    errors; a malformed structure answers True (the loader names its fault)."""
    reader = WireReader(buf, file)
    try:
        graphs = [(f.payload_start, f.end) for f in reader.fields(0, len(buf))
                  if f.number == MODEL_GRAPH and f.wire_type == LEN]
        if len(graphs) > 1:  # protobuf merges them into one graph: not followed here
            return True
        return any(_graph_may_convert(reader, start, end, ()) for start, end in graphs)
    except (CorruptModelError, RecursionError):
        return True


class _Initializers:
    """A graph's initializer types by name (None: a sparse one, whose type is not read here), read from
    the wire only when a DequantizeLinear's weight is looked up (most graphs have none to look up)."""

    def __init__(self, reader: WireReader):
        self.reader = reader
        self.fields: list[tuple[int, int, int]] = []  # (field number, start, end), in file order
        self._types: Optional[dict[bytes, Optional[int]]] = None

    def types(self) -> dict[bytes, Optional[int]]:
        if self._types is None:
            self._types = {}
            for number, start, end in self.fields:  # a later one of the same name wins, as in the graph
                if number == GRAPH_INITIALIZER:
                    name, data_type = _tensor_name_and_type(self.reader, start, end)
                    self._types[name] = data_type
                else:
                    self._types[_sparse_name(self.reader, start, end)] = None
        return self._types


#: The initializers of a graph and of the graphs around it, nearest first.
Scope = tuple[_Initializers, ...]


def _graph_may_convert(reader: WireReader, start: int, end: int, outer: Scope) -> bool:
    """One graph, then its subgraphs (each sees this graph's initializers, and those around it)."""
    nodes: list[tuple[bytes, bytes, list[bytes], list[bytes]]] = []
    subgraphs: list[tuple[int, int]] = []
    initializers = _Initializers(reader)
    for f in reader.fields(start, end):
        if f.wire_type != LEN:
            continue
        if f.number == GRAPH_NODE:
            nodes.append(_node(reader, f.payload_start, f.end, subgraphs))
        elif f.number in (GRAPH_INITIALIZER, GRAPH_SPARSE_INITIALIZER):
            initializers.fields.append((f.number, f.payload_start, f.end))
    scope = (initializers, *outer)
    dq_weights: dict[bytes, list[bytes]] = {}
    for op, _, inputs, outputs in nodes:
        if op == DEQUANTIZE and outputs and outputs[0] and len(inputs) >= 2:
            dq_weights.setdefault(outputs[0], []).append(inputs[0])
    if dq_weights and _consumer_converts(nodes, dq_weights, scope):
        return True
    return any(_graph_may_convert(reader, s, e, scope) for s, e in subgraphs)


def _consumer_converts(nodes: list[tuple[bytes, bytes, list[bytes], list[bytes]]],
                       dq_weights: dict[bytes, list[bytes]], scope: Scope) -> bool:
    """Whether some node of the graph reads a DequantizeLinear's output the way a rule converts. A
    value counts as a DQ's only where no other node makes it too (a malformed graph's duplicate
    name may be either, as the rules see it)."""
    by_others = {o for op, _, _, outputs in nodes if op != DEQUANTIZE for o in outputs}
    from_dq = {o for op, _, _, outputs in nodes if op == DEQUANTIZE for o in outputs} - by_others
    for op, domain, inputs, _ in nodes:
        if op in (b"MatMul", b"Gemm") and domain in _ONNX_DOMAINS and len(inputs) >= 2:
            if inputs[0] not in from_dq and _any_allowed(dq_weights.get(inputs[1]), scope, MATMUL_WEIGHT_TYPES):
                return True
        elif op in (b"Gather", b"Cast") and inputs:
            if _any_allowed(dq_weights.get(inputs[0]), scope, GATHER_WEIGHT_TYPES):
                return True
    return False


def _any_allowed(weights: Optional[list[bytes]], scope: Scope, allowed: frozenset[int]) -> bool:
    """Whether one of the DQ weights read there (None: no DQ makes the value) may have a type in ``allowed``."""
    return weights is not None and any(_type_allowed(w, scope, allowed) for w in weights)


def _type_allowed(name: bytes, scope: Scope, allowed: frozenset[int]) -> bool:
    """False only for an initializer (the nearest of that name) of a known type outside ``allowed``."""
    for initializers in scope:
        types = initializers.types()
        if name in types:
            data_type = types[name]
            return data_type is None or data_type in allowed
    return True


def _node(reader: WireReader, start: int, end: int,
          subgraphs: list[tuple[int, int]]) -> tuple[bytes, bytes, list[bytes], list[bytes]]:
    """(op_type, domain, inputs, outputs) of a NodeProto; its attributes' graphs go to ``subgraphs``."""
    buf = reader.buf
    op = domain = b""
    inputs: list[bytes] = []
    outputs: list[bytes] = []
    for f in reader.fields(start, end):
        if f.wire_type != LEN:
            continue
        if f.number == NODE_INPUT:
            inputs.append(bytes(buf[f.payload_start:f.end]))
        elif f.number == NODE_OUTPUT:
            outputs.append(bytes(buf[f.payload_start:f.end]))
        elif f.number == NODE_OP_TYPE:
            op = bytes(buf[f.payload_start:f.end])
        elif f.number == NODE_DOMAIN:
            domain = bytes(buf[f.payload_start:f.end])
        elif f.number == NODE_ATTRIBUTE:
            subgraphs.extend((a.payload_start, a.end) for a in reader.fields(f.payload_start, f.end)
                             if a.number in (ATTR_G, ATTR_GRAPHS) and a.wire_type == LEN)
    return op, domain, inputs, outputs


def _tensor_name_and_type(reader: WireReader, start: int, end: int) -> tuple[bytes, Optional[int]]:
    """A TensorProto's name and data type (the last of each, as protobuf keeps; weights skipped)."""
    name, data_type = b"", None
    for f in reader.fields(start, end):
        if f.number == TENSOR_NAME and f.wire_type == LEN:
            name = bytes(reader.buf[f.payload_start:f.end])
        elif f.number == TENSOR_DATA_TYPE and f.wire_type == VARINT:
            data_type = f.value
    return name, data_type


def _sparse_name(reader: WireReader, start: int, end: int) -> bytes:
    """A SparseTensorProto's name (its values tensor's)."""
    for f in reader.fields(start, end):
        if f.number == SPARSE_VALUES and f.wire_type == LEN:
            return _tensor_name_and_type(reader, f.payload_start, f.end)[0]
    return b""
