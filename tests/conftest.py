import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

# The release probe's answers (ortmem.ort.release) depend on the ORT build and CPU only: one folder
# for the whole run, inherited by fresh-process children, so no test pays or measures a probe.
os.environ.setdefault("ORTMEM_PROBE_DIR", str(Path(tempfile.gettempdir()) / f"ortmem-test-probes-{os.getuid()}"))
# Stamps of files checked in full (ortmem.files.stamps) go to a folder of the test run's, not the user's
# per-boot one; inherited by children too.
os.environ.setdefault("ORTMEM_VERIFIED_DIR", str(Path(tempfile.mkdtemp(prefix="ortmem-test-verified-"))))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own conversion cache: no test reads another's entries or the user's."""
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path_factory.mktemp("ortmem-cache")))



@pytest.fixture
def no_temp_folder(monkeypatch, tmp_path_factory):
    """No temporary folder can be created (``$TMPDIR`` missing or read-only): ``cache=False`` then
    converts into memory ORT borrows (ortmem.session.inmemory), the path these tests are about."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("no-temp") / "missing"))
