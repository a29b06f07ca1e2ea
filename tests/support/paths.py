"""Where things are, independent of where a test file sits (tests can move into subfolders)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root: ortmem/, tests/, bench/, .ci/
