"""The reference every ortmem output is compared with: the original model run by plain ORT on the CPU
(no ortmem code on the way), with the caller's options where the test has any. The class is ORT's own
as ortmem captured it before any hook (:mod:`ortmem.base.ort_class`), so a reference taken while
``ortmem.hook()`` is on is still plain ORT's."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np
import onnxruntime as ort

from ortmem.base import ort_class

CPU = ["CPUExecutionProvider"]


def run_plain(model: Union[str, Path, bytes], feeds: Mapping[str, np.ndarray],
              options: Optional[ort.SessionOptions] = None) -> list[np.ndarray]:
    """Every output of ``model`` (a path, or a serialized model's bytes) for ``feeds``, from a plain
    ``onnxruntime.InferenceSession`` with ``options`` (ORT's defaults when None)."""
    source = model if isinstance(model, bytes) else str(model)
    return ort_class.ORT_SESSION(source, options, providers=CPU).run(None, dict(feeds))
