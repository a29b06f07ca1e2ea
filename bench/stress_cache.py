"""The cache stress run: every start must give ORT's own outputs.

    python -m bench.stress_cache                         # all cases, about 5 minutes on 2 cores
    python -m bench.stress_cache --only kill --kills 80  # one case, more of it

Cases, each in fresh processes on a fresh cache folder, against plain ORT's outputs on the same QDQ
model (bit-identical, same accuracy level):

- ``concurrent``: 2, 4 and 8 cold starts at once on one empty cache, then one more start that must
  find the entry;
- ``kill``: a cold start (conversion, publishing, first run, the background packer) killed with
  SIGKILL (its whole process group) at evenly spread moments of its life, then two restarts on the
  same cache;
- ``full-disk``: the cache on a small tmpfs (root only; skipped otherwise) of sizes from far too small
  to just enough, two starts each; a start may warn, never fail or give other outputs;
- ``stopped``: a cold start SIGSTOPped while it works on the entry; a second start must finish within
  ortmem's lock limit (``--lock-limit``, as ``$ORTMEM_LOCK_TIMEOUT``) and the time of a start, not
  wait for the stopped one.

Prints one line per stage and a summary; exits 1 on any wrong output, crash or overlong wait.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ortmem.store.cache import LOCK_TIMEOUT_ENV

#: One start in a fresh interpreter: create, run, save the output, wait for ortmem's background packer.
CHILD = r"""
import sys, numpy as np, ortmem
from ortmem.store import finisher
sess = ortmem.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
np.save(sys.argv[2], sess.run(None, {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)})[0])
print("action", sess.ortmem_action, flush=True)
finisher.wait_background(120)
"""
FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


@dataclass
class Tally:
    """Starts tried and what went wrong, per case."""

    starts: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def build_model(folder: Path) -> tuple[Path, np.ndarray]:
    """A small QDQ Llama-shaped model (a few MiB, so a cold start has phases worth killing) and
    plain ORT's output on it."""
    import onnxruntime as ort

    from ortmem.measure.synth import SynthConfig, write_model

    folder.mkdir(parents=True, exist_ok=True)
    path = write_model(SynthConfig.tiny(hidden=512, intermediate=1408, layers=4, storage="external"),
                       folder / "model.onnx")
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    return path, expected


def start(model: Path, cache: Path, out: Path, env_extra: Optional[dict[str, str]] = None, **popen) -> subprocess.Popen:
    env = dict(os.environ, ORTMEM_CACHE_DIR=str(cache), **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(out)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def judge(proc: subprocess.Popen, out: Path, expected: np.ndarray, what: str, tally: Tally, timeout: float = 300) -> float:
    """Wait for one start and record whether it gave ORT's output; returns its wall time."""
    t0 = time.perf_counter()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        tally.failures.append(f"{what}: no answer within {timeout:.0f} s")
        return time.perf_counter() - t0
    tally.starts += 1
    if proc.returncode != 0:
        tally.failures.append(f"{what}: exit {proc.returncode}: {err.strip().splitlines()[-1:] }")
    elif not out.exists() or not np.array_equal(np.load(out), expected):
        tally.failures.append(f"{what}: output differs from ORT's")
    elif "Traceback" in err:
        tally.failures.append(f"{what}: a traceback on stderr")
    out.unlink(missing_ok=True)
    return time.perf_counter() - t0


def concurrent(model: Path, expected: np.ndarray, work: Path, rounds: int, say) -> Tally:
    tally = Tally()
    for n in (2, 4, 8):
        for r in range(rounds):
            cache = work / f"c-{n}-{r}"
            procs = [(start(model, cache, work / f"o{i}.npy"), work / f"o{i}.npy") for i in range(n)]
            for i, (p, out) in enumerate(procs):
                judge(p, out, expected, f"{n} at once, round {r}, start {i}", tally)
            judge(start(model, cache, work / "o.npy"), work / "o.npy", expected, f"{n} at once, round {r}, after", tally)
            shutil.rmtree(cache, ignore_errors=True)
        say(f"concurrent: {n} at once x {rounds} rounds done, {len(tally.failures)} failures so far")
    return tally


def kill(model: Path, expected: np.ndarray, work: Path, kills: int, say) -> Tally:
    tally = Tally()
    probe_cache = work / "c-timing"
    t0 = time.perf_counter()
    judge(start(model, probe_cache, work / "o.npy"), work / "o.npy", expected, "timing run", tally)
    life = time.perf_counter() - t0
    shutil.rmtree(probe_cache, ignore_errors=True)
    say(f"kill: a cold start lives {life:.2f} s; {kills} kills spread over it")
    for k in range(kills):
        cache = work / f"c-kill-{k}"
        delay = life * (k + 0.5) / kills
        proc = start(model, cache, work / "o.npy", start_new_session=True)
        time.sleep(delay)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        (work / "o.npy").unlink(missing_ok=True)
        for again in range(2):
            judge(start(model, cache, work / "o.npy"), work / "o.npy", expected,
                  f"restart {again + 1} after a kill at {delay:.2f} s", tally)
        shutil.rmtree(cache, ignore_errors=True)
        if (k + 1) % 10 == 0:
            say(f"kill: {k + 1}/{kills} kills, {len(tally.failures)} failures so far")
    return tally


def full_disk(model: Path, expected: np.ndarray, work: Path, sizes_kib: list[int], say) -> Tally:
    tally = Tally()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        tally.notes.append("skipped: mounting a tmpfs needs root")
        return tally
    for size in sizes_kib:
        mount = work / f"tmpfs-{size}"
        mount.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}k,mode=0700", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            tally.notes.append(f"skipped: mount refused ({done.stderr.strip()})")
            mount.rmdir()
            return tally
        try:
            for again in range(2):
                proc = start(model, mount / "cache", work / "o.npy")
                judge(proc, work / "o.npy", expected, f"{size} KiB disk, start {again + 1}", tally)
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)
            mount.rmdir()
        say(f"full-disk: {size} KiB done, {len(tally.failures)} failures so far")
    return tally


def stopped(model: Path, expected: np.ndarray, work: Path, delays: list[float], limit_s: float, say) -> Tally:
    tally = Tally()
    for delay in delays:
        cache = work / f"c-stop-{delay}"
        holder = start(model, cache, work / "held.npy", start_new_session=True)
        time.sleep(delay)
        try:
            os.killpg(holder.pid, signal.SIGSTOP)
            wall = judge(start(model, cache, work / "o.npy", {LOCK_TIMEOUT_ENV: str(limit_s)}), work / "o.npy", expected,
                         f"a start beside one stopped at {delay:.2f} s", tally, timeout=limit_s + 120)
            if wall > limit_s + 60:
                tally.failures.append(f"stopped at {delay:.2f} s: the other start took {wall:.1f} s")
            tally.notes.append(f"stopped at {delay:.2f} s: the other start took {wall:.2f} s")
        finally:
            try:
                os.killpg(holder.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            holder.communicate()
            shutil.rmtree(cache, ignore_errors=True)
        say(f"stopped: holder stopped at {delay:.2f} s done")
    return tally


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["concurrent", "kill", "full-disk", "stopped"], action="append")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each concurrency (2, 4, 8 at once)")
    ap.add_argument("--kills", type=int, default=40)
    ap.add_argument("--lock-limit", type=float, default=10.0, help=f"${LOCK_TIMEOUT_ENV} for the 'stopped' case")
    args = ap.parse_args(argv)
    import onnxruntime as ort


    def say(line: str) -> None:
        print(line, flush=True)

    cases = args.only or ["concurrent", "kill", "full-disk", "stopped"]
    results: dict[str, Tally] = {}
    with tempfile.TemporaryDirectory(prefix="ortmem-stress-") as d:
        work = Path(d)
        model, expected = build_model(work / "model")
        say(f"model {model} ({sum(f.stat().st_size for f in model.parent.iterdir()) / 2**20:.1f} MiB), "
            f"onnxruntime {ort.__version__}")
        if "concurrent" in cases:
            results["concurrent"] = concurrent(model, expected, work, args.rounds, say)
        if "kill" in cases:
            results["kill"] = kill(model, expected, work, args.kills, say)
        if "full-disk" in cases:
            results["full-disk"] = full_disk(model, expected, work, [64, 256, 1024, 2048, 4096, 8192, 16384, 65536], say)
        if "stopped" in cases:
            results["stopped"] = stopped(model, expected, work, [0.3, 0.8, 1.5, 3.0], args.lock_limit, say)
    bad = 0
    for name, tally in results.items():
        print(f"{name}: {tally.starts} starts, {len(tally.failures)} failures")
        for line in tally.notes:
            print(f"  note: {line}")
        for line in tally.failures:
            print(f"  FAIL: {line}")
        bad += len(tally.failures)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
