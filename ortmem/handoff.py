"""Hand a model to ONNX Runtime so that ORT never copies its weights.

ORT memory-maps external data per tensor and drops each mapping once the kernel has pre-packed it,
but it *copies* embedded ``raw_data`` (protobuf, then an OrtValue). So every way into ORT ends as a
skeleton whose large tensors are external data:

- a path whose file has nothing embedded and was not rewritten: given to ORT unchanged;
- an embedded (or rewritten) model: the skeleton is serialized (kilobytes) and its tensors point
  at their byte ranges inside the original .onnx file, resolved through
  ``session.model_external_initializers_file_folder_path``. ORT maps them from the same pages the
  file already has in the page cache (see docs/handoff.md for why this beats borrowing buffers
  through ``add_external_initializers_from_files_in_memory``);
- bytes or an ``onnx.ModelProto``: written once to a private temporary file, then as above. The
  temporary folder is removed right after session creation: ORT's mappings keep the pages alive
  for as long as it needs them and nothing is left on disk.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import onnx

from .cache import MODEL_FILE, Cache
from .convert import convert_cached, write_converted
from .loader import load
from .model import Model
from .passes.dq_matmul import ConversionReport, Progress, plan_conversion
from .passes.dq_matmul_match import OrtSettings

FOLDER_KEY = "session.model_external_initializers_file_folder_path"

ModelInput = Union[str, os.PathLike, bytes, onnx.ModelProto, Model]


@dataclass
class Handoff:
    """What ORT is given: a path or skeleton bytes, and the session config entries it needs."""

    model: Union[str, bytes]
    config: dict[str, str] = field(default_factory=dict)
    source: Optional[Model] = None
    tempdir: Optional[Path] = None

    def after_create(self) -> None:
        """ORT has mapped what it needs: give back our own mappings and temporary files."""
        if self.source is not None:
            self.source.store.mark_handed()
            self.source.release()
            self.source.close()
        self.cleanup()

    def cleanup(self) -> None:
        if self.tempdir is not None:
            shutil.rmtree(self.tempdir, ignore_errors=True)
            self.tempdir = None


#: Execution providers for which ORT itself applies DQMatMulToMatMulNBits, so rewriting ahead of
#: time builds the graph ORT would build. Others (TensorRT, OpenVINO, QNN, ...) consume QDQ natively.
FUSING_PROVIDERS = {"CPUExecutionProvider", "CUDAExecutionProvider", "DmlExecutionProvider", "AzureExecutionProvider"}


@dataclass
class ConvertOptions:
    """What the hook may do to the graph before ORT sees it."""

    enabled: bool = True
    settings: Optional[OrtSettings] = None
    cache: Optional[Cache] = None  # None: a private temporary folder, removed after creation
    progress: Optional[Progress] = None
    report: Optional[ConversionReport] = None  # filled in: what was converted (None on a cache hit)
    cache_hit: bool = False


def prepare(model: ModelInput, convert: Optional[ConvertOptions] = None) -> Handoff:
    """Turn any supported model input into a :class:`Handoff` (may load or convert; never copies weights)."""
    if isinstance(model, Model):
        return _converted_or_as_is(model, convert)
    if isinstance(model, (str, os.PathLike)):
        return _converted_or_as_is(load(model), convert)
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _spill(lambda f: f.write(model), convert)
    if isinstance(model, onnx.ModelProto):
        return _spill(lambda f: f.write(model.SerializeToString()), convert)
    raise TypeError(f"ortmem cannot load a model from {type(model).__name__}; pass a path, bytes, ModelProto or ortmem.Model")


def _converted_or_as_is(model: Model, convert: Optional[ConvertOptions]) -> Handoff:
    if convert is None or not convert.enabled:
        return from_model(model)
    settings = convert.settings or OrtSettings()
    if convert.cache is not None:
        entry, hit, report = convert_cached(model, settings, convert.cache, progress=convert.progress)
        convert.cache_hit, convert.report = hit, report
        if entry is None:
            return from_model(model)
        _consume(model)
        return from_model(load(entry.model_path))
    plan = plan_conversion(model, settings)
    if not plan.rewrites:
        return from_model(model)
    tempdir = Path(tempfile.mkdtemp(prefix="ortmem-"))
    try:
        convert.report = write_converted(model, plan, tempdir, progress=convert.progress)
        _consume(model)
        handoff = from_model(load(tempdir / MODEL_FILE))
    except BaseException:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise
    handoff.tempdir = tempdir
    return handoff


def _consume(model: Model) -> None:
    """The source model has been converted: give back every page of it before ORT starts."""
    model.store.mark_handed()
    model.release()
    model.close()


def from_model(model: Model) -> Handoff:
    if model.pristine:
        return Handoff(model=str(model.path), source=model)
    return Handoff(
        model=model.skeleton.SerializeToString(),
        config={FOLDER_KEY: str(model.folder)},
        source=model,
    )


def _spill(write, convert: Optional[ConvertOptions] = None) -> Handoff:
    """Write an in-memory model to a private file so its weights can be mapped instead of copied."""
    tempdir = Path(tempfile.mkdtemp(prefix="ortmem-"))
    try:
        path = tempdir / "model.onnx"
        with open(path, "wb") as f:
            write(f)
        handoff = _converted_or_as_is(load(path), convert)
    except BaseException:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise
    if handoff.tempdir is not None:  # converted into its own temporary folder: ours is no longer read
        shutil.rmtree(tempdir, ignore_errors=True)
    else:
        handoff.tempdir = tempdir
    return handoff
