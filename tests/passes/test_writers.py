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
from ortmem.files import digest
from ortmem.store.cache import Cache
from ortmem.session.convert import convert_cached
from ortmem.ort.settings import session_settings
from ortmem.errors import ConversionError
from ortmem.passes.rules import dq_matmul
from ortmem.passes.engine import plan_conversion, write_weights
from tests.support.builders import tiny_decoder
from tests.support.reference import run_plain

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
    want = run_plain(src, FEEDS)
    got = run_plain(entry.model_path, FEEDS)
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


# --- how many threads convert ----------------------------------------------------------------------


def test_conversion_threads_follow_ort_s_intra_op_rule() -> None:
    """The caller's intra_op_num_threads where set, else one per physical core this process may run
    on (hyper-thread siblings counted once), at most MAX_THREADS."""
    from ortmem.passes.writers import MAX_THREADS, conversion_threads, physical_cores

    allowed = os.sched_getaffinity(0)
    assert 1 <= physical_cores() <= len(allowed)
    assert conversion_threads() == min(physical_cores(), MAX_THREADS)
    assert conversion_threads(3) == 3 and conversion_threads(1) == 1
    assert conversion_threads(10 * MAX_THREADS) == MAX_THREADS


def test_a_process_pinned_to_one_cpu_converts_on_one_thread() -> None:
    """A container's CPU set or taskset limits the count: a child pinned to one CPU counts one core."""
    import subprocess
    import sys

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from ortmem.passes.writers import conversion_threads, physical_cores\n"
            "print(physical_cores(), conversion_threads(), conversion_threads(4))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1", "4"]


def test_the_thread_count_never_changes_the_bytes(tmp_path: Path) -> None:
    """One thread, and more threads than this machine has cores: the same weights.bin, byte for byte,
    and the digest of each is the file's."""
    src = tiny_decoder(tmp_path / "m", layers=3, weight_type="uint4", zero_points=True, scale_dtype="float16")
    files = []
    for threads in (1, 2 * os.cpu_count() + 1):
        with ortmem.load(src) as model:  # a conversion releases each source span it is done with
            plan = plan_conversion(model, session_settings())
            out = tmp_path / f"weights-{threads}.bin"
            with open(out, "wb") as f:
                f.truncate(plan.size)
            assert write_weights(model, plan, out, threads=threads, digest=True) == digest.file_digest(out)
            files.append(out.read_bytes())
    assert files[0] == files[1]


def test_the_caller_s_intra_op_threads_reach_the_conversion(tmp_path: Path, monkeypatch) -> None:
    """A session with intra_op_num_threads=3 converts its cold start on three threads, as ORT's own
    fusion would use three (with the conversion in this process: the helper takes the count in its
    job the same way)."""
    from ortmem.passes import engine

    monkeypatch.setenv("ORTMEM_CONVERT_HELPER_MIN_BYTES", str(1 << 40))  # convert here, where we can see it
    seen: list[int] = []
    real = engine.write_weights

    def recording(*a, threads=None, **k):
        seen.append(threads)
        return real(*a, threads=threads, **k)

    monkeypatch.setattr("ortmem.store.writer.write_weights", recording)
    src = tiny_decoder(tmp_path / "m", layers=2)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 3
    sess = ortmem.InferenceSession(str(src), so, providers=["CPUExecutionProvider"], cache=str(tmp_path / "c"))
    assert sess.ortmem_action == "converted" and seen == [3]
    want = run_plain(src, FEEDS)
    assert np.array_equal(sess.run(None, FEEDS)[0], want[0])
