"""Does ORT's parallel pre-packing make a session on a finished model start faster, outputs unchanged?

Why: a warm start of a model ortmem does not convert loads ORT's finished model (ORT's own optimized
save with its pre-packed blobs, reloaded at ``ORT_DISABLE_ALL``: :mod:`ortmem.store.finished`). On
onnxruntime 1.32 the reload still packs every weight whose saved blob it uses, to compare the two
(``SessionState`` ``ValidatePrePackedWeights``), so creation costs about what packing costs. Two ways
to make that cheaper were asked about: ORT's parallel pre-packing (``session.prepack.enable_parallel``:
the kernels' ``PrePack`` calls spread over the intra-op thread pool, where more than one node packs,
the pool has more than one thread and no shared pre-packed container is in use) and a config entry that
skips the comparison. onnxruntime 1.31.1 and 1.32.0 define the first and no such second one (the
libraries' own key strings: ``session.disable_prepacking``,
``session.save_external_prepacked_constant_initializers``, ``session.prepack.enable_parallel``;
1.30.0 defines neither the parallel key nor the comparison), so the variants measured are the default
and the parallel key at ORT's default intra-op thread count (and, with ``--threads N``, both at N). The
comparison stays on with the key: a flipped byte in a saved blob is refused either way on 1.32.0.

What it does: writes a native int4 MatMulNBits decoder (:mod:`ortmem.measure.synth`, external data), has ORT
finish it at the default level (``optimized_model_filepath`` with
``session.optimized_model_external_initializers_file_name``,
``session.optimized_model_external_initializers_min_size_in_bytes`` 128 and
``session.save_external_prepacked_constant_initializers`` 1), then starts one fresh interpreter per
variant and round (``sync`` before each; the variants' order rotates every round) that creates a
session on the finished model at ``ORT_DISABLE_ALL``, runs it once on a fixed feed and reports the
creation time (``InferenceSession`` alone), the process's wall time and RssAnon after creation and
the run. Outputs of every start are compared with the first default start's (max |diff|). One verbose
start per variant shows whether ORT took the parallel path (its log line "Pre-packing constant
initializers using the intra-op thread pool.").

Run: ``python -m bench.finished_creation`` (from the repository root; ``--preset llama_0_6gb`` for
the 0.6 GB decoder, ``--rounds N``, ``--workers N`` for N processes starting at once, ``--work DIR`` to
keep the models, ``--json``); another release: ``PYTHONPATH=. OTHER_VENV/bin/python -m
bench.finished_creation`` (that venv needs onnxruntime, numpy and onnx; the finished model is made by
the release that loads it). Creation times on a shared machine drift: read the per-round ratios to the
default, not single times, and the load average printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

#: The session config entry ORT (>= 1.31) reads to pre-pack on the intra-op thread pool.
PARALLEL_KEY = "session.prepack.enable_parallel"
#: ORT's log line when it takes the parallel path (session_state.cc, VERBOSE).
PARALLEL_LOG = "Pre-packing constant initializers using the intra-op thread pool."
#: What a finished model is saved with (ortmem's own save uses the same entries).
SAVE_ENTRIES = {"session.optimized_model_external_initializers_file_name": "finished.data",
                "session.optimized_model_external_initializers_min_size_in_bytes": "128",
                "session.save_external_prepacked_constant_initializers": "1"}


def variants(threads: int) -> dict[str, dict[str, Any]]:
    """Each measured start: its config entries and intra-op thread count (0: ORT's default)."""
    out = {"default": {"config": {}, "threads": 0},
           "parallel": {"config": {PARALLEL_KEY: "1"}, "threads": 0}}
    if threads:
        out[f"default-t{threads}"] = {"config": {}, "threads": threads}
        out[f"parallel-t{threads}"] = {"config": {PARALLEL_KEY: "1"}, "threads": threads}
    return out


def build(work: Path, preset: str) -> tuple[Path, Path]:
    """The native decoder and ORT's finished save of it, in ``work`` (made once, reused)."""
    import onnxruntime as ort

    from ortmem.measure.synth import SynthConfig, write_model

    source = work / "native" / "model.onnx"
    finished = work / "finished" / "finished.onnx"
    if not source.exists():
        source.parent.mkdir(parents=True, exist_ok=True)
        config = getattr(SynthConfig, preset)(form="native", storage="external")
        write_model(config, source)
    if not finished.exists():
        finished.parent.mkdir(parents=True, exist_ok=True)
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(finished)
        for key, value in SAVE_ENTRIES.items():
            so.add_session_config_entry(key, value)
        ort.InferenceSession(str(source), so, providers=["CPUExecutionProvider"])
    return source, finished


def feeds_for(session: Any, source: Path) -> dict[str, Any]:
    """A fixed feed: a decoder's first step (empty cache), floats from a fixed seed, token ids 0."""
    from ortmem.ort.feeds import decoder_dims, make_inputs

    return make_inputs(session, {"int_high": 1, "dims": decoder_dims(source)})


def status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (RssAnon: private memory, what a start keeps on its heap;
    VmHWM: the peak resident set, mapped file pages included)."""
    return _field(Path("/proc/self/status").read_text(), field)


def child(args: argparse.Namespace) -> int:
    """One start: create a session on the finished model, run it once, write what was measured."""
    import numpy as np
    import onnxruntime as ort

    spec = json.loads(args.spec)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 0 if args.verbose else 3
    for key, value in spec["config"].items():
        so.add_session_config_entry(key, value)
    if spec["threads"]:
        so.intra_op_num_threads = spec["threads"]
    t0 = time.perf_counter()
    session = ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
    create_s = time.perf_counter() - t0
    outputs = session.run(None, feeds_for(session, Path(args.source)))
    kept = status_bytes("RssAnon")
    from ortmem.base.hygiene import trim

    trim()  # malloc_trim(0): what ortmem does after a creation; freed heap in any arena goes back
    measured = {"create_s": create_s, "rss_anon": kept, "rss_anon_trimmed": status_bytes("RssAnon"),
                "peak_rss": status_bytes("VmHWM")}
    np.savez(args.out + ".npz", *outputs)
    Path(args.out + ".json").write_text(json.dumps(measured))
    return 0


def start(name: str, spec: dict[str, Any], model: Path, source: Path, out: Path, verbose: bool = False,
          workers: int = 1) -> dict[str, Any]:
    """Run one start in a fresh interpreter after ``sync`` (``workers`` > 1: that many at once, as worker
    processes of one service start; the figures are the first one's, its creation time the median of
    all); its figures and output file."""
    subprocess.run(["sync"], check=True)
    outs = [out if i == 0 else Path(f"{out}-w{i}") for i in range(workers)]
    cmds = [[sys.executable, "-m", "bench.finished_creation", "--child", "--spec", json.dumps(spec),
             "--model", str(model), "--source", str(source), "--out", str(o)] + (["--verbose"] if verbose else [])
            for o in outs]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err if i == 0 else subprocess.DEVNULL,
                                  text=True, cwd=Path(__file__).resolve().parent.parent)
                 for i, cmd in enumerate(cmds)]
        proc = procs[0]
        peak_anon = 0
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:  # its RssAnon every 5 ms: the private peak (VmHWM counts mapped file pages)
            try:
                peak_anon = max(peak_anon, _field(status.read_text(), "RssAnon"))
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        codes = [p.wait() for p in procs]
        err.seek(0)
        log = err.read()
    if any(codes):
        raise RuntimeError(f"{name} start failed ({codes}): {log[-2000:]}")
    got = json.loads(Path(str(out) + ".json").read_text())
    if workers > 1:
        got["create_s"] = statistics.median(json.loads(Path(str(o) + ".json").read_text())["create_s"] for o in outs)
    return {**got, "wall_s": wall, "peak_anon": peak_anon, "outputs": str(out) + ".npz", "log": log if verbose else ""}


def _field(status: str, field: str) -> int:
    """A field of a /proc/PID/status text, in bytes (0 where absent)."""
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def max_diff(a: str, b: str) -> float:
    """Largest |difference| between two starts' outputs (inf where their shapes differ)."""
    import numpy as np

    with np.load(a) as x, np.load(b) as y:
        if sorted(x.files) != sorted(y.files):
            return float("inf")
        worst = 0.0
        for k in x.files:
            if x[k].shape != y[k].shape:
                return float("inf")
            if x[k].size:
                worst = max(worst, float(np.max(np.abs(x[k].astype(np.float64) - y[k].astype(np.float64)))))
        return worst


def summarize(runs: dict[str, list[dict[str, Any]]], figure: str) -> dict[str, dict[str, float]]:
    """Fastest and median of ``figure`` per variant, and the median and fastest of its per-round
    ratios to the default start of the same round."""
    base = runs["default"]
    out: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        values = [r[figure] for r in rs]
        ratios = [r[figure] / b[figure] for r, b in zip(rs, base)]
        out[name] = {"min": min(values), "median": statistics.median(values),
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="demo", help="ortmem.measure.synth preset (demo, llama_0_6gb, ...)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=0,
                   help="explicit intra-op threads of the -tN variants (0: none)")
    p.add_argument("--workers", type=int, default=1,
                   help="start this many processes at once per start (worker processes of one service)")
    p.add_argument("--work", help="folder for the models (default: a new temporary one, removed)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)

    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="finished-creation-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        source, finished = build(work, args.preset)
        build_s = time.perf_counter() - t0
        specs = variants(args.threads)
        names = list(specs)
        outdir = work / "starts"
        outdir.mkdir(exist_ok=True)
        parallel_taken = {}
        for name in names:  # one verbose start each, untimed: which path ORT took
            r = start(name, specs[name], finished, source, outdir / f"verbose-{name}", verbose=True)
            parallel_taken[name] = PARALLEL_LOG in r["log"]
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for i in range(args.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                runs[name].append(start(name, specs[name], finished, source, outdir / f"r{i}-{name}",
                                        workers=args.workers))
        reference = runs["default"][0]["outputs"]
        diffs = {n: max(max_diff(reference, r["outputs"]) for r in rs) for n, rs in runs.items()}
        result = {"onnxruntime": ort.__version__, "preset": args.preset, "rounds": args.rounds, "workers": args.workers,
                  "cpus": os.cpu_count(), "build_s": build_s,
                  "finished_bytes": sum(f.stat().st_size for f in finished.parent.iterdir()),
                  "variants": specs, "parallel_path_taken": parallel_taken, "max_abs_diff": diffs,
                  "create_s": summarize(runs, "create_s"), "wall_s": summarize(runs, "wall_s"),
                  **{f"{f}_mib": {n: statistics.median(r[f] for r in rs) / 2**20 for n, rs in runs.items()}
                     for f in ("rss_anon", "rss_anon_trimmed", "peak_rss", "peak_anon")},
                  "raw": {n: [{k: v for k, v in r.items() if k != "outputs" and k != "log"} for r in rs]
                          for n, rs in runs.items()}}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"onnxruntime {result['onnxruntime']}, {args.preset} native int4 decoder finished "
          f"({result['finished_bytes'] / 2**20:.0f} MiB of files), {args.rounds} rounds, {result['cpus']} CPUs, "
          f"{args.workers} process(es) at once, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'variant':<12} {'parallel':>8} {'create min':>10} {'median':>7} {'/default':>8} {'(range)':>13} "
          f"{'wall med':>8} {'/default':>8} {'RssAnon':>8} {'trimmed':>8} {'peak RSS':>8} {'peak anon':>9} "
          f"{'max|diff|':>9}")
    for n in names:
        c, w = result["create_s"][n], result["wall_s"][n]
        print(f"{n:<12} {str(parallel_taken[n]):>8} {c['min']:>9.3f}s {c['median']:>6.3f}s {c['ratio_median']:>8.3f} "
              f"{c['ratio_min']:>6.3f}..{c['ratio_max']:<6.3f} {w['median']:>7.3f}s {w['ratio_median']:>8.3f} "
              f"{result['rss_anon_mib'][n]:>6.1f}Mi {result['rss_anon_trimmed_mib'][n]:>6.1f}Mi "
              f"{result['peak_rss_mib'][n]:>6.0f}Mi {result['peak_anon_mib'][n]:>7.0f}Mi {diffs[n]:>9.3g}")
    print("create: InferenceSession alone; wall: the whole fresh process; /default: median of the per-round ratios "
          "to the same round's default start; RssAnon after creation and one run, then after malloc_trim(0); "
          "peak RSS: VmHWM (mapped file pages included); peak anon: RssAnon sampled every 5 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
