"""Where ortmem keeps what it generates or converts: ``$ORTMEM_CACHE_DIR``, else the platform cache dir."""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    root = os.environ.get("ORTMEM_CACHE_DIR")
    path = Path(root) if root else Path(platformdirs.user_cache_dir("ortmem"))
    path.mkdir(parents=True, exist_ok=True)
    return path
