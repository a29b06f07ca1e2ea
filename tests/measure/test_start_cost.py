"""``python -m bench.start_cost``: ortmem's own part of a start, timed inside fresh processes against
plain ORT's creation, on a real model; the split adds up and names what ortmem gave ORT."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.support.builders import matmul_chain, save

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "bench.start_cost", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _row(out: str, name: str) -> tuple[float, float]:
    match = re.search(rf"^{re.escape(name)}\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert match, out
    return float(match.group(1)), float(match.group(2))


def test_the_split_adds_up_and_names_the_start(tmp_path: Path):
    model = save(matmul_chain(np.random.default_rng(3), [64, 256, 8]), tmp_path / "chain.onnx")
    import ortmem

    action = ortmem.InferenceSession(str(model), providers=["CPUExecutionProvider"], cache=tmp_path / "first").ortmem_action
    out = _run(str(model), "-n", "2", "--fresh")
    assert "2 rounds, no SessionOptions, an empty cache each round" in out and f"ortmem_action {action}\n" in out
    total, inside, own = (_row(out, name) for name in ("ortmem: creation, imports counted",
                                                          "  of which inside ORT's creation",
                                                          "  of which ortmem's own"))
    assert 0 < inside[0] <= total[0] and own[0] > 0
    assert abs(total[1] - inside[1] - own[1]) < max(0.2 * total[1], 5.0)  # medians of the parts, near the whole
    with_options = _run(str(model), "-n", "1", "--options", "--cache", str(tmp_path / "cache"))
    assert "SessionOptions()" in with_options
