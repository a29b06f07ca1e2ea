"""The main graph as the partitioner sees it: planned nodes in execution order (constant chains set
aside), the values between them, each node's weights, activation and workspace bytes, and the module
each node belongs to.

Stage costs, cuts and sub-models all work on positions in this one execution order, so the graph is
analysed once, here (steps 1-3 of :mod:`ortmem.plan.partition`'s docstring).
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping, Sequence

import onnx
from onnx import AttributeProto, GraphProto, TensorProto

from ortmem.base.dtypes import byte_size
from ortmem.onnxfile.model import Model
from ortmem.onnxfile.walk import external_data_dict, iter_graphs, node_label, node_subgraphs
from ortmem.ort import graph_index as og
from ortmem.errors import PlanError
from ortmem.plan.partition.graph_modules import NodeCost, leaf_modules, position_links

#: Ops whose output differs from run to run: never treated as constants (never replicated).
_RANDOM_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def tensor_nbytes(t: TensorProto) -> int:
    if t.data_location == TensorProto.EXTERNAL:
        info = external_data_dict(t)
        if "length" in info:
            return int(info["length"])
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    try:
        return byte_size(t.data_type, tuple(int(d) for d in t.dims))
    except Exception:  # unknown dtype: what the proto holds
        return len(t.raw_data)


def _attribute_tensor_bytes(node: onnx.NodeProto) -> int:
    total = 0
    for attr in node.attribute:
        if attr.type == AttributeProto.TENSOR:
            total += tensor_nbytes(attr.t)
        elif attr.type == AttributeProto.TENSORS:
            total += sum(tensor_nbytes(t) for t in attr.tensors)
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            total += tensor_nbytes(attr.sparse_tensor.values) + tensor_nbytes(attr.sparse_tensor.indices)
    return total


def module_names(labels: Sequence[str], by: str) -> dict[str, str]:
    """Each node's leaf module (labels in execution order), every module contiguous.

    ``by="scope"`` uses name scopes (``/model/layers.3/...``); for exporters that write dotted names
    without slashes (``model.layers.3.mlp.gate_proj.matmul``) the dots before the last component are
    the scope. The planner reads modules in tree order as if that were execution order, so a scope
    whose nodes another scope's interrupt (a mask computed between the embedding and the first layer,
    both under ``model``) is split into runs, the later ones renamed ``model~2``...
    """
    if by not in ("scope", "node"):
        raise PlanError(f"by must be 'scope' or 'node', got {by!r}")
    if by == "scope" and not any("/" in label for label in labels):
        named = []
        for label in labels:
            scope, dot, op = label.rpartition(".")
            named.append(f"/{scope}/{op}" if dot and scope else label)
        leaves = leaf_modules(named, "scope")
    else:
        leaves = leaf_modules(labels, by)
    return dict(zip(labels, _contiguous(leaves)))


def _contiguous(leaves: Sequence[str]) -> list[str]:
    """Rename module runs so that every module (every prefix) covers one contiguous run of leaves."""
    alias: dict[str, str] = {"": ""}
    used: set[str] = {""}
    open_path: list[str] = []
    out = []
    for leaf in leaves:
        parts = leaf.split(".") if leaf else []
        prefixes = [".".join(parts[:i + 1]) for i in range(len(parts))]
        d = 0
        while d < len(open_path) and d < len(prefixes) and open_path[d] == prefixes[d]:
            d += 1
        del open_path[d:]
        for i in range(d, len(prefixes)):
            parent = alias[prefixes[i - 1]] if i else ""
            base = f"{parent}.{parts[i]}" if parent else parts[i]
            name, k = base, 1
            while name in used:
                k += 1
                name = f"{base}~{k}"
            used.add(name)
            alias[prefixes[i]] = name
            open_path.append(prefixes[i])
        out.append(alias[prefixes[-1]] if prefixes else leaf)
    return out


class PartitionGraph:
    """The main graph as the partitioner sees it: planned nodes in execution order (constant chains
    left out), the values between them, and every node's costs."""

    def __init__(self, model: Model):
        g = model.skeleton.graph
        self.model = model
        self.g = g
        self.labels_all = [node_label(n, i) for i, n in enumerate(g.node)]
        seen: set[str] = set()
        for label in self.labels_all:
            if label in seen:
                raise PlanError(f"two nodes are named {label!r}: stages and costs are matched by node name")
            seen.add(label)
        self.index_of = {label: i for i, label in enumerate(self.labels_all)}
        self.init = {t.name: t for t in g.initializer}
        self.sparse = {s.values.name: s for s in g.sparse_initializer}
        self.input_vi = {vi.name: vi for vi in g.input}
        self.inputs = [vi.name for vi in g.input if vi.name not in self.init and vi.name not in self.sparse]
        self.outputs = [o.name for o in g.output]
        self.output_vi = {o.name: o for o in g.output}
        self.value_info = {vi.name: vi for vi in g.value_info}
        self.index = og.index_graph(g)
        self.raw_inputs = [self.index.node_inputs(i) for i in range(len(g.node))]
        self.producer = self.index.producer
        self.const_nodes = self._constant_nodes()
        self._const_weights: dict[int, dict[str, int]] = {}

        planned = GraphProto()  # named by label: an unnamed node's "op#index" must survive the filtering
        for i, node in enumerate(g.node):
            if i not in self.const_nodes:
                copy = planned.node.add()
                copy.CopyFrom(node)
                copy.name = self.labels_all[i]
        planned.output.extend(g.output)
        self.planned_graph = planned
        # positions in execution order (the same order group_modules uses)
        sub_order = og.topological_order(planned)
        kept = [i for i in range(len(g.node)) if i not in self.const_nodes]
        self.order = [kept[j] for j in sub_order]
        self.labels = [self.labels_all[i] for i in self.order]
        self.pos = {i: p for p, i in enumerate(self.order)}
        n = len(self.order)
        self.inputs_pos, self.consumers_pos = position_links(self.order, self.raw_inputs, self.producer)
        outs = set(self.outputs)
        self.escapes = [any(o in outs for o in g.node[i].output) for i in self.order]
        self.weights = [self._node_weights(i) for i in self.order]
        # value -> positions of the planned nodes reading it
        self.readers: dict[str, list[int]] = {}
        for p, i in enumerate(self.order):
            for x in dict.fromkeys(self.raw_inputs[i]):
                self.readers.setdefault(x, []).append(p)
        self.act = [0] * n
        self.ws = [0] * n

    # constant chains ------------------------------------------------------------------------
    def _constant_nodes(self) -> set[int]:
        g = self.g
        const_vals = (set(self.init) | set(self.sparse)) - set(self.input_vi)  # overridable ones are inputs
        out: set[int] = set()
        for i in self.index.topological_order():
            node = g.node[i]
            if node.op_type in _RANDOM_OPS or node_subgraphs(node):
                continue
            if all(x in const_vals for x in self.raw_inputs[i]):
                out.add(i)
                const_vals.update(o for o in node.output if o)
        # a constant chain that is itself a graph output is planned like any node (it must run somewhere)
        outs = set(o.name for o in g.output)
        return {i for i in out if not any(o in outs for o in g.node[i].output)}

    def const_closure(self, values: Iterable[str]) -> list[int]:
        """Constant nodes (node indices, file order) that produce ``values``, transitively."""
        need: set[int] = set()
        stack = [v for v in values]
        while stack:
            v = stack.pop()
            i = self.producer.get(v)
            if i is None or i not in self.const_nodes or i in need:
                continue
            need.add(i)
            stack.extend(self.raw_inputs[i])
        return sorted(need)

    # weights ------------------------------------------------------------------------------
    def _value_weights(self, x: str, out: dict[str, int]) -> None:
        t = self.init.get(x)
        if t is not None:
            out[x] = tensor_nbytes(t)
            return
        s = self.sparse.get(x)
        if s is not None:
            out[x] = tensor_nbytes(s.values) + tensor_nbytes(s.indices)
            return
        c = self.producer.get(x)
        if c is not None and c in self.const_nodes:
            out.update(self._const_node_weights(c))

    def _const_node_weights(self, c: int) -> dict[str, int]:
        hit = self._const_weights.get(c)
        if hit is None:
            hit = {}
            for x in self.raw_inputs[c]:
                self._value_weights(x, hit)
            b = _attribute_tensor_bytes(self.g.node[c])
            if b:
                hit[f"{self.labels_all[c]}:attribute"] = b
            self._const_weights[c] = hit
        return hit

    def _node_weights(self, i: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for x in self.raw_inputs[i]:
            self._value_weights(x, out)
        node = self.g.node[i]
        label = self.labels_all[i]
        for attr_name, sg in node_subgraphs(node):
            for path, graph in iter_graphs(sg, f"{label}/{attr_name}"):
                for t in graph.initializer:
                    out[f"{path}:{t.name}"] = tensor_nbytes(t)
                for k, sub in enumerate(graph.node):
                    b = _attribute_tensor_bytes(sub)
                    if b:
                        out[f"{path}:{node_label(sub, k)}:attribute"] = b
        b = _attribute_tensor_bytes(node)
        if b:
            out[f"{label}:attribute"] = b
        return out

    # costs -----------------------------------------------------------------------------------
    def set_costs(self, act_bytes: Mapping[str, int], ws_bytes: Mapping[str, int]) -> list[NodeCost]:
        costs = []
        for p, label in enumerate(self.labels):
            self.act[p] = int(act_bytes.get(label, 0))
            self.ws[p] = int(ws_bytes.get(label, 0))
            costs.append(NodeCost(label, dict(self.weights[p]), self.act[p], self.ws[p]))
        return costs

    def unique_name(self, i: int) -> str:
        node = self.g.node[i]
        return og.unique_node_name(node.name, node.op_type, list(node.input), list(node.output))


def node_costs(G: PartitionGraph, model: Model, dims: Mapping[str, int], stats_csv: str | os.PathLike | None
                ) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Activation and workspace bytes per planned node label; notes on where they came from."""
    from ortmem.plan.estimate import estimate

    notes: list[str] = []
    est = estimate(model, dims=dict(dims))
    rows = {r.unique_name: r for r in est.nodes if r.graph == ""}
    act_b: dict[str, int] = {}
    ws_b: dict[str, int] = {}
    for i, label in zip(G.order, G.labels):
        r = rows.get(G.unique_name(i))
        if r is not None:
            act_b[label] = r.outputs_bytes
            ws_b[label] = r.workspace_bytes
    if est.unresolved_dims:
        notes.append(f"symbolic dims without a value (counted as 0 bytes): {', '.join(est.unresolved_dims)}; "
                     "give them with dims=")
    if stats_csv is not None:
        from ortmem.plan.estimate import read_csv

        measured = {r.name: r for r in read_csv(stats_csv)}
        hit = 0
        for i, label in zip(G.order, G.labels):
            r = measured.get(G.unique_name(i))
            if r is not None:
                act_b[label] = r.total_dynamic_sizes
                ws_b[label] = r.total_temp_allocations
                hit += 1
        notes.append(f"activations and workspace measured (stats CSV) for {hit} of {len(G.order)} nodes; "
                     "estimated for the rest (nodes ORT fused or renamed have no row)")
    return act_b, ws_b, notes
