"""Fixtures for the pytest-benchmark suites: ``pytest bench/ --benchmark-only``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from synth_models import sizes, synth_model  # noqa: E402


@pytest.fixture(params=sizes())
def llama_qdq(request) -> str:
    return synth_model(request.param)
