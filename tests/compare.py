"""The one way tests compare outputs: same count (never zero), each array equal."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def assert_same_outputs(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> None:
    """Bit-identical outputs, as many as expected; an empty result never passes (``all()`` over a
    ``zip`` of nothing would)."""
    assert len(expected) > 0, "nothing to compare against"
    assert len(got) == len(expected), f"{len(got)} outputs, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, f"output {i}: {g.dtype}{g.shape} vs {e.dtype}{e.shape}"
        assert np.array_equal(g, e), f"output {i} differs: max |diff| {np.max(np.abs(g.astype(np.float64) - e)):.3g}"
