"""One ONNX model per stage, and the tensors that cross from one stage to later ones.

A stage's model holds its nodes, the constant chains they read (copied, see
:mod:`ortmem.plan.partition.graph`), the initializers they need, and typed inputs and outputs for
every tensor that crosses a cut, so each stage loads as a model of its own in ORT.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import onnx
from onnx import GraphProto, ModelProto, helper
from ortmem.plan.estimate import shapes as shp
from ortmem.errors import PlanError
from ortmem.plan.partition.graph import PartitionGraph
from ortmem.plan.partition.partition_plan import Crossing
from ortmem.plan.partition.stages import CandidateStage
from ortmem.plan.partition.stage_weights import WeightsLayout, relocate_graph


def _value_type(name: str, G: PartitionGraph, shapes: shp.Shapes) -> onnx.ValueInfoProto:
    """A typed ValueInfo for a tensor crossing a cut: the graph's own declaration, else inferred
    (symbolic dims kept, so a stage accepts what the whole model accepts)."""
    for table in (G.output_vi, G.input_vi, G.value_info):
        vi = table.get(name)
        if vi is not None and vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            return vi
    t = shapes.types.get("", {}).get(name)
    if t is None or not t.elem_type:
        raise PlanError(f"the type of tensor {name!r}, which crosses a stage boundary, cannot be inferred; "
                        "declare it in the model's value_info")
    dims = None if t.dims is None else [d if isinstance(d, int) else (None if d == "?" else str(d)) for d in t.dims]
    return helper.make_tensor_value_info(name, t.elem_type, dims)


@dataclass
class StageGraph:
    proto: ModelProto
    inputs: list[str]
    outputs: list[str]
    nodes: list[str]
    replicated: list[str]


def build_stage_models(G: PartitionGraph, stages: Sequence[CandidateStage], shapes_sym: shp.Shapes, layout: WeightsLayout | None,
                  location: str) -> list[StageGraph]:
    """One ModelProto per stage (weights relocated into ``location`` when ``layout`` is given)."""
    g = G.g
    skeleton = G.model.skeleton
    base = G.model.path.parent.resolve()
    stage_of = {}
    for k, s in enumerate(stages):
        for p in range(s.lo, s.hi):
            stage_of[p] = k
    # later readers of each value, by stage
    read_by: dict[str, set[int]] = {}
    for x, ps in G.readers.items():
        read_by[x] = {stage_of[p] for p in ps}
    graph_outputs = set(G.outputs)
    out: list[StageGraph] = []
    for k, s in enumerate(stages):
        idx = [G.order[p] for p in range(s.lo, s.hi)]
        produced: set[str] = set()
        for i in idx:
            produced.update(o for o in g.node[i].output if o)
        needed: list[str] = []
        for i in idx:
            for x in G.raw_inputs[i]:
                if x not in produced and x not in needed:
                    needed.append(x)
        consts = G.const_closure(needed)
        const_out = {o for c in consts for o in g.node[c].output if o}
        for c in consts:
            for x in G.raw_inputs[c]:
                if x not in produced and x not in const_out and x not in needed:
                    needed.append(x)
        inits, sparse, inputs = [], [], []
        for x in needed:
            if x in const_out:
                continue
            if x in G.init:
                inits.append(x)
                if x in G.input_vi:
                    inputs.append(x)  # an overridable initializer stays overridable
            elif x in G.sparse:
                sparse.append(x)
            else:
                inputs.append(x)
        if k == 0:  # unused graph inputs: the first stage declares them, as the model does
            for x in G.inputs:
                if x not in G.readers and x not in inputs:
                    inputs.append(x)
        outputs = [o for o in G.outputs if o in produced]
        for i in idx:
            for o in g.node[i].output:
                if o and o not in graph_outputs and any(j > k for j in read_by.get(o, ())) and o not in outputs:
                    outputs.append(o)
        graph = GraphProto()
        graph.name = f"{g.name or 'graph'}_stage{k}"
        graph.node.extend(g.node[c] for c in consts)
        graph.node.extend(g.node[i] for i in idx)
        graph.initializer.extend(G.init[x] for x in inits)
        graph.sparse_initializer.extend(G.sparse[x] for x in sparse)
        graph.input.extend(_value_type(x, G, shapes_sym) for x in inputs)
        graph.output.extend(_value_type(o, G, shapes_sym) for o in outputs)
        inside = produced | const_out
        graph.value_info.extend(vi for name, vi in G.value_info.items()
                                if name in inside and name not in outputs)
        m = ModelProto()
        m.ir_version = skeleton.ir_version
        m.opset_import.extend(skeleton.opset_import)
        m.producer_name = skeleton.producer_name
        m.producer_version = skeleton.producer_version
        m.domain = skeleton.domain
        m.model_version = skeleton.model_version
        m.doc_string = skeleton.doc_string
        m.functions.extend(skeleton.functions)
        m.metadata_props.extend(skeleton.metadata_props)
        m.graph.CopyFrom(graph)
        e = m.metadata_props.add()
        e.key, e.value = "ortmem.partition.stage", str(k)
        if layout is not None:
            relocate_graph(m.graph, base, layout, location)
        out.append(StageGraph(m, inputs, outputs, [G.labels_all[i] for i in idx],
                               [G.labels_all[c] for c in consts]))
    return out


def find_crossings(G: PartitionGraph, stages: Sequence[CandidateStage], shapes_dims: shp.Shapes) -> list[Crossing]:
    stage_of = {}
    for k, s in enumerate(stages):
        for p in range(s.lo, s.hi):
            stage_of[p] = k
    out = []
    for p, i in enumerate(G.order):
        k = stage_of[p]
        for o in G.g.node[i].output:
            if not o:
                continue
            later = sorted({stage_of[q] for q in G.readers.get(o, ()) if stage_of[q] > k})
            if not later:
                continue
            t = shapes_dims.types.get("", {}).get(o)
            out.append(Crossing(o, t.nbytes() if t else None, t.elem_type if t else 0,
                                list(t.dims) if t and t.dims is not None else None, k, later))
    return out
