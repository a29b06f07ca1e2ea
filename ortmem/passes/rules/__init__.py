"""The rules the rewrite engine applies, in order.

Order matters twice: a rule plans after the ones before it and may not rewrite the nodes they
claimed (:func:`ortmem.passes.rule.claimed_by`), and the rules' tensors are named and laid out in
weights.bin in this order, so reordering changes converted files (``bench/converted_digests.py``).
A new rule is a module implementing :class:`ortmem.passes.rule.Rule` and one line here.
"""
from __future__ import annotations

from ortmem.passes.rules import dq_gather, dq_matmul
from ortmem.passes.rule import Rule

#: DQ+MatMul/Gemm -> MatMulNBits first: ORT's own fusion, replayed; then ortmem's DQ+Gather ->
#: GatherBlockQuantized, which ORT has no fusion for.
RULES: tuple[Rule, ...] = (dq_matmul.RULE, dq_gather.RULE)
