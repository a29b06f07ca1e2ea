"""The one way tests compare outputs: same count (never zero), each array equal; or, where ortmem's
graph is knowingly not ORT's own (accuracy level 0 against the unfused run, a partition cut inside a
pattern ORT fuses, values through JSON), each array within a stated tolerance."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def _same_count(got: Sequence[np.ndarray], expected: Sequence[np.ndarray], what: str) -> None:
    """An empty result never passes (``all()`` over a ``zip`` of nothing would)."""
    assert len(expected) > 0, f"{what}nothing to compare against"
    assert len(got) == len(expected), f"{what}{len(got)} outputs, expected {len(expected)}"


def assert_same_outputs(got: Sequence[np.ndarray], expected: Sequence[np.ndarray], what: str = "") -> None:
    """Bit-identical outputs, as many as expected, each of the same dtype and shape. ``what`` names the
    case in the failure message (a model of a loop)."""
    what = f"{what}: " if what else ""
    _same_count(got, expected, what)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, f"{what}output {i}: {g.dtype}{g.shape} vs {e.dtype}{e.shape}"
        assert np.array_equal(g, e), f"{what}output {i} differs: max |diff| {np.max(np.abs(g.astype(np.float64) - e)):.3g}"


def assert_close_outputs(got: Sequence[np.ndarray], expected: Sequence[np.ndarray], *, rtol: float,
                         atol: float = 0.0, atol_of_max: float = 0.0) -> None:
    """As many outputs as expected, each within ``rtol`` of the expected value plus an absolute
    tolerance: ``atol``, plus ``atol_of_max`` times the output's largest expected magnitude (rounding
    that grows with the values)."""
    _same_count(got, expected, "")
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol + atol_of_max * float(np.abs(e).max()))
