"""The rewrite engine's writers: a cache entry's full digests are computed while its files are written
(no file of the entry is read back), they equal a digest of the finished files, and a failing tensor
stops the ordered writer instead of leaving the others waiting for their turn."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.store import digest
from ortmem.store.cache import Cache
from ortmem.convert import convert_cached
from ortmem.ortmodel.settings import session_settings
from ortmem.errors import ConversionError
from ortmem.passes import dq_matmul
from ortmem.passes.conversion import plan_conversion, write_weights
from ortmem.synth import SynthConfig, write_model
from tests.support.builders import tiny_decoder

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


def _recorded_digests_match_files(entry) -> None:
    recorded = entry.manifest()["digests"]
    files = sorted(f.name for f in entry.path.iterdir() if f.name != "manifest.json")
    assert sorted(recorded) == files
    for name in files:
        assert recorded[name] == digest.file_digest(entry.path / name), name


@pytest.mark.parametrize("link", [True, False])
def test_entry_digests_are_computed_while_writing(tmp_path, monkeypatch, link):
    """Build an entry, recording every file ``file_digest`` reads: only the sources (once each, for
    the manifest's source digests and the linked sources alike), never weights.bin or model.onnx.
    Without hard links (another filesystem) the carried tensors are copied into weights.bin and
    hashed on the way. The recorded digests are those of the finished files, the entry verifies in
    full, and the session on it gives ORT's own outputs."""
    src = tiny_decoder(tmp_path / "m", layers=3, storage="external", embedding="quantized", zero_points=True)
    if not link:
        def no_link(*a, **k):
            raise OSError("cross-device link")
        monkeypatch.setattr(os, "link", no_link)
    read: list[str] = []
    real = digest.file_digest

    def recording(path, *a, **k):
        read.append(os.path.realpath(path))
        return real(path, *a, **k)

    monkeypatch.setattr(digest, "file_digest", recording)
    cache = Cache(tmp_path / "cache")
    with ortmem.load(src) as model:
        entry, hit, report = convert_cached(model, session_settings(), cache)
        sources = sorted({os.path.realpath(w.file) for w in model.weights} | {os.path.realpath(src)})
    monkeypatch.setattr(digest, "file_digest", real)
    assert entry is not None and not hit and report.converted > 0
    assert sorted(read) == sources  # each source once; nothing inside the entry
    names = {f.name for f in entry.path.iterdir()}
    assert any(n.startswith("source-") for n in names) == link
    _recorded_digests_match_files(entry)
    assert cache.verify(entry, mode="full") is None
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, FEEDS)
    got = ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"]).run(None, FEEDS)
    assert len(want) == len(got) == 1
    assert np.array_equal(want[0], got[0])


def test_digest_written_in_file_order_equals_the_file(tmp_path):
    """write_weights' digest (jobs run by offset, on several threads) is the digest of the file."""
    src = tiny_decoder(tmp_path / "m", layers=3, weight_type="uint4", zero_points=True, scale_dtype="float16")
    with ortmem.load(src) as model:
        plan = plan_conversion(model, session_settings())
        assert len(plan.of_rule(dq_matmul.NAME)) >= 10 and plan.copied
        out = tmp_path / "weights.bin"
        with open(out, "wb") as f:
            f.truncate(plan.size)
        recorded = write_weights(model, plan, out, threads=3, digest=True)
    assert recorded == digest.file_digest(out)


def test_a_failing_tensor_stops_the_ordered_writer(tmp_path, monkeypatch):
    """One rewrite fails mid-way: write_weights raises a ConversionError for it; the jobs after it,
    which wait for its turn to hash their bytes, fail too instead of waiting forever."""
    src = tiny_decoder(tmp_path / "m", layers=3)
    real = dq_matmul.MatMulRewrite.convert

    def convert(self, model, sink):
        if self.candidate.node == plan.of_rule(dq_matmul.NAME)[1].candidate.node:
            raise ConversionError("damaged", tensor=self.candidate.weight)
        real(self, model, sink)

    monkeypatch.setattr(dq_matmul.MatMulRewrite, "convert", convert)
    errors: list[BaseException] = []
    with ortmem.load(src) as model:
        plan = plan_conversion(model, session_settings())
        out = tmp_path / "weights.bin"
        with open(out, "wb") as f:
            f.truncate(plan.size)

        def run() -> None:
            try:
                write_weights(model, plan, out, threads=2, digest=True)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "write_weights hung after a failed tensor"
    assert len(errors) == 1 and isinstance(errors[0], ConversionError)
