"""An unmodified rapidocr_onnxruntime (PyPI) run: text found in a rendered image, as JSON on stdout.

The library creates its three sessions (detection, classification, recognition) from the models in
its wheel with ``from onnxruntime import InferenceSession`` bound at import time, and its own
``SessionOptions``.
"""
import json

import cv2
import numpy as np
from rapidocr_onnxruntime import RapidOCR

img = np.full((160, 640, 3), 255, dtype=np.uint8)
cv2.putText(img, "ortmem maps weights", (20, 60), cv2.FONT_HERSHEY_SIMPLEX, 1.4, (0, 0, 0), 3)
cv2.putText(img, "HOOK 2026", (20, 130), cv2.FONT_HERSHEY_SIMPLEX, 1.4, (0, 0, 0), 3)

engine = RapidOCR()
result, _ = engine(img)
print(json.dumps([[box, text, round(float(score), 6)] for box, text, score in result or []], sort_keys=True))
