"""What building a cache entry costs (a cold start's conversion), and how much of it is digests.

    python -m bench.cold_entry                 # demo model (0.24 GB of int4 codes), 7 fresh processes
    python -m bench.cold_entry --repeat 11 --size 0.6
    python -m bench.cold_entry --repeat 6 --size 0.6 --threads 2,3   # thread counts, alternated

Each run converts the model into a new cache folder in a fresh process (``convert_cached``: plan,
write weights.bin and model.onnx, digest, publish) and reports, as medians and minimums over the runs:

* ``cold_s``: the whole build,
* ``write_s``: the conversion report's seconds (weights.bin and model.onnx written, and hashed
  while written where the entry needs their digests),
* ``read_digest_s``: seconds spent in :func:`ortmem.files.digest.file_digest`, i.e. reading files to
  digest them (the sources' content digests; entry files are no longer read back).

``--threads N,M``: convert on each of these thread counts instead of
:func:`ortmem.passes.writers.conversion_threads`'s, alternated run by run (a table per count).

The model is generated once by this process and its path handed to each child, so a child imports
only ortmem (its imports, and the load, happen before the timed build).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import functools, json, sys, tempfile, time
from pathlib import Path
import ortmem
from ortmem.passes.engine import write_weights
from ortmem.files import digest
from ortmem.store import writer
from ortmem.store.cache import Cache
from ortmem.session.convert import convert_cached
from ortmem.ort.settings import session_settings

model = sys.argv[1]
if sys.argv[3] != "default":
    writer.write_weights = functools.partial(write_weights, threads=int(sys.argv[3]))
spent = [0.0]
real = digest.file_digest

def timed(*a, **k):
    t = time.perf_counter()
    try:
        return real(*a, **k)
    finally:
        spent[0] += time.perf_counter() - t

digest.file_digest = timed
with tempfile.TemporaryDirectory(dir=sys.argv[2]) as tmp, ortmem.load(model) as m:
    t = time.perf_counter()
    entry, hit, report = convert_cached(m, session_settings(), Cache(Path(tmp)))
    cold = time.perf_counter() - t
    assert entry is not None and not hit
print(json.dumps({"cold_s": cold, "write_s": report.seconds, "read_digest_s": spent[0]}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--size", default="demo", help="bench.synth_models preset: demo, 0.6, 1.6")
    ap.add_argument("--threads", default="default", help="comma-separated thread counts, alternated")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    from bench.synth_models import synth_model
    from ortmem.store.cache import cache_root

    model = synth_model(args.size)  # generated once, outside the timed runs
    counts = args.threads.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in counts}
    with tempfile.TemporaryDirectory(dir=cache_root()) as work:
        for i in range(args.repeat):
            for count in counts[i % len(counts):] + counts[: i % len(counts)]:  # rotated per round
                os.sync()
                r = subprocess.run([sys.executable, "-c", _CHILD, model, work, count], capture_output=True,
                                   text=True, check=True, env=os.environ.copy())
                runs[count].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"onnxruntime {ort.__version__}, model {args.size}, {args.repeat} fresh processes per thread count")
    for count, results in runs.items():
        print(f"threads: {count}")
        for key in ("cold_s", "write_s", "read_digest_s"):
            values = [r[key] for r in results]
            print(f"  {key:14s} median {statistics.median(values):.3f}  min {min(values):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
