"""Pre-packed MatMulNBits weights for a converted model folder, saved with a bounded peak.

Why
---
ORT packs every constant MatMulNBits ``B`` into a kernel-specific layout while it creates a session
(``SessionState::PrepackConstantInitializedTensors``): on the demo model's native twin that puts
about 340 MiB of packed weights on the heap, the bulk of the twin's peak. ORT can save those packed
blobs (``session.save_external_prepacked_constant_initializers=1``); a later session then maps them
from the file instead of keeping heap copies. Measured on ``SynthConfig.demo()``'s twin
(onnxruntime 1.31.1, fresh processes, MiB resident, import baseline 45): twin creation peak 494,
reload of the pre-packed model 200-205 (0.41x), anonymous memory after creation and after the first
run 34-39 instead of 373 (empty-process baseline 21). The first Run then reads every packed blob from the page cache
(file-backed, shared between processes, reclaimable): a peak taken *across* creation and the first
Run is about the twin's (~466-503), which is what an earlier measurement reported as 0.95x.

What ORT does on reload (read from its source and checked by experiment)
-----------------------------------------------------------------------
* ``ExternalDataInfo::Create`` (core/framework/tensor_external_data_info.cc) parses
  ``prepacked_<i>`` = ``<op>+<hash>|<offset>;<length>;<checksum>[|...]``; offsets are in the *same
  file* as the tensor's ``location``. The checksum is written as ``0`` and never validated.
* ``GetExtDataFromTensorProto`` (core/framework/tensorprotoutils.cc) maps each blob (lazily; a blob
  whose range lies past the end of the file fails session creation with "out of bounds").
* ``PrepackConstantInitializedTensors`` (core/framework/session_state.cc) still calls the kernel's
  ``PrePack`` on the original ``B`` and hashes the result (``PrePackedWeights::GetHash``,
  core/framework/prepacked_weights.cc: MurmurHash3 of the packed bytes); only when
  ``<op>+<hash>`` equals a key loaded from the file does the kernel switch to the mapped blob
  (``UseSharedPrePackedBuffers``) and its own heap copy is freed. Consequences, all verified:
  - the original ``B`` must be readable at reload (it is read once, then unmapped);
  - a changed ``B`` (or a different CPU/ORT packing layout) gives another hash: ORT silently packs
    on the heap again (outputs correct, memory back to the twin's);
  - a corrupted blob with an intact key is used as is: *silently wrong outputs*. Hence the digest
    in ``prepacked.json`` and :func:`verify_prepacked`.
* Creation therefore still costs one pack of every ``B`` (transient: the largest tensor's mapping
  plus its heap packing) and touches the scales (they stay mapped from ``weights.bin``).

What this module writes
-----------------------
Saving through one ORT session keeps every initializer and every packed blob alive at once
(714 MiB, 1.45x the twin's peak, on the demo model; this module's saver peaks at 167 MiB there,
set by the largest single tensor, the LM head). :func:`save_prepacked` instead cuts the MatMulNBits
nodes into groups of bounded ``B`` bytes, lets a throw-away ORT session save each group's blobs,
and merges them into ``prepacked.bin``: page-aligned copies of every packed ``B`` (ORT looks the
blobs up in the tensor's own file, and reads ``B`` again on every reload), then every blob. ``model.prepacked.onnx`` is
the entry's ``model.onnx`` with only those ``B`` initializers redirected to ``prepacked.bin`` (every
other tensor still maps from ``weights.bin``; the graph is the original one, not an ORT-optimized
dump, so nothing hardware-specific but the blobs is baked in). ``prepacked.json`` is written last
and records what the blobs are valid for (:func:`prepacked_key_parts`) and a full digest of each file.
Before any of them is used, every one (the manifest too) passes the cache's one file check
(:func:`ortmem.store.trust.cache_file_problem`: owner, mode, no symbolic link, size, digest).

A full disk: the entry may fit where its pre-packed files do not. ORT then fails with "Failed to write
... external file", naming no cause; :func:`save_prepacked` tells it by the free space left on the
entry's filesystem and raises :class:`NoSpaceError` naming the folder, and records in the entry's
manifest how much was free, so later warm starts do not pack again (each attempt costs a packing
session) until more than that is free.

Use: ``save_prepacked(entry_dir)`` once (any process; a later call replaces the files with the same
bytes), then on every warm start ``prepacked_model(entry_dir)`` (None: load ``model.onnx``). The
converted ``weights.bin`` stays the source of every other tensor; ``prepacked.bin`` costs about
``B`` + 1.5x ``B`` of disk at accuracy level 4, block 32.
"""
from __future__ import annotations

import copy
import errno
import json
import logging
import os
import platform
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import onnxruntime as ort

from . import digest as content_digest
from .layout import MANIFEST, MODEL_FILE, PREPACKED_DATA, PREPACKED_MANIFEST, PREPACKED_MODEL, WEIGHTS_FILE
from .trust import (PRIVATE_FILE_MODE, cache_file_problem, fsync_dir, make_private_dir, open_new, read_nofollow,
                    replace_private, write_new)
from ..errors import CacheError
from ..options import get_config
from ..ortmodel.release import cpu_flags
from ..ortmodel.settings import packing_settings, session_settings
from ..protowire import DATA_LOCATION_EXTERNAL
from ..weights import PAGE, page_align

if TYPE_CHECKING:  # only packing (save_prepacked) parses models; a warm start reads files and imports no onnx
    import onnx
    from onnx import TensorProto

log = logging.getLogger(__name__)

#: Bumped whenever what this module writes changes.
PREPACKED_FORMAT = 3  # 2: full digests of both files; 3: every file's digest in ortmem.store.digest's form
#: ``B`` bytes packed per throw-away session. The saver's peak is about the session's fixed cost
#: plus ~3.5x this (``B`` mapped, packed copy kept for saving, the copy ORT writes); a single
#: larger ``B`` gets a group of its own.
DEFAULT_GROUP_BYTES = 48 * 1024 * 1024
#: Spacing of the sampled pages in the routine digest (plus the first and last page of every span).
SAMPLE_STRIDE = 4 * 1024 * 1024

_SUB_DIR_PREFIX = ".prepack-"
# ORT session config keys that may change how a kernel packs, copied from the caller's options into
# the throw-away sessions. (Nothing else of the caller's options is copied: initializers added from
# memory, free-dimension overrides etc. name tensors the sub-models do not have.)
# ``session.prepack.enable_parallel`` is deliberately not copied: it does not change the bytes, and
# it packs every tensor of a session at once (on the demo model's reload it lifts the creation peak
# from 200 to 459 MiB), so a warm start should not set it either.
#: Free bytes below which a failed packing session is put down to a full disk. A write that runs out
#: of space fills the filesystem to its last block first (a partial write, then ENOSPC), and ORT's
#: partial file is still there when this is checked; a filesystem with a MiB free did not fill.
NEARLY_FULL_BYTES = 1 << 20
#: Key of the entry manifest's record of a packing that found the disk full (:func:`save_prepacked`).
NO_SPACE_RECORD = "prepacked_no_space"
#: More free bytes than the failed attempt had before packing is tried again.
NO_SPACE_RETRY_MARGIN = 1 << 20


class PrepackError(CacheError):
    """Pre-packed weights could not be written (a full disk, an ORT failure in a packing session)."""


class NoSpaceError(PrepackError):
    """The entry's filesystem has no room for its pre-packed weights (names the folder)."""


# ------------------------------------------------------------------------------------------ key
def prepacked_key_parts() -> dict[str, Any]:
    """What pre-packed blobs depend on beyond the converted model: put these in the cache key (or in
    the check that decides whether an entry's ``prepacked.*`` files may be used).

    ORT's packed MatMulNBits layout is chosen by MLAS from the ORT build and the CPU's instruction
    set, so blobs written on one machine may be useless (ORT would repack on the heap, correctly
    but without the memory saving) on another. Sessions' graph-optimization level does not matter.
    """
    return {
        "prepacked_format": PREPACKED_FORMAT,
        "onnxruntime": ort.__version__,
        "machine": platform.machine(),
        "cpu_flags": list(cpu_flags()),
    }


# ------------------------------------------------------------------------------------ manifest
@dataclass
class PrepackReport:
    """What :func:`save_prepacked` did."""

    model: Optional[Path]
    tensors: int = 0
    blob_bytes: int = 0
    copied_b_bytes: int = 0
    groups: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)


def _sample_spans(spans: Iterable[tuple[int, int]], stride: int = SAMPLE_STRIDE) -> list[int]:
    pages: list[int] = []
    for off, length in spans:
        if length <= 0:
            continue
        last = off + ((length - 1) // PAGE) * PAGE
        p = off
        while p < last:
            pages.append(p)
            p += stride
        pages.append(last)
    return pages


def _digest(path: Path, spans: Iterable[tuple[int, int]]) -> str:
    """A sampled digest (:func:`ortmem.store.digest.sample_hasher`) over pages of every span (first,
    every ``SAMPLE_STRIDE``, last): catches a truncated, zeroed or swapped region without reading the
    whole file on a warm start."""
    h = content_digest.sample_hasher()
    fd = os.open(path, os.O_RDONLY)
    try:
        for p in _sample_spans(spans):
            h.update(os.pread(fd, PAGE, p))
    finally:
        os.close(fd)
    return h.hexdigest()


def verify_prepacked(entry_dir: Path, mode: str = content_digest.DEFAULT_VERIFY) -> Optional[str]:
    """None when ``entry_dir``'s pre-packed model may be used on this machine and ORT; otherwise why
    not. Every file (manifest, model, data, the base model it was packed from) passes the cache's one
    check (:func:`ortmem.store.trust.cache_file_problem`: owner, mode, no symbolic link, size). ``mode`` as
    the cache's ``verify``: "always"/"full" digest every byte of every file (xxh3, about 0.05 s/GB, see
    ortmem.store.digest; "full" once per boot and file version, :mod:`ortmem.store.stamps`), "sampled" checks sampled pages of the data (:func:`_digest`), "off" its size; the
    models are small and always digested in full."""
    entry_dir = Path(entry_dir)
    manifest = entry_dir / PREPACKED_MANIFEST
    if not os.path.lexists(manifest):
        return "no pre-packed weights saved"
    problem = cache_file_problem(manifest)
    if problem:
        return problem
    try:
        m = json.loads(read_nofollow(manifest))
    except (OSError, ValueError) as exc:
        return f"{PREPACKED_MANIFEST} unreadable: {exc}"
    if not isinstance(m, dict) or m.get("key_parts") != prepacked_key_parts():
        return "saved for another onnxruntime version, CPU or format"
    base = str(m.get("base_model", MODEL_FILE))
    if os.sep in base or base.startswith("."):
        return f"{PREPACKED_MANIFEST} names {base!r}"
    digests = m.get("digests") if isinstance(m.get("digests"), dict) else {}
    data = entry_dir / PREPACKED_DATA
    checks = ((entry_dir / PREPACKED_MODEL, None, digests.get(PREPACKED_MODEL, "")),
              (entry_dir / base, None, digests.get(base, "")),
              (data, m.get("data_size", -1), digests.get(PREPACKED_DATA, "") if mode in content_digest.FULL_MODES else None))
    for path, size, recorded in checks:
        problem = cache_file_problem(path, size=size, recorded=recorded, matches=content_digest.matcher(mode))
        if problem:
            return problem
    try:
        if mode == "sampled" and _digest(data, [tuple(s) for s in m.get("spans", [])]) != m.get("digest"):
            return f"{PREPACKED_DATA} content changed"
    except OSError as exc:
        return f"pre-packed files unreadable: {exc}"
    return None


def prepacked_model(entry_dir: Path, mode: str = content_digest.DEFAULT_VERIFY) -> Optional[Path]:
    """The verified pre-packed model of ``entry_dir`` to load on a warm start, or None (logged)."""
    problem = verify_prepacked(entry_dir, mode)
    if problem is None:
        return Path(entry_dir) / PREPACKED_MODEL
    log.info("ortmem: not using pre-packed weights in %s (%s)", entry_dir, problem)
    return None


def discard_prepacked(entry_dir: Path) -> None:
    """Remove the pre-packed files (manifest first, so no reader trusts a half-removed set)."""
    for name in (PREPACKED_MANIFEST, PREPACKED_MODEL, PREPACKED_DATA):
        try:
            os.unlink(Path(entry_dir) / name)
        except OSError:  # absent, or a read-only folder: the manifest check refuses the rest
            pass


# ---------------------------------------------------------------------------------- sub-models
@dataclass
class _Packable:
    """One constant MatMulNBits ``B`` and the nodes that read it."""

    name: str
    nbytes: int
    nodes: list[onnx.NodeProto]
    location: str = WEIGHTS_FILE


def _ext(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _inside(entry_dir: Path, location: str) -> bool:
    if not location or os.path.isabs(location):
        return False
    target = (entry_dir / location).resolve()
    return target.parent == entry_dir.resolve() or entry_dir.resolve() in target.parents


def _packables(model: onnx.ModelProto, entry_dir: Path,
               weights_name: Optional[str]) -> tuple[list[_Packable], list[str]]:
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    by_b: dict[str, _Packable] = {}
    skipped: list[str] = []
    for node in g.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) < 2:
            continue
        b = node.input[1]
        t = inits.get(b)
        if t is None or b in graph_inputs:
            skipped.append(f"{node.name or b}: B is not a constant initializer")
            continue
        location = _ext(t).get("location", "") if t.data_location == DATA_LOCATION_EXTERNAL else ""
        if not _inside(entry_dir, location) or (weights_name is not None and location != weights_name):
            skipped.append(f"{node.name or b}: B is not external data in the folder")
            continue
        if any(k.startswith("prepacked") for k in _ext(t)):
            skipped.append(f"{node.name or b}: B already carries pre-packed entries")
            continue
        if by_b.get(b) is None:
            by_b[b] = _Packable(b, int(_ext(t)["length"]), [], location)
        by_b[b].nodes.append(node)
    return list(by_b.values()), skipped


def _groups(items: list[_Packable], limit: int) -> list[list[_Packable]]:
    out: list[list[_Packable]] = []
    cur: list[_Packable] = []
    size = 0
    for p in items:
        if cur and size + p.nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.nbytes
    if cur:
        out.append(cur)
    return out


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in g.initializer:
        types[t.name] = t.data_type
    return types


def _sub_model(model: onnx.ModelProto, group: list[_Packable], types: dict[str, int]) -> onnx.ModelProto:
    """The group's MatMulNBits nodes alone: activations become graph inputs, outputs graph outputs,
    constant inputs the entry's own initializer protos (external data into ``weights.bin``)."""
    from onnx import TensorProto, helper

    inits = {t.name: t for t in model.graph.initializer}
    nodes, sub_inits, inputs, outputs = [], {}, {}, []
    for p in group:
        for node in p.nodes:
            n = copy.deepcopy(node)
            a_type = types.get(node.input[2]) if len(node.input) > 2 else None  # A's dtype = scales'
            a_type = a_type or types.get(node.input[0]) or TensorProto.FLOAT
            for i, name in enumerate(n.input):
                if not name:
                    continue
                if name in inits:
                    sub_inits[name] = inits[name]
                elif name not in inputs:
                    elem = a_type if i == 0 else types.get(name)
                    if elem is None:
                        raise PrepackError(f"cannot type input {name!r} of a MatMulNBits node", tensor=name)
                    inputs[name] = helper.make_tensor_value_info(name, elem, None)
            for o in n.output:
                if o:
                    outputs.append(helper.make_tensor_value_info(o, a_type, None))
            # Distinct node outputs are already unique across the original graph.
            nodes.append(n)
    graph = helper.make_graph(nodes, "prepack", list(inputs.values()), outputs, list(sub_inits.values()))
    sub = helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    return sub


def _sub_options(entry_dir: Path, out_dir: Path, user: Optional[ort.SessionOptions]) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.optimized_model_filepath = str(out_dir / "sub.onnx")
    so.log_severity_level = 3
    for k, v in (("session.save_external_prepacked_constant_initializers", "1"),
                 ("session.optimized_model_external_initializers_file_name", "sub.data"),
                 ("session.model_external_initializers_file_folder_path", str(entry_dir))):
        so.add_session_config_entry(k, v)
    config, threads = packing_settings(user)
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    if threads:
        so.intra_op_num_threads = threads
    return so


def _blobs_of(saved: onnx.ModelProto) -> dict[str, list[tuple[str, list[tuple[int, int]]]]]:
    """``{B name: [(key, [(offset, length), ...]), ...]}`` from a model ORT saved with pre-packs."""
    out: dict[str, list[tuple[str, list[tuple[int, int]]]]] = {}
    for t in saved.graph.initializer:
        for k, v in _ext(t).items():
            if not k.startswith("prepacked"):
                continue
            key, *blobs = v.split("|")
            spans = []
            for b in blobs:
                off, length, _checksum = b.split(";")
                spans.append((int(off), int(length)))
            if spans:
                out.setdefault(t.name, []).append((key, spans))
    return out


# ------------------------------------------------------------------------------------ writing
def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, length: int) -> None:
    """Copy bytes between files in the kernel where possible (shares extents on reflink filesystems,
    never holds the data in this process)."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < length:
        n = 0
        if use_cfr:
            try:
                n = os.copy_file_range(src_fd, dst_fd, length - done, src_off + done, dst_off + done)
            except OSError:
                use_cfr = False
                continue
        else:
            chunk = os.pread(src_fd, min(1 << 20, length - done), src_off + done)
            n = os.pwrite(dst_fd, chunk, dst_off + done) if chunk else 0
        if n <= 0:
            raise PrepackError(f"short copy ({done} of {length} bytes)")
        done += n


def save_prepacked(entry_dir: Path, *, sess_options: Optional[ort.SessionOptions] = None,
                   model_name: str = MODEL_FILE, weights_name: Optional[str] = None,
                   group_bytes: int = DEFAULT_GROUP_BYTES, report: Optional[PrepackReport] = None) -> Optional[Path]:
    """Pack the MatMulNBits weights of the converted folder ``entry_dir`` and save them next to it.

    Writes ``model.prepacked.onnx``, ``prepacked.bin`` and (last) ``prepacked.json`` into
    ``entry_dir`` and returns the model path to load on warm starts, or None when nothing is packed
    (no constant MatMulNBits ``B`` stored as external data inside ``entry_dir`` (in ``weights_name``
    only, when given), ``session.disable_prepacking=1`` in
    ``sess_options``, or ORT packs none of them on this CPU). Never holds more than one group of
    ``group_bytes`` of ``B`` (plus its packing) in memory. Raises :class:`PrepackError` (a
    ``CacheError``) if a packing session fails, :class:`NoSpaceError` if the disk fills; the entry is
    left without pre-packed files then. A full disk is recorded in the entry's manifest (when the
    folder is a cache entry) with the free space the attempt had: until more than that is free, later
    calls raise :class:`NoSpaceError` at once instead of packing again.
    """
    entry_dir = Path(entry_dir)
    if not session_settings(sess_options).prepacking:
        return None
    free = free_bytes(entry_dir)
    refusal = _known_too_full(entry_dir, free)
    if refusal:
        raise NoSpaceError(refusal, file=str(entry_dir))
    try:
        path = _pack_and_save(entry_dir, sess_options=sess_options, model_name=model_name,
                              weights_name=weights_name, group_bytes=group_bytes, report=report)
    except NoSpaceError:
        _record_no_space(entry_dir, free)  # after the attempt's files are gone: there is room for it
        raise
    if path is not None:
        _record_no_space(entry_dir, None)
    return path


def free_bytes(folder: Path) -> Optional[int]:
    """Bytes an unprivileged writer may still use on ``folder``'s filesystem (None: unknown)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _known_too_full(entry_dir: Path, free: Optional[int]) -> Optional[str]:
    """Why packing is not tried now: an earlier attempt found the disk full with at least as much
    free as now (None: try). Only a record for this ORT and CPU counts (other blobs, other sizes)."""
    record = _entry_manifest(entry_dir).get(NO_SPACE_RECORD)
    if free is None or not isinstance(record, dict) or record.get("key_parts") != prepacked_key_parts():
        return None
    had = record.get("free_bytes")
    if not isinstance(had, int) or free > had + NO_SPACE_RETRY_MARGIN:
        return None
    return (f"no space left on device in {entry_dir} for pre-packed weights: packing found it full with "
            f"{had / 2**20:.1f} MiB free and is not tried again until more than "
            f"{(had + NO_SPACE_RETRY_MARGIN) / 2**20:.1f} MiB is ({free / 2**20:.1f} MiB now)")


def _entry_manifest(entry_dir: Path) -> dict[str, Any]:
    """The cache entry's manifest when ``entry_dir`` is an entry whose manifest passes the cache's
    file check; else {} (a folder outside the cache has none)."""
    path = entry_dir / MANIFEST
    if not os.path.lexists(path) or cache_file_problem(path):
        return {}
    try:
        m = json.loads(read_nofollow(path))
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}


def _record_no_space(entry_dir: Path, free: Optional[int]) -> None:
    """Record in the entry's manifest that packing found the disk full with ``free`` bytes free
    (None: forget an earlier record). Best effort: without the record the next start only tries
    again."""
    m = _entry_manifest(entry_dir)
    if not m or (free is None and NO_SPACE_RECORD not in m):
        return
    if free is None:
        m.pop(NO_SPACE_RECORD)
    else:
        m[NO_SPACE_RECORD] = {"free_bytes": free, "key_parts": prepacked_key_parts(), "at": time.time()}
    try:
        replace_private(entry_dir / MANIFEST, json.dumps(m, indent=1).encode())
    except OSError as exc:
        log.debug("ortmem: could not record the full disk in %s (%s)", entry_dir, exc)


def _no_space(entry_dir: Path, what: str, exc: BaseException) -> NoSpaceError:
    """The error for a write into ``entry_dir`` that found its filesystem full."""
    last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    detail = last.rsplit(" : ", 1)[-1][-300:]  # ORT's own words, without its source location prefix
    return NoSpaceError(f"no space left on device in {entry_dir}: {what} ({detail})", file=str(entry_dir))


def _pack_and_save(entry_dir: Path, *, sess_options: Optional[ort.SessionOptions], model_name: str,
                   weights_name: Optional[str], group_bytes: int, report: Optional[PrepackReport]) -> Optional[Path]:
    """:func:`save_prepacked`'s packing and publishing, every temporary file removed on return."""
    import onnx

    start = time.perf_counter()
    rep = report if report is not None else PrepackReport(None)
    base_path = entry_dir / model_name
    model = onnx.load(str(base_path), load_external_data=False)
    packables, rep.skipped = _packables(model, entry_dir, weights_name)
    if not packables:
        return None
    types = _value_types(model)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the pid tells a crash leftover (ortmem.store.cache.reclaim_stale)
    work = entry_dir / f"{_SUB_DIR_PREFIX}{token}"
    tmp_data = entry_dir / f".{PREPACKED_DATA}.{token}"
    tmp_model = entry_dir / f".{PREPACKED_MODEL}.{token}"
    tmp_manifest = entry_dir / f".{PREPACKED_MANIFEST}.{token}"
    new_ext: dict[str, list[tuple[str, str]]] = {}
    spans: list[tuple[int, int]] = []
    try:
        make_private_dir(work)
        src_fds: dict[str, int] = {}
        d_fd = -1
        try:
            for loc in sorted({p.location for p in packables}):
                src_fds[loc] = os.open(entry_dir / loc, os.O_RDONLY)
            d_fd = open_new(tmp_data, PRIVATE_FILE_MODE, readable=True)
            inits = {t.name: t for t in model.graph.initializer}
            # Every B copy first, then every blob: ORT reads each B once during creation (it packs and
            # hashes it again), and the kernel's read-ahead then stays inside the B region instead of
            # pulling the blobs from disk before the first Run needs them.
            b_pos: dict[str, int] = {}
            pos = 0
            for p in packables:
                b_pos[p.name] = pos
                pos = page_align(pos + p.nbytes)
            for group in _groups(packables, group_bytes):
                sub = _sub_model(model, group, types)
                try:
                    # Bytes, not a file: the skeleton is tiny, and external data resolves against
                    # entry_dir through session.model_external_initializers_file_folder_path.
                    sess = ort.InferenceSession(sub.SerializeToString(),
                                                _sub_options(entry_dir, work, sess_options),
                                                providers=["CPUExecutionProvider"])
                    del sess
                except Exception as exc:  # ORT raises its own pybind exception types
                    left = free_bytes(entry_dir)  # before its partial file goes (the finally below)
                    if left is not None and left < NEARLY_FULL_BYTES:
                        raise _no_space(entry_dir, "onnxruntime could not write the packed weights", exc) from exc
                    raise PrepackError(f"packing session failed: {exc}", file=str(entry_dir)) from exc
                finally:
                    _trim()
                rep.groups += 1
                saved = work / "sub.onnx"
                blobs = _blobs_of(onnx.load(str(saved), load_external_data=False)) if saved.exists() else {}
                s_fd = os.open(work / "sub.data", os.O_RDONLY) if blobs else -1
                try:
                    for p in group:
                        entries = blobs.get(p.name)
                        if not entries:
                            rep.skipped.append(f"{p.name}: ORT packed nothing for it")
                            continue
                        ext = _ext(inits[p.name])
                        b_off, b_len = int(ext.get("offset", 0)), int(ext["length"])
                        _copy_range(src_fds[p.location], b_off, d_fd, b_pos[p.name], b_len)
                        kv = [("location", PREPACKED_DATA), ("offset", str(b_pos[p.name])), ("length", str(b_len))]
                        spans.append((b_pos[p.name], b_len))
                        rep.copied_b_bytes += b_len
                        for i, (key, blob_spans) in enumerate(entries):
                            parts = [key]
                            for off, length in blob_spans:
                                pos = page_align(pos)
                                _copy_range(s_fd, off, d_fd, pos, length)
                                parts.append(f"{pos};{length};0")
                                spans.append((pos, length))
                                rep.blob_bytes += length
                                pos += length
                            kv.append((f"prepacked_{i}", "|".join(parts)))
                        new_ext[p.name] = kv
                        rep.tensors += 1
                finally:
                    if s_fd >= 0:
                        os.close(s_fd)
                for f in work.iterdir():
                    f.unlink()
            if not new_ext:
                return None
        finally:
            for fd in (*src_fds.values(), d_fd):
                if fd >= 0:
                    os.close(fd)

        for t in model.graph.initializer:
            kv = new_ext.get(t.name)
            if kv is not None:
                del t.external_data[:]
                for k, v in kv:
                    e = t.external_data.add()
                    e.key, e.value = k, v
        write_new(tmp_model, model.SerializeToString())
        manifest = {
            "format": PREPACKED_FORMAT,
            "key_parts": prepacked_key_parts(),
            "created": time.time(),
            "base_model": model_name,
            "data_size": tmp_data.stat().st_size,
            "spans": spans,
            "digest": _digest(tmp_data, spans),
            "digests": {model_name: content_digest.file_digest(base_path),
                        PREPACKED_MODEL: content_digest.file_digest(tmp_model),
                        PREPACKED_DATA: content_digest.file_digest(tmp_data)},
            "tensors": rep.tensors,
            "blob_bytes": rep.blob_bytes,
        }
        write_new(tmp_manifest, json.dumps(manifest, indent=1).encode(), sync=True)
        # Publish: a reader trusts the files only through the manifest, which goes last.
        try:
            os.unlink(entry_dir / PREPACKED_MANIFEST)
        except FileNotFoundError:
            pass
        os.replace(tmp_data, entry_dir / PREPACKED_DATA)
        os.replace(tmp_model, entry_dir / PREPACKED_MODEL)
        os.replace(tmp_manifest, entry_dir / PREPACKED_MANIFEST)
        fsync_dir(entry_dir)
        rep.model = entry_dir / PREPACKED_MODEL
        return rep.model
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(entry_dir, "the pre-packed weights could not be written", exc) from exc
        raise PrepackError(f"pre-packed weights could not be written: {exc}", file=str(entry_dir)) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for tmp in (tmp_data, tmp_model, tmp_manifest):
            try:
                os.unlink(tmp)
            except OSError:  # absent (published or never made), or a read-only folder
                pass
        rep.seconds = time.perf_counter() - start


def _trim() -> None:
    try:
        from ..hygiene import trim
        trim()
    except Exception:  # pragma: no cover - hygiene is best effort
        pass
