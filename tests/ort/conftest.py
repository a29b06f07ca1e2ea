"""Fixtures the release tests share."""
from __future__ import annotations

import pytest

from ortmem.ort import release as rel


@pytest.fixture
def fresh_capabilities(monkeypatch):
    """Forget the process-wide answer (and the notices said) so a test can compute or install its own;
    restored afterwards."""
    monkeypatch.setattr(rel, "_current", None)
    rel._warn_once.cache_clear()
    yield
    rel._current = None
