"""Create one ORT session under bench/estimator/mtrace.c (LD_PRELOAD) with markers around creation and the first run."""
import ctypes, os, sys
lib = ctypes.CDLL(os.environ["MTRACE_SO"])
mark = lambda m: lib.mtrace_mark(m.encode())
import numpy as np, onnxruntime as ort
def rss():
    for l in open("/proc/self/status"):
        if l.startswith(("VmRSS", "VmHWM", "RssAnon")): print(l.strip(), file=sys.stderr)
path = sys.argv[1]
rss(); mark("create")
s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
mark("created"); rss()
s.run(None, {"image": np.zeros((1, 3, 224, 224), np.float32)})
mark("ran"); rss()
