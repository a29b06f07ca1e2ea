"""The fusions ORT makes at level >= 2 that change the activation picture and are replayed: Gelu and
BiasGelu as one kernel (``ort_fusions``).

Part of :mod:`ortmem.plan.estimate`."""
from __future__ import annotations

from onnx import TensorProto

from ortmem.ort import graph_index as og


# ------------------------------------------------------------------------------------ fusions
def _scalar(g: og.OrtGraph, name: str) -> float | None:
    """The value of a one-element constant whose bytes are in the graph, else None."""
    hit = g.find_initializer(name) if name else None
    if hit is None or hit[1].data_location == TensorProto.EXTERNAL:
        return None
    try:
        from onnx import numpy_helper

        a = numpy_helper.to_array(hit[1])
        return float(a.reshape(-1)[0]) if a.size == 1 else None
    except Exception:  # noqa: BLE001 - not a readable number
        return None


def _only_consumer(g: og.OrtGraph, value: str, op: str) -> og.OrtNode | None:
    """The single node reading ``value`` when it is a default-domain ``op`` and ``value`` is no graph output."""
    users = g.consumers.get(value, [])
    if len(users) != 1 or value in g.outputs or g.implicit_users.get(value):
        return None
    n = g.nodes[users[0][0]]
    return n if n.op_type == op and n.domain in ("", "ai.onnx") else None


def _other_input(node: og.OrtNode, value: str) -> str | None:
    ins = [v for v in node.inputs if v]
    if len(ins) != 2 or value not in ins:
        return None
    return ins[1] if ins[0] == value else ins[0]


def _near(v: float | None, target: float, tol: float = 1e-3) -> bool:
    return v is not None and abs(v - target) <= tol * max(1.0, abs(target))


def ort_fusions(root: og.OrtGraph) -> dict[int, int]:
    """Element-wise chains ORT's level-2 optimizer replaces by one kernel on the CPU EP, as
    ``{id(inner node): id(last node)}`` for :func:`graph_activation`'s ``merged``.

    ``GeluFusion`` (``onnxruntime/core/optimizer/gelu_fusion.cc``): ``x -> Div(sqrt 2) | Mul(1/sqrt 2)
    -> Erf -> Add(1) -> Mul(x) -> Mul(0.5)``, or the 0.5 applied to ``x`` first
    (``Mul(x, 0.5) -> Mul(., Add)``), every inner value read once and no graph output; then
    ``BiasGeluFusion`` (``bias_gelu_fusion.cc``) takes in the ``Add`` of a 1-D constant bias that
    produces ``x`` when ``x`` is read by the Gelu alone. Measured on paraphrase-MiniLM-L3 (ORT 1.31.1,
    ``ortmem stats``): the FFN's ``Add -> Div -> Erf -> Add -> Mul -> Mul`` runs as one ``BiasGelu``,
    so the live peak is MatMul output + Gelu output, not three 4x-hidden tensors. Other fusions
    (attention, layer norm from primitives, QuickGelu, MatMul+Add) are not replayed."""
    merged: dict[int, int] = {}
    for g in og.walk(root):
        for div in g.nodes:
            if div.domain not in ("", "ai.onnx") or div.op_type not in ("Div", "Mul") or len(div.inputs) != 2:
                continue
            x, c = div.inputs
            if div.op_type == "Div" and not _near(_scalar(g, c), 2 ** 0.5):
                continue
            if div.op_type == "Mul":
                if not _near(_scalar(g, c), 0.5 ** 0.5):
                    x, c = c, x
                    if not _near(_scalar(g, c), 0.5 ** 0.5):
                        continue
            erf = _only_consumer(g, div.outputs[0], "Erf")
            add = erf and _only_consumer(g, erf.outputs[0], "Add")
            if add is None or not _near(_scalar(g, _other_input(add, erf.outputs[0]) or ""), 1.0):
                continue
            mul1 = _only_consumer(g, add.outputs[0], "Mul")
            if mul1 is None:
                continue
            other = _other_input(mul1, add.outputs[0])
            group: list[og.OrtNode] | None = None
            if other == x:  # x * (1 + erf) * 0.5
                mul2 = _only_consumer(g, mul1.outputs[0], "Mul")
                if mul2 is not None and _near(_scalar(g, _other_input(mul2, mul1.outputs[0]) or ""), 0.5):
                    group = [div, erf, add, mul1, mul2]
            elif other is not None and other in g.producer:  # (0.5 * x) * (1 + erf)
                half = g.nodes[g.producer[other]]
                if (half.op_type == "Mul" and half.domain in ("", "ai.onnx") and x in half.inputs
                        and _near(_scalar(g, _other_input(half, x) or ""), 0.5)
                        and _only_consumer(g, other, "Mul") is mul1):
                    group = [half, div, erf, add, mul1]
            if group is None:
                continue
            inner = {id(n) for n in group}
            users = {id(g.nodes[j]) for j, _ in g.consumers.get(x, [])}
            bias_add = g.nodes[g.producer[x]] if x in g.producer else None
            if (bias_add is not None and bias_add.op_type == "Add" and bias_add.domain in ("", "ai.onnx")
                    and users <= inner and x not in g.outputs and not g.implicit_users.get(x)
                    and any(len(hit[1].dims) == 1 for v in bias_add.inputs
                            if (hit := g.find_initializer(v)) is not None)):
                group.insert(0, bias_add)
            last = group[-1]
            for n in group[:-1]:
                merged[id(n)] = id(last)
    return merged


