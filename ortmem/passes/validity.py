"""Faults a rewrite could hide: found before conversion so ortmem never makes an invalid model valid.

Here, beside the rules, because it guards what they do: a fault inside a pattern a rule rewrites
would vanish with the nodes the rule rebuilds.

ORT refuses a model whose node repeats an attribute, whose graph defines a name twice, or whose node
reads a name nothing defines. Conversion rebuilds the nodes it rewrites (and drops the ones it
fuses), so such a fault inside a rewritten pattern would vanish and ORT would accept a model it
refuses as given (found by fuzzing: 69 of 6,276 mutated models). When any is present the model is
handed to ORT untouched, which then reports the fault itself.

One pass over every graph (subgraphs see the names of the graphs around them, as in ORT); no
recursion, so depth is bounded by protobuf's own nesting limit, not Python's stack.
"""
from __future__ import annotations

from typing import Optional

import onnx


def validity_fault(graph: onnx.GraphProto) -> Optional[str]:
    """The first fault found (a sentence naming the node or tensor), or None."""
    # (graph, names visible from the graphs around it)
    stack: list[tuple[onnx.GraphProto, tuple[set[str], ...]]] = [(graph, ())]
    while stack:
        g, outer = stack.pop()
        defined: set[str] = set()
        for vi in g.input:
            if vi.name in defined:
                return f"graph {g.name!r} lists input {vi.name!r} twice"
            defined.add(vi.name)
        defined.update(t.name for t in g.initializer)
        defined.update(t.values.name for t in g.sparse_initializer)
        for n in g.node:
            for o in n.output:
                if not o:
                    continue
                if o in defined:  # twice by nodes, or a node overwriting an input/initializer
                    return f"name {o!r} is defined twice (node {n.name or n.op_type!r})"
                defined.add(o)
        scopes = (*outer, defined)
        for n in g.node:
            seen: set[str] = set()
            for a in n.attribute:
                if a.name in seen:
                    return f"node {n.name or n.op_type!r} repeats attribute {a.name!r}"
                seen.add(a.name)
                if a.type == onnx.AttributeProto.GRAPH or a.HasField("g"):
                    stack.append((a.g, scopes))
                for sub in a.graphs:
                    stack.append((sub, scopes))
            for i in n.input:
                if i and not any(i in s for s in scopes):
                    return f"node {n.name or n.op_type!r} reads {i!r}, which nothing defines"
        outputs = [o.name for o in g.output]
        if len(set(outputs)) != len(outputs):
            return f"graph {g.name!r} lists an output twice"
    return None

