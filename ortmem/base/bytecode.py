"""ortmem's own bytecode, written before anything is measured: what an installed wheel has.

Why: pip compiles every module of a wheel it installs (numpy's, onnxruntime's and onnx's ``.pyc`` are in
site-packages), but an editable install (``pip install -e .``, the README's) gets ortmem's bytecode only
when Python writes it on import, and never where ``PYTHONDONTWRITEBYTECODE`` is set (many container
images): every fresh process then compiles ortmem's session path from source while plain ORT compiles
nothing, which roughly doubles the import time of ortmem's session path and adds to the conversion's
imports. A deployment runs an installed ortmem, so the measuring commands
(``ortmem bench``, ``ortmem run --compare``, ``bench/model_classes.py``) measure that, and say so
(:func:`ensure_bytecode`'s line, also in the bench report's environment).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional


def _stale(root: Path) -> list[Path]:
    """The modules under ``root`` whose bytecode is missing or would not be used: the header Python
    checks on import (magic number, the source's mtime and size) does not match."""
    stale = []
    for source in root.rglob("*.py"):
        try:
            st = source.stat()
            with open(importlib.util.cache_from_source(str(source)), "rb") as f:
                header = f.read(16)
        except OSError:
            stale.append(source)
            continue
        expected = (importlib.util.MAGIC_NUMBER + bytes(4) + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                    + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
        if header != expected:
            stale.append(source)
    return stale


def ensure_bytecode(root: Optional[Path] = None) -> str:
    """Write the missing or stale bytecode of ortmem's modules (or of the package at ``root``) where
    Python looks for it, as pip does for a wheel it installs; one line on what was found and done."""
    import compileall
    import py_compile

    if root is None:
        import ortmem

        root = Path(ortmem.__file__).resolve().parent
    stale = _stale(root)
    if not stale:
        return "ortmem's bytecode: up to date"
    # timestamp-checked, as Python itself writes them (and as _stale reads them), whatever SOURCE_DATE_EPOCH says
    compileall.compile_dir(str(root), quiet=2, workers=1, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    left = _stale(root)
    if left:
        return (f"ortmem's bytecode: {len(left)} of {len(stale)} missing modules could not be written "
                f"({root} is not writable): each measured process compiles them from source")
    return (f"ortmem's bytecode: compiled {len(stale)} modules, as pip does when it installs a wheel "
            "(an editable install under PYTHONDONTWRITEBYTECODE would compile them in every process)")
