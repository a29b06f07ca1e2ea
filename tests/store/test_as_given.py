"""Models the store settled as given (:func:`ortmem.store.handoff_records.mark_as_given`): where ORT's
finished model gains nothing (its entry is a marker), starts at ORT's defaults hand the file to ORT from
its handoff record without importing the request, the store or the handoff, in fresh processes, through
``ortmem.InferenceSession`` and the hook; a start at other settings, or on another onnxruntime release,
asks the store as before. Outputs are plain ORT's on the same file throughout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.onnxfile import scan
from ortmem.ort.release import capabilities
from ortmem.session.deploy import prepare_path
from ortmem.store import finisher, finished_entries, handoff_records
from ortmem.store.cache import Cache
from tests.support.builders import elementwise
from tests.support.reference import run_plain

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")

CPU = ["CPUExecutionProvider"]
FEED = {"x": np.random.default_rng(3).standard_normal((1, 32, 16, 16)).astype(np.float32)}
#: The modules a start that asks the store imports, and one settled as given does not.
STORE_MODULES = ("ortmem.session.request", "ortmem.store.cache", "ortmem.store.verdict", "ortmem.session.handoff", "onnx")


def scale_model(path: Path, *, external: bool) -> Path:
    """``x * w + b`` (:func:`tests.support.builders.elementwise`): ORT makes no weight of it and packs
    none, so its finished entry is a marker (nothing gained); its mtime an hour back, as an installed
    model's (a file written within ``RACY_SECONDS`` gets no handoff record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    elementwise(path, external=external)
    hour_ago = time.time() - 3600
    for f in path.parent.iterdir():
        os.utime(f, (hour_ago, hour_ago))
    return path


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model is large enough for a finished entry (the tests' models are small): without the
    mark, every start asks the store."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")


START = """
import json, sys
import numpy as np
import onnxruntime as ort
import ortmem
path, cache, options = sys.argv[1], sys.argv[2], sys.argv[3]
so = None
if options == "threads":
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
s = ortmem.InferenceSession(path, so, providers=["CPUExecutionProvider"], cache=cache)
out = s.run(None, {"x": np.load(sys.argv[4])})[0]
np.save(sys.argv[5], out)
print(json.dumps({"action": s.ortmem_action, "imported": [m for m in %r if m in sys.modules]}))
""" % (STORE_MODULES,)

HOOKED = """
import json, sys
import numpy as np
import onnxruntime as ort
import ortmem
ortmem.hook()
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
out = s.run(None, {"x": np.load(sys.argv[2])})[0]
np.save(sys.argv[3], out)  # the model, the feed, the output
actions = [r["action"] for r in __import__("ortmem.intercept.session_hook").intercept.session_hook.report()]
print(json.dumps({"action": actions[0], "imported": [m for m in %r if m in sys.modules]}))
""" % (STORE_MODULES,)


def _fresh(tmp_path: Path, script: str, *args: str, env: Optional[dict] = None) -> tuple[dict, np.ndarray]:
    """A fresh process running ``script`` with ``args``, then the feed's and the output's files: its
    report, and the output it saved."""
    np.save(tmp_path / "x.npy", FEED["x"])
    out = tmp_path / "y.npy"
    done = subprocess.run([sys.executable, "-c", script, *args, str(tmp_path / "x.npy"), str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(out)


def _marks(cache: Path) -> list[str]:
    records = cache / handoff_records.FOLDER
    return sorted(m for d in records.iterdir() if not d.name.startswith(".") for m in os.listdir(d)
                  if m.startswith(handoff_records.AS_GIVEN_PREFIX))


@pytest.mark.parametrize("external", [True, False], ids=["external-data", "embedded"])
def test_a_model_prepare_settled_starts_at_defaults_without_the_store(tmp_path: Path, any_size, external: bool):
    """``ortmem prepare`` finds nothing worth finishing and marks the file's record for this release: a
    start at ORT's defaults gives ORT the file (or its skeleton beside the record's link) importing no
    store module; a start with SessionOptions asks the store, which says the same. Outputs are plain
    ORT's on the file."""
    model = scale_model(tmp_path / "models" / "scale.onnx", external=external)
    cache = tmp_path / "cache"
    lines: list[str] = []
    assert prepare_path(model, Cache(cache), say=lines.append) == 0, lines
    assert finished_entries.is_marker(next(iter(Cache(cache).entries()))), lines
    assert _marks(cache) == [handoff_records.AS_GIVEN_PREFIX + ort.__version__]
    expected = run_plain(model, FEED)[0]
    action = "as-is" if external else "mapped"
    plain, out = _fresh(tmp_path, START, str(model), str(cache), "defaults")
    assert plain == {"action": action, "imported": []}
    assert np.array_equal(out, expected)
    with_options, out = _fresh(tmp_path, START, str(model), str(cache), "threads")
    assert with_options["action"] == action and "ortmem.store.verdict" in with_options["imported"]
    assert np.array_equal(out, expected)


def test_a_hooked_program_reads_the_mark_too(tmp_path: Path, any_size):
    """The hook's light route honours the same mark: a settled file goes to ORT with no store module."""
    model = scale_model(tmp_path / "models" / "scale.onnx", external=True)
    cache = tmp_path / "cache"
    assert prepare_path(model, Cache(cache / "converted"), say=lambda line: None) == 0
    report, out = _fresh(tmp_path, HOOKED, str(model), env={"ORTMEM_CACHE_DIR": str(cache)})
    assert report == {"action": "as-is", "imported": []}
    assert np.array_equal(out, run_plain(model, FEED)[0])


def test_the_mark_holds_for_its_own_onnxruntime_release_only(tmp_path: Path, any_size):
    """A mark made by another release (an upgrade since) is not this release's verdict: the start asks
    the store, whose marker for this release settles the file again and marks it for this release."""
    model = scale_model(tmp_path / "models" / "scale.onnx", external=True)
    cache = tmp_path / "cache"
    assert prepare_path(model, Cache(cache), say=lambda line: None) == 0
    records = cache / handoff_records.FOLDER
    record = next(d for d in records.iterdir() if not d.name.startswith("."))
    mine = record / (handoff_records.AS_GIVEN_PREFIX + ort.__version__)
    mine.rename(record / (handoff_records.AS_GIVEN_PREFIX + "0.0.0"))
    asked, out = _fresh(tmp_path, START, str(model), str(cache), "defaults")
    assert asked["action"] == "as-is" and "ortmem.store.verdict" in asked["imported"]
    assert np.array_equal(out, run_plain(model, FEED)[0])
    assert mine.exists()
    again, _ = _fresh(tmp_path, START, str(model), str(cache), "defaults")
    assert again == {"action": "as-is", "imported": []}


def test_a_first_run_settles_it_and_later_starts_need_no_store(tmp_path: Path, any_size):
    """Without ``ortmem prepare``: the first start leaves the finished entry's build for after its first
    run, which finds nothing worth mapping (a marker); the next start at defaults is settled by the store
    and marks the record; the one after needs no store. Outputs are ORT's at every start."""
    model = scale_model(tmp_path / "models" / "scale.onnx", external=True)
    cache = tmp_path / "cache"
    expected = run_plain(model, FEED)[0]
    first = ortmem.InferenceSession(str(model), providers=CPU, cache=cache)
    assert np.array_equal(first.run(None, FEED)[0], expected)
    assert finisher.wait_background(120)
    del first
    assert finished_entries.is_marker(next(iter(Cache(cache).entries())))
    second = ortmem.InferenceSession(str(model), providers=CPU, cache=cache)
    assert second.ortmem_action == "as-is" and np.array_equal(second.run(None, FEED)[0], expected)
    del second
    assert _marks(cache) == [handoff_records.AS_GIVEN_PREFIX + ort.__version__]
    third, out = _fresh(tmp_path, START, str(model), str(cache), "defaults")
    assert third == {"action": "as-is", "imported": []}
    assert np.array_equal(out, expected)


def test_an_export_of_orts_quantizer_with_a_finished_entry_worth_mapping_is_never_marked(tmp_path: Path, any_size):
    """ORT's own ``quantize_static`` (QDQ, int8, external data: :mod:`bench.int8_qdq`'s chain), whose
    finished model ORT packs, gets a finished entry, not a marker: no mark is made, and a warm start at
    ORT's defaults loads the finished entry with plain ORT's outputs on the file."""
    from bench.int8_qdq import WIDTHS, chain_external

    model = chain_external(tmp_path / "models")
    hour_ago = time.time() - 3600
    for f in model.parent.iterdir():
        os.utime(f, (hour_ago, hour_ago))
    cache = tmp_path / "cache"
    lines: list[str] = []
    assert prepare_path(model, Cache(cache), say=lines.append) == 0, lines
    if "finished entry" not in lines[-1]:
        pytest.skip(f"this onnxruntime finishes nothing worth mapping here: {lines[-1]}")
    warm = ortmem.InferenceSession(str(model), providers=CPU, cache=cache)
    feeds = {"x": np.random.default_rng(8).standard_normal((2, WIDTHS[0])).astype(np.float32)}
    assert warm.ortmem_action == "finished"
    assert np.array_equal(warm.run(None, feeds)[0], run_plain(model, feeds)[0])
    records = cache / handoff_records.FOLDER
    assert not records.exists() or _marks(cache) == []
