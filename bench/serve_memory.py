"""Memory of the server recipe: gunicorn with N uvicorn workers serving ortmem.serve.server, summed PSS.

    python -m bench.serve_memory MODEL [--workers 4] [--engine ortmem --engine ort] [--preload both]

For each (engine, preload) it starts the server on a free loopback port, waits until every worker
has loaded the app (uvicorn logs "Application startup complete" once per worker), sends a few
requests, then sums PSS over the master and its workers from /proc/<pid>/smaps_rollup, private
(Pss_Anon + Pss_Shmem) and shared (Pss_File) apart, and stops the server. Prints a markdown table.
Run the ortmem engine once before (or let the first row pay the conversion): its rows measure warm
starts only when the cache already holds the entry and its pre-packed weights.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import onnxruntime as ort

from ortmem.base import procfs
from ortmem.ort.feeds import make_inputs
from ortmem.serve.server import encode

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model: str, engine: str, workers: int, preload: bool, requests: int = 8) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "gunicorn", "-w", str(workers), "-k", "uvicorn_worker.UvicornWorker",
           "--bind", f"127.0.0.1:{port}", "--timeout", "600"] + (["--preload"] if preload else []) + ["ortmem.serve.server:app"]
    env = {**os.environ, "ORTMEM_SERVE_MODEL": model, "ORTMEM_SERVE_ENGINE": engine}
    with tempfile.NamedTemporaryFile("w+b", suffix=".log") as log:
        t0 = time.monotonic()
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while log.seek(0) is not None and log.read().count(b"Application startup complete") < workers:
                if server.poll() is not None or time.monotonic() - t0 > 900:
                    log.seek(0)
                    raise RuntimeError(log.read()[-3000:].decode("utf-8", "replace"))
                time.sleep(0.1)
            ready_s = time.monotonic() - t0
            sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
            body = json.dumps({"inputs": {k: encode(v) for k, v in make_inputs(sess, {}).items()}}).encode()
            del sess
            for _ in range(requests):
                req = urllib.request.Request(f"http://127.0.0.1:{port}/run", data=body,
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=120).read()
            pids = [server.pid, *procfs.descendants(server.pid)]
            rollups = [procfs.read_smaps_rollup(p) or {} for p in pids]
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    private = sum(r.get("Pss_Anon", 0) + r.get("Pss_Shmem", 0) for r in rollups)
    shared = sum(r.get("Pss_File", 0) for r in rollups)
    return {"engine": engine, "preload": preload, "workers": workers, "processes": len(pids),
            "pss": private + shared, "private": private, "shared": shared, "ready_s": ready_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--engine", action="append", choices=["ortmem", "ort"])
    ap.add_argument("--preload", choices=["no", "yes", "both"], default="both")
    args = ap.parse_args()
    preloads = {"no": [False], "yes": [True], "both": [False, True]}[args.preload]
    print(f"onnxruntime {ort.__version__}, {args.workers} workers, {os.path.basename(args.model)}")
    print("| engine | --preload | processes | total PSS MiB | private MiB | shared MiB | ready s |")
    print("|---|---|---|---|---|---|---|")
    for engine in args.engine or ["ort", "ortmem"]:
        for preload in preloads:
            r = measure(os.path.abspath(args.model), engine, args.workers, preload)
            print(f"| {engine} | {'yes' if preload else 'no'} | {r['processes']} | {r['pss'] / MiB:.0f} | "
                  f"{r['private'] / MiB:.0f} | {r['shared'] / MiB:.0f} | {r['ready_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
