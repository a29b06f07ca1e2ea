"""silero-vad's ONNX model (shipped in its wheel, 2.3 MB, weights inside ``If`` branches) created and
run the way the package's ``OnnxWrapper`` does (its own SessionOptions, one thread each), without
importing the package (it needs torch): speech probabilities of a synthetic signal, JSON on stdout."""
import json
import os
import sysconfig

import numpy as np
import onnxruntime

path = os.path.join(sysconfig.get_paths()["purelib"], "silero_vad", "data", "silero_vad.onnx")
opts = onnxruntime.SessionOptions()
opts.inter_op_num_threads = 1
opts.intra_op_num_threads = 1
session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"], sess_options=opts)
rng = np.random.default_rng(0)
state = np.zeros((2, 1, 128), dtype=np.float32)
probs = []
for i in range(20):
    chunk = (0.3 * np.sin(np.arange(512) * (0.05 + 0.01 * i)) + 0.05 * rng.standard_normal(512)).astype(np.float32)
    out, state = session.run(None, {"input": chunk[None, :], "state": state, "sr": np.array(16000, dtype=np.int64)})
    probs.append(round(float(out[0, 0]), 5))
print(json.dumps({"probabilities": probs}))
