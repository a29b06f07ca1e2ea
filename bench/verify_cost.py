"""What a full check of a cache entry costs: hash speed per GB, and its share of a warm start.

    python -m bench.verify_cost              # demo model (0.5 GB entry), 5 warm starts per mode
    python -m bench.verify_cost --quick      # hashes only

1. Each hash over an in-memory buffer (s/GB): what the algorithm alone costs.
2. ``ortmem.files.digest.file_digest`` over a hot entry file (s/GB): hash plus reading the page cache.
3. Warm starts (session creation, cache hit, no pre-packing so the entry itself is checked) of the
   demo model with ``verify="full"``, ``"sampled"`` and ``"off"``, each in a fresh process, best of
   ``--repeat``: the full check's share of the warm start.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def hash_speeds(mib: int = 256) -> dict[str, float]:
    buf = os.urandom(mib << 20)
    view = memoryview(buf)
    makers = {"sha256": hashlib.sha256, "blake2b": lambda: hashlib.blake2b(digest_size=16)}
    try:
        import xxhash

        makers["xxh3_128"] = xxhash.xxh3_128
    except ImportError:
        pass
    out = {}
    for name, make in makers.items():
        h = make()
        t = time.perf_counter()
        for i in range(0, len(buf), 8 << 20):
            h.update(view[i : i + (8 << 20)])
        out[name] = (time.perf_counter() - t) / (mib / 1024)
    return out


_CHILD = r"""
import json, sys, time
t = time.perf_counter()
import ortmem
sess = ortmem.InferenceSession(sys.argv[1], prepacked=False, verify=sys.argv[2])
print(json.dumps({"hit": sess.ortmem_cache_hit, "seconds": time.perf_counter() - t}))
"""


def warm_start(model: str, mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, model, mode], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, python {sys.version.split()[0]}")
    for name, s in hash_speeds().items():
        print(f"hash {name:9s} in memory: {s:.3f} s/GB")
    if args.quick:
        return 0
    from bench.synth_models import synth_model

    from ortmem.files.digest import file_digest

    model = synth_model("demo")
    cold = warm_start(model, "full")  # builds the entry if it is not there yet
    entry = next(Path(os.environ.get("ORTMEM_CACHE_DIR", tempfile.gettempdir())).glob("converted/*/weights.bin"), None)
    if entry is not None:
        size = entry.stat().st_size
        file_digest(entry)  # hot
        t = time.perf_counter()
        file_digest(entry)
        print(f"file_digest of a hot {size / 2**30:.2f} GiB weights.bin: {(time.perf_counter() - t) / (size / 2**30):.3f} s/GB")
    print(f"first session (hit={cold['hit']}): {cold['seconds']:.2f} s")
    best = {}
    for mode in ("off", "sampled", "full"):
        runs = [warm_start(model, mode) for _ in range(args.repeat)]
        assert all(r["hit"] for r in runs)
        best[mode] = min(r["seconds"] for r in runs)
        print(f"warm start verify={mode:7s}: best {best[mode]:.3f} s of {args.repeat}")
    print(f"full check share of the warm start: {(best['full'] - best['off']) / best['full']:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
