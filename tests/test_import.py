"""``import ortmem`` is thin, and creating a session never loads a planner, plotting or memray.

Checked in fresh interpreters by module presence (deterministic); the time and RSS figures are in
``bench/bench_import.py``.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("onnx", "matplotlib", "memray", "rich", "ortmem.plan.estimate", "ortmem.plan.partition",
         "ortmem.plan.recompute", "ortmem.reach.pipeline", "ortmem.measure")


def _loaded(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_ortmem_loads_nothing_heavy():
    assert _loaded("import ortmem") == []


def test_the_session_path_loads_no_planner_plotting_or_memray():
    assert _loaded("import ortmem; ortmem.InferenceSession; ortmem.load") == ["onnx"]


def test_lazy_names_resolve_to_their_owners():
    import ortmem

    for name in ortmem.__all__:
        assert getattr(ortmem, name) is not None
    assert ortmem.InferenceSession.__module__ == "ortmem.session" and ortmem.estimate.__module__.startswith("ortmem.plan.estimate.")
    with pytest.raises(AttributeError):
        ortmem.not_a_name  # noqa: B018
