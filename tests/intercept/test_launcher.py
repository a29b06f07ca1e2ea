"""Unmodified third-party packages from PyPI that create ORT sessions internally from models shipped in
their own wheels, run plain and through ``python -m ortmem run`` in fresh processes: same output,
every session ortmem's, nothing printed by ORT or ortmem. Install them with ``pip install
-e ".[hook-clients]"``; a test is skipped when its package is absent."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

CLIENTS = REPO / "tests" / "hook_clients"
#: Actions that mean ortmem created the session (see ortmem.session.Handoff.action).
ORTMEM_ACTIONS = {"as-is", "mapped", "converted", "cache-hit", "finished", "in-memory", "converted-temporary"}


@pytest.mark.parametrize("package, script, sessions", [
    ("magika", "magika_client.py", 1),
    ("rapidocr_onnxruntime", "rapidocr_client.py", 3),
])
def test_unmodified_client_under_the_hook(package, script, sessions, tmp_path):
    if importlib.util.find_spec(package) is None:  # found without importing it into this process
        pytest.skip(f"{package} is not installed (pip install -e '.[hook-clients]')")
    path = str(CLIENTS / script)
    plain = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    report = tmp_path / "report.json"
    hooked = subprocess.run([sys.executable, "-m", "ortmem", "run", "--report", str(report), "--", path],
                            capture_output=True, text=True, timeout=300)
    assert hooked.returncode == 0, hooked.stderr
    assert json.loads(hooked.stdout) == json.loads(plain.stdout) and json.loads(plain.stdout)
    for noise in ("W:onnxruntime", "already exists", "ortmem", "Traceback"):
        assert noise not in hooked.stderr, hooked.stderr
    made = json.loads(report.read_text())["sessions"]
    assert len(made) == sessions
    assert all(s["action"] in ORTMEM_ACTIONS for s in made), made
    assert any(s["action"] == "mapped" for s in made), made  # its embedded weights were mapped, not copied
