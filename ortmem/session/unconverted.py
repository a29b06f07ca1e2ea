"""A model handed to ORT unconverted, without ORT copying its weights.

A path whose file has nothing embedded goes as it is. Otherwise the skeleton (kilobytes) is written into
a private temporary folder beside hard links to the files its tensors point into (the original .onnx,
its data files), and ORT loads that folder's skeleton by path: ORT maps the tensors from the same pages
the original file already has in the page cache (docs/handoff.md for why this beats borrowing buffers
through ``add_external_initializers_from_files_in_memory``). Loading by path needs no session config
entry, so the caller's ``SessionOptions`` are never touched (setting
``session.model_external_initializers_file_folder_path`` on them and putting it back made ORT print
"Config with key ... already exists ... overwritten" and left the key behind as ""); where no hard link
can be made (another file system, protected_hardlinks) the skeleton goes as bytes with that config
entry instead.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Optional

import onnx

from ortmem.onnxfile.model import Model
from ortmem.onnxfile.scan import FOLDER_KEY
from ortmem.onnxfile.walk import is_external, iter_tensor_sites
from ortmem.session.handoff import Handoff
from ortmem.store.start import Decision

log = logging.getLogger(__name__)


def from_model(model: Model, own_folder: bool = False, link_root: Optional[Path] = None) -> Handoff:
    """Hand ``model`` over unconverted: its own path when the file is what ORT should load, else its
    skeleton by path beside its weight files (see the module docstring), else skeleton bytes plus
    the folder config entry. ``own_folder``: the model lives in a private folder ortmem made (a
    spilled bytes model), so the skeleton is written there directly. ``link_root``: a second place
    to try the hard links in (the cache's file system) when the system temp folder is on another."""
    if model.pristine:
        return Handoff(model=str(model.path), source=model)
    if own_folder:
        return Handoff(model=str(_write_skeleton(model, model.folder)), source=model, action=Decision.MAPPED)
    for root in (None, link_root):  # the system temp folder first, then the cache's file system
        handoff = _linked_skeleton(model, root)
        if handoff is not None:
            return handoff
    return Handoff(
        model=model.skeleton.SerializeToString(),
        config=MappingProxyType({FOLDER_KEY: str(model.folder)}),
        source=model,
        action=Decision.MAPPED,
    )


def _linked_skeleton(model: Model, root: Optional[Path]) -> Optional[Handoff]:
    """The skeleton in a new private folder (under ``root``) beside hard links to every file its
    tensors point into; None when a link cannot be made there (the caller tries elsewhere).
    Symbolic links would not do: ORT resolves them and refuses data outside the model's folder."""
    if root is not None and not root.is_dir():
        return None
    workdir = Path(tempfile.mkdtemp(prefix=".tmp-link-" if root else "ortmem-", dir=root))
    try:
        for location in _external_locations(model):
            target = workdir / location
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(model.folder / location, target)
        path = _write_skeleton(model, workdir)
    except OSError as exc:
        log.debug("ortmem: cannot hard-link %s into %s (%s)", model.path, workdir, exc)
        shutil.rmtree(workdir, ignore_errors=True)
        return None
    return Handoff(model=str(path), source=model, tempdirs=(workdir,), action=Decision.MAPPED)


def _external_locations(model: Model) -> set[str]:
    """Every external-data file the skeleton's tensors point into, relative to the model folder.

    Raises ``OSError`` when a tensor outside the main graph (a subgraph's, a function's) is external:
    ORT runs ONNX's checker on subgraphs, which refuses external data in a file with more than one
    hard link ("potential hardlink attack"). Main-graph initializers and Constant values are
    accepted (ORT turns Constants into initializers before checking nodes)."""
    graph = model.skeleton.graph
    main = [*graph.initializer]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                main.append(attr.t)
            elif attr.type == onnx.AttributeProto.TENSORS:
                main.extend(attr.tensors)
    main = [t for t in main if is_external(t)]
    if sum(1 for site in iter_tensor_sites(model.skeleton) if is_external(site.tensor)) != len(main):
        raise OSError("a subgraph or function holds external data, which ORT refuses from a hard-linked file")
    return {e.value for t in main for e in t.external_data if e.key == "location"}


def _write_skeleton(model: Model, folder: Path) -> Path:
    """Write the skeleton into ``folder`` under a name no weight file there uses."""
    taken = {p.name for p in folder.iterdir()}
    name = next(n for n in (f"ortmem-skeleton{i or ''}.onnx" for i in range(len(taken) + 1)) if n not in taken)
    path = folder / name
    path.write_bytes(model.skeleton.SerializeToString())
    return path
