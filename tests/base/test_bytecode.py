"""ortmem.base.bytecode: the measuring commands run ortmem from bytecode, as an installed wheel does."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from ortmem.base.bytecode import ensure_bytecode


def test_missing_bytecode_is_written_once_and_then_used(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "sub/mod.py"):
        (pkg / name).write_text("VALUE = 42\n")
    first = ensure_bytecode(pkg)
    assert "compiled 3 modules" in first, first
    for name in ("__init__.py", "sub/__init__.py", "sub/mod.py"):
        assert Path(importlib.util.cache_from_source(str(pkg / name))).is_file()
    assert ensure_bytecode(pkg) == "ortmem's bytecode: up to date"
    # a fresh interpreter that may not write bytecode imports it without compiling
    probe = ("import sys, builtins\ncalls = []\nreal = builtins.compile\n"
             "builtins.compile = lambda *a, **k: (calls.append(1), real(*a, **k))[1]\n"
             f"sys.path.insert(0, {str(tmp_path)!r})\nimport pkg.sub.mod\nprint(pkg.sub.mod.VALUE, len(calls))")
    out = subprocess.run([sys.executable, "-B", "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["42", "0"]  # nothing compiled from source


def test_an_edited_module_is_compiled_again(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("A = 1\n")
    ensure_bytecode(pkg)
    cached = Path(importlib.util.cache_from_source(str(pkg / "__init__.py")))
    before = cached.stat().st_mtime_ns
    import os

    (pkg / "__init__.py").write_text("A = 2\n")
    later = cached.stat().st_mtime + 5
    os.utime(pkg / "__init__.py", (later, later))
    assert "compiled 1 modules" in ensure_bytecode(pkg)
    assert cached.stat().st_mtime_ns != before
