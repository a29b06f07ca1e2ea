"""Greedy generation with onnxruntime-genai and the one comparison of two generations (tokens and every
step's logits), shared by the genai tests."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

Generation = tuple[list[int], list[np.ndarray]]


def generate(config: Any, prompt: Sequence[int], max_length: int) -> Generation:
    """Greedy generation from ``prompt`` up to ``max_length`` tokens: the sequence and every step's logits."""
    import onnxruntime_genai as og

    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([list(prompt)], dtype=np.int32))
    logits = []
    while not gen.is_done():
        gen.generate_next_token()
        logits.append(np.array(gen.get_output("logits")))
    return [int(t) for t in gen.get_sequence(0)], logits


def assert_same_generation(a: Generation, b: Generation, steps: int) -> None:
    """The same tokens and bit-identical logits at each of ``steps`` generated tokens."""
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1]) == steps
    for x, y in zip(a[1], b[1]):
        np.testing.assert_array_equal(x, y)
