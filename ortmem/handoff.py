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

from .loader import load
from .model import Model

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


def prepare(model: ModelInput) -> Handoff:
    """Turn any supported model input into a :class:`Handoff` (may load, never copies weights)."""
    if isinstance(model, Model):
        return from_model(model)
    if isinstance(model, (str, os.PathLike)):
        return from_model(load(model))
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _spill(lambda f: f.write(model))
    if isinstance(model, onnx.ModelProto):
        return _spill(lambda f: f.write(model.SerializeToString()))
    raise TypeError(f"ortmem cannot load a model from {type(model).__name__}; pass a path, bytes, ModelProto or ortmem.Model")


def from_model(model: Model) -> Handoff:
    if model.pristine:
        return Handoff(model=str(model.path), source=model)
    return Handoff(
        model=model.skeleton.SerializeToString(),
        config={FOLDER_KEY: str(model.folder)},
        source=model,
    )


def _spill(write) -> Handoff:
    """Write an in-memory model to a private file so its weights can be mapped instead of copied."""
    tempdir = Path(tempfile.mkdtemp(prefix="ortmem-"))
    try:
        path = tempdir / "model.onnx"
        with open(path, "wb") as f:
            write(f)
        handoff = from_model(load(path))
    except BaseException:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise
    handoff.tempdir = tempdir
    return handoff
