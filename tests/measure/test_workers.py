"""``bench --workers``: N fresh worker processes on one model, summed PSS private/shared; and N
workers starting together on an empty cache make exactly one conversion."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from ortmem.measure.bench import add_arguments, main
from ortmem.measure.report import read_json
from ortmem.measure.workers import WorkerReading, WorkersRun, extrapolate, predicted_rise, run_workers
from ortmem.ort.release import capabilities
from ortmem.measure.synth import SynthConfig, cached_model

pytestmark = pytest.mark.slow
HERE = os.path.abspath(__file__)

MiB = 1 << 20
# ~33 MiB of int4 codes + scales: large enough that shared weights stand out from each process's heap
CONFIG = SynthConfig(hidden=1024, intermediate=2816, layers=4, vocab=4000, heads=8, storage="external",
                     name="workers")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(cached_model(CONFIG, tmp_path_factory.mktemp("synth")))


def test_warm_workers_share_the_weights_and_ort_does_not(model: str) -> None:
    report = run_workers(model, ["ort", "ortmem-warm"], [1, 2])
    assert not [r.error for r in report.runs if r.error]
    ort1, ort2 = report.run("ort", 1), report.run("ort", 2)
    warm1, warm2 = report.run("ortmem-warm", 1), report.run("ortmem-warm", 2)
    assert all(report.same_output(r) for r in (ort2, warm1, warm2))
    for r in report.runs:  # totals are the sums of the workers' own readings
        assert r.total_pss_bytes == sum(w.pss for w in r.workers)
        assert len(r.workers) == r.n and r.ready_wall_s and r.ready_wall_s > 0
    assert ort1.workers[0].peak_private >= ort1.workers[0].pss_anon * 0.9  # VmHWM - RssFile
    if not capabilities().prepacked_save:
        pytest.skip("this onnxruntime saves no pre-packed weights (ortmem.ort.release): warm workers "
                    "pack on their own heaps, as ORT's do")
    ort_extra = ort2.total_private_bytes - ort1.total_private_bytes
    warm_extra = warm2.total_private_bytes - warm1.total_private_bytes
    print(f"extra worker private: ort {ort_extra / MiB:.1f} MiB, ortmem-warm {warm_extra / MiB:.1f} MiB")
    # ORT copies the weights into each process's heap; the warm start maps them from one file
    assert warm_extra < 0.5 * ort_extra
    assert warm1.total_shared_bytes > warm1.total_private_bytes
    assert warm2.total_pss_bytes < 1.5 * warm1.total_pss_bytes
    assert ort2.total_pss_bytes > 1.6 * ort1.total_pss_bytes
    text = report.render_table()
    assert "ortmem-warm" in text and "private" in text and "shared" in text


def create_after_barrier(model: str, options: dict):
    """Worker strategy: wait until every worker has imported everything, then create the session,
    so that all of them look the cache up within milliseconds (import times differ by more than a
    small model's conversion takes, which would hide a race)."""
    import time

    import ortmem

    barrier = Path(options["barrier"])
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(barrier.iterdir())) < options["workers"] and time.monotonic() < deadline:
        time.sleep(0.005)
    return ortmem.InferenceSession(model, providers=["CPUExecutionProvider"], cache=options["cache"])


def test_four_workers_on_an_empty_cache_convert_once(model: str, tmp_path: Path) -> None:
    """Four workers start together on an empty cache: one converts, the others wait for its entry;
    one of them packs the pre-packed weights; everyone serves ORT's outputs; no temporary file left."""
    (tmp_path / "barrier").mkdir()
    cache = tmp_path / "cache"
    options = {"barrier": str(tmp_path / "barrier"), "workers": 4, "cache": str(cache)}
    report = run_workers(model, [f"{HERE}:create_after_barrier"], [4], options=options)
    run = report.runs[0]
    assert not run.error, run.error
    assert sum(w.converted for w in run.workers) == 1
    assert {w.output_hash for w in run.workers} == {_ort_output_hash(model)}
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1
    assert list(cache.rglob(".*")) == []  # no temporary folder, no lock file
    # after the first runs, one background job finished the entry (where ORT saves finished models)
    assert bool(list(entries[0].glob("finished-*.onnx"))) == capabilities().prepacked_save


def _ort_output_hash(model: str) -> str:
    import onnxruntime as ort

    from ortmem.ort.feeds import hash_outputs, make_inputs

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return hash_outputs([o.name for o in sess.get_outputs()], sess.run(None, make_inputs(sess, {})))


def create_noisy(model: str, options: dict):
    """A strategy that prints on stdout (the ready line must still be found)."""
    import onnxruntime as ort

    print("hello from a strategy", flush=True)
    os.write(1, b"and from native code\n")
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def create_broken(model: str, options: dict):
    raise RuntimeError("this strategy cannot create a session")


def test_printing_and_failing_workers(model: str) -> None:
    report = run_workers(model, [f"{HERE}:create_noisy", f"{HERE}:create_broken"], [2])
    noisy, broken = report.runs
    assert noisy.error is None and len(noisy.workers) == 2
    assert broken.error and "exited with code 1" in broken.error and "cannot create a session" in broken.error
    assert "FAILED" in report.render_table()


def test_memory_guard_extrapolates() -> None:
    worker = WorkerReading(pid=1, create_wall_s=1.0, run_wall_s=0.1, ready_s=1.1, output_hash="", pss=1100 * MiB,
                           pss_anon=1000 * MiB, pss_file=100 * MiB, pss_shmem=0, rss=1100 * MiB,
                           peak_private=1500 * MiB)
    one = WorkersRun("ort", 1, True, total_pss_bytes=1100 * MiB, total_private_bytes=1000 * MiB,
                     total_shared_bytes=100 * MiB, private_per_worker_bytes=1000 * MiB, workers=[worker])
    assert predicted_rise(one, 8) == 8 * 1500 * MiB  # the creation peak, not only what stays
    eight = extrapolate(one, 8)
    assert eight.extrapolated and eight.total_private_bytes == 8000 * MiB
    assert eight.total_pss_bytes == 8100 * MiB  # the file pages are held once


def test_cli_workers_json_and_plot(model: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser(prog="ortmem bench")
    add_arguments(parser)
    assert main(parser.parse_args([model, "-n", "0"])) == 2  # -n 0 without workers: nothing to do
    for bad in (["--workers", "0"], ["--workers-sweep", "1,x"]):
        with pytest.raises(SystemExit):  # a usage error, not a traceback
            parser.parse_args([model, *bad])
    assert parser.parse_args([model, "--workers-sweep"]).workers_sweep == [1, 2, 4, 8]
    assert parser.parse_args([model, "--workers-sweep", "1,3"]).workers_sweep == [1, 3]
    args = parser.parse_args([model, "-n", "0", "-s", "ort", "--workers", "2", "--stagger", "-q",
                              "--json", str(tmp_path / "w.json"), "--plot", str(tmp_path / "w.png")])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "started one after the other" in out
    raw = json.loads((tmp_path / "w.json").read_text())
    assert raw["schema"] == "ortmem.bench/2" and raw["workers"]["runs"][0]["n"] == 2
    back = read_json(tmp_path / "w.json")
    assert back.workers is not None and back.workers.runs[0].workers[0].pss > 0
    assert (tmp_path / "w.png").stat().st_size > 10_000
    import matplotlib.pyplot as plt

    from ortmem.measure.plotting import figure
    from tests.support.figures import cut_off

    for name in (os.path.basename(model), "llama-3.2-3b-instruct-int4-block32-" * 3 + "qdq.onnx"):
        back.workers.model = str(tmp_path / name)  # a long name's title is wrapped, not cut
        fig = figure(back)
        try:
            assert len(fig.axes) == 1 and cut_off(fig) == []
        finally:
            plt.close(fig)
    assert os.path.getsize(tmp_path / "w.json") > 0
