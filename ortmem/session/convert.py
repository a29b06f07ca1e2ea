"""Conversion as a stage of the commands: a loaded model in, a self-contained MatMulNBits model folder out.

``ortmem convert`` writes the folder into a folder of the user's (:func:`convert_to`), ``ortmem
prepare`` into the cache (:func:`convert_cached`). The folder itself (``model.onnx`` + ``weights.bin``)
is written by the store's writer (:mod:`ortmem.store.writer`); keys, lookups, source records and
publishing are the store's (:mod:`ortmem.store.verdict`, :mod:`ortmem.store.publish`). A session start reaches the same writer
through the store alone.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from ortmem.store.cache import Cache
from ortmem.files.layout import Entry
from ortmem.store.publish import publish
from ortmem.store.verdict import start
from ortmem.store.writer import write_converted
from ortmem.errors import CacheError, ConversionError
from ortmem.onnxfile.model import Model
from ortmem.passes.engine import plan_conversion
from ortmem.passes.conversion_report import ConversionReport
from ortmem.passes.writers import Progress
from ortmem.ort.settings import OrtSettings

log = logging.getLogger(__name__)


def convert_cached(model: Model, settings: OrtSettings, cache: Cache, *, progress: Optional[Progress] = None,
                   fp16_in_fp32: Optional[bool] = None) -> tuple[Optional[Entry], bool, Optional[ConversionReport]]:
    """(entry, hit, report): the cached conversion of ``model``, built if missing (``ortmem prepare``).

    Returns ``(None, False, None)`` when nothing in the model is convertible; raises :class:`CacheError`
    when the store cannot hold an entry for it (found damaged again after a rebuild). Concurrent creators of
    one entry meet at its creator lock (:func:`ortmem.store.publish.publish`); a holder that takes
    longer than :func:`ortmem.store.cache.lock_timeout` raises :class:`ortmem.store.cache.LockBusyError`.
    """
    found = start(cache, model.path, settings=settings, fp16_in_fp32=fp16_in_fp32)
    if found.hit:
        return found.entry, True, None
    plan = plan_conversion(model, settings, fp16_in_fp32=fp16_in_fp32)
    if not plan.has_work:
        return None, False, None
    published = publish(cache, model, plan, settings=settings, progress=progress, fp16_in_fp32=fp16_in_fp32)
    if published.path is None:  # the entry was found damaged twice: not "nothing to convert"
        raise CacheError(f"the cache entry for {model.path} was damaged again after a rebuild", file=str(cache.root))
    return published.entry, published.hit, published.report


def convert_to(model: Model, out_dir: Path, settings: OrtSettings, *, progress: Optional[Progress] = None) -> ConversionReport:
    """``ortmem convert``: write the converted model into ``out_dir`` (created; must be empty or new).

    Written into a temporary sibling folder and renamed, so a failure leaves no half-written output.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConversionError("output folder is not empty", file=str(out_dir))
    plan = plan_conversion(model, settings)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        report = write_converted(model, plan, tmp, progress=progress, mode=0o666)
        (tmp / "conversion.json").write_text(json.dumps({"summary": report.summary()}, indent=1))
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
