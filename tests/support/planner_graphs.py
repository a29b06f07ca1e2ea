"""Small fp32 graphs for the planners (liveness, estimate, recompute) whose answers are worked out by
hand: every tensor a whole number of ORT's 256-byte arena granules, names that say what each node is."""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.support.builders import make_model

F = TensorProto.FLOAT
N = 1024  # floats: 4 KiB, a whole number of 256-byte arena granules


def graph_model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
                outputs: Sequence[onnx.ValueInfoProto], inits: Iterable[onnx.TensorProto] = (),
                opset: int = 17) -> onnx.ModelProto:
    """The graph ``g`` as a model ORT reads (IR 10: onnx's newer default IR is refused by older ORT)."""
    return make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                      opset_imports=[helper.make_opsetid("", opset)])


def i64(name: str, values) -> onnx.TensorProto:
    """An int64 initializer (repeats, starts, ends, shapes)."""
    return numpy_helper.from_array(np.array(values, np.int64), name)


def long_cast() -> onnx.ModelProto:
    """One long-lived Cast: c = Cast(x) to double (8 KiB) is read by Sin right away and by the last
    Add; in between a Tile makes a 64 KiB tensor, the peak."""
    return graph_model([helper.make_node("Cast", ["x"], ["c"], name="cast", to=TensorProto.DOUBLE),
                        helper.make_node("Sin", ["c"], ["p"], name="sin"),
                        helper.make_node("Tile", ["p", "eight"], ["big"], name="tile"),
                        helper.make_node("Slice", ["big", "zero", "n"], ["q"], name="slice"),
                        helper.make_node("Add", ["q", "c"], ["y"], name="add")],
                       [helper.make_tensor_value_info("x", F, [N])],
                       [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [N])],
                       [i64("eight", [8]), i64("zero", [0]), i64("n", [N])])


def two_branches() -> onnx.ModelProto:
    """y = Add(Slice(P), Slice(Q)); P = Tile(x, 4) listed last in the file, so DEFAULT (highest index
    first) builds P before Q's 32 KiB Tile; PRIORITY_BASED follows the file (Q's chain first)."""
    nodes = [helper.make_node("Tile", ["x", "eight"], ["q1"], name="q1"),
             helper.make_node("Slice", ["q1", "zero", "n"], ["q2"], name="q2"),
             helper.make_node("Tile", ["x", "four"], ["p1"], name="p1"),
             helper.make_node("Slice", ["p1", "zero", "n"], ["p2"], name="p2"),
             helper.make_node("Add", ["p2", "q2"], ["y"], name="y")]
    return graph_model(nodes, [helper.make_tensor_value_info("x", F, [N])], [helper.make_tensor_value_info("y", F, [N])],
                       [i64("eight", [8]), i64("four", [4]), i64("zero", [0]), i64("n", [N])])
