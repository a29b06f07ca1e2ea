"""Fixtures for the pytest-benchmark suites: ``pytest bench/ --benchmark-only``."""
from __future__ import annotations

import pytest

from bench.synth_models import sizes, synth_model


@pytest.fixture(params=sizes())
def llama_qdq(request) -> str:
    return synth_model(request.param)
