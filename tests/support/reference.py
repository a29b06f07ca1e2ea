"""The reference every ortmem output is compared with: the original model run by plain ORT on the CPU
(no ortmem code on the way), with the caller's options where the test has any."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np
import onnxruntime as ort

CPU = ["CPUExecutionProvider"]


def run_plain(model: Union[str, Path], feeds: Mapping[str, np.ndarray],
              options: Optional[ort.SessionOptions] = None) -> list[np.ndarray]:
    """Every output of ``model`` for ``feeds``, from a plain ``onnxruntime.InferenceSession``."""
    return ort.InferenceSession(str(model), options, providers=CPU).run(None, dict(feeds))
