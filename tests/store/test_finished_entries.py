"""Which starts get a prepared entry (:mod:`ortmem.store.finished_entries`), on real sessions and files.

A prepared entry is ORT's own save of a model ortmem hands over unconverted. It must answer only the
starts it was built for: a start with conversion on never loads the entry a ``convert=False`` start
left (its key records whether conversion was enabled), and a model ortmem declined to convert (a
fault a rewrite could hide) is left to ORT as given, with no entry built from it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import ortmem
from ortmem.onnxfile import scan
from ortmem.ort.release import capabilities
from ortmem.store import finisher
from ortmem.store.cache import Cache
from tests.support.builders import tiny_decoder
from tests.support.compare import assert_same_outputs
from tests.support.reference import CPU, run_plain

pytestmark = pytest.mark.skipif(not capabilities().prepacked_save, reason="this onnxruntime saves no pre-packed weights")

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model may get a prepared entry, whatever its size (the tiny decoder is far below the default)."""
    monkeypatch.setenv(scan.MIN_BYTES_ENV, "0")


def _entries(cache: Path) -> list[str]:
    return sorted(e.path.name for e in Cache(cache).entries()) if cache.is_dir() else []


def test_a_start_with_conversion_on_never_loads_the_entry_a_convert_false_start_left(tmp_path: Path, any_size) -> None:
    model = tiny_decoder(tmp_path / "src", storage="external")
    cache = tmp_path / "cache"
    expected = run_plain(model, FEEDS)
    unconverted = ortmem.InferenceSession(model, providers=CPU, cache=cache, convert=False)
    assert unconverted.ortmem_action == "as-is" and unconverted.ortmem_report is None
    assert_same_outputs(unconverted.run(None, FEEDS), expected)  # the first run leaves the prepared entry's build
    assert unconverted.ortmem_handoff.later is not None and finisher.wait_background(120)
    assert len(_entries(cache)) == 1
    again = ortmem.InferenceSession(model, providers=CPU, cache=cache, convert=False)
    assert again.ortmem_action in ("finished", "as-is")  # "as-is": the entry is a marker (ORT packs nothing here)

    converting = ortmem.InferenceSession(model, providers=CPU, cache=cache)
    assert converting.ortmem_action == "converted", converting.ortmem_action
    assert converting.ortmem_report is not None and converting.ortmem_report.converted > 0
    assert_same_outputs(converting.run(None, FEEDS), expected)


def test_a_model_ortmem_declined_to_convert_gets_no_prepared_entry(tmp_path: Path, any_size) -> None:
    """A QDQ model listing its output twice: ORT accepts it, but a rewrite could hide the fault, so
    ortmem declines to convert it and ORT gets it as given; nothing is built from it after its runs."""
    source = tiny_decoder(tmp_path / "src", storage="external")
    proto = onnx.load(str(source), load_external_data=False)
    proto.graph.output.append(proto.graph.output[0])
    model = source.with_name("declined.onnx")
    model.write_bytes(proto.SerializeToString())  # its weights stay in the source's data file
    cache = tmp_path / "cache"
    expected = run_plain(model, FEEDS)
    before = len(finisher.started_finishers())
    for _ in range(2):
        s = ortmem.InferenceSession(model, providers=CPU, cache=cache)
        assert s.ortmem_handoff.declined and s.ortmem_action == "as-is" and s.ortmem_report is None
        assert_same_outputs(s.run(None, FEEDS), expected)
        assert_same_outputs(s.run(None, FEEDS), expected)
    assert finisher.wait_background(120)
    assert len(finisher.started_finishers()) == before and _entries(cache) == []
