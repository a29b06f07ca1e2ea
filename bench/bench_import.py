"""What ``import ortmem`` costs above ``import onnxruntime``, and what the session path loads, in fresh
interpreters (medians of 7). Goal (issue: a thin ``import ortmem``): <= 5 MiB RSS and <= 60 ms above
``import onnxruntime``.

Run: ``python -m bench.bench_import`` (a table) or ``pytest bench/bench_import.py --benchmark-only``.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

_CHILD = """
import json, sys, time
def rss():
    return {k: int(v.split()[0]) for k, v in (l.split(':', 1) for l in open('/proc/self/status'))
            if k in ('VmRSS', 'RssAnon')}
import onnxruntime
before, t = rss(), time.perf_counter()
exec(sys.argv[1])
dt, after = time.perf_counter() - t, rss()
print(json.dumps({"ms": dt * 1000, "rss_kib": after['VmRSS'] - before['VmRSS'],
                  "anon_kib": after['RssAnon'] - before['RssAnon'],
                  "loaded": sorted(m for m in ('onnx', 'matplotlib', 'memray', 'rich', 'ortmem.plan.estimate',
                                               'ortmem.plan.partition', 'ortmem.plan.partition.run.pipeline_session') if m in sys.modules)}))
"""

CASES = {
    "import ortmem": "import ortmem",
    "import ortmem; ortmem.InferenceSession": "import ortmem; ortmem.InferenceSession",
}


def measure(code: str, repeat: int = 7) -> dict:
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD, code], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(repeat)]
    return {"ms": statistics.median(r["ms"] for r in runs), "rss_mib": statistics.median(r["rss_kib"] for r in runs) / 1024,
            "anon_mib": statistics.median(r["anon_kib"] for r in runs) / 1024, "loaded": runs[0]["loaded"]}


def test_import_cost(benchmark):
    result = benchmark.pedantic(lambda: measure("import ortmem", 3), rounds=1, iterations=1)
    benchmark.extra_info.update(result)


if __name__ == "__main__":
    print(f"{'above import onnxruntime':45}{'ms':>8}{'RSS MiB':>10}{'anon MiB':>10}  modules loaded")
    for label, code in CASES.items():
        r = measure(code)
        print(f"{label:45}{r['ms']:8.1f}{r['rss_mib']:10.1f}{r['anon_mib']:10.1f}  {', '.join(r['loaded']) or '-'}")
