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
and records what the blobs are valid for (:func:`prepacked_key_parts`) and a digest.

Use: ``save_prepacked(entry_dir)`` once (any process; a later call replaces the files with the same
bytes), then on every warm start ``prepacked_model(entry_dir)`` (None: load ``model.onnx``). The
converted ``weights.bin`` stays the source of every other tensor; ``prepacked.bin`` costs about
``B`` + 1.5x ``B`` of disk at accuracy level 4, block 32.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from . import digest as content_digest
from .cache import MODEL_FILE, WEIGHTS_FILE, fsync_dir
from .filetrust import PRIVATE_FILE_MODE, make_private_dir, open_new, read_nofollow, write_new
from .errors import CacheError
from .options import get_config
from .ortmodel.release import cpu_flags
from .ortmodel.settings import session_settings
from .weights import PAGE, page_align

log = logging.getLogger(__name__)

PREPACKED_MODEL = "model.prepacked.onnx"
PREPACKED_DATA = "prepacked.bin"
PREPACKED_MANIFEST = "prepacked.json"
#: Bumped whenever what this module writes changes.
PREPACKED_FORMAT = 2  # 2: full digests of both files
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
_COPIED_CONFIG = ("mlas.enable_gemm_fastmath_arm64_bfloat16", "mlas.use_kleidiai")
class PrepackError(CacheError):
    """Pre-packed weights could not be written (a full disk, an ORT failure in a packing session)."""


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
    """blake2b over sampled pages of every span (first, every ``SAMPLE_STRIDE``, last): catches a
    truncated, zeroed or swapped region without reading the whole file on a warm start."""
    h = hashlib.blake2b(digest_size=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        for p in _sample_spans(spans):
            h.update(os.pread(fd, PAGE, p))
    finally:
        os.close(fd)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(read_nofollow(path)).hexdigest()


def verify_prepacked(entry_dir: Path, mode: str = content_digest.DEFAULT_VERIFY) -> Optional[str]:
    """None when ``entry_dir``'s pre-packed model may be used on this machine and ORT; otherwise why
    not. ``mode`` as the cache's ``verify``: "full" digests every byte of both files (xxh3, about
    0.05 s/GB, see ortmem.digest), "sampled" checks sampled pages (:func:`_digest`), "off" sizes."""
    entry_dir = Path(entry_dir)
    try:
        m = json.loads(read_nofollow(entry_dir / PREPACKED_MANIFEST))
    except FileNotFoundError:
        return "no pre-packed weights saved"
    except (OSError, ValueError) as exc:
        return f"{PREPACKED_MANIFEST} unreadable: {exc}"
    if m.get("key_parts") != prepacked_key_parts():
        return "saved for another onnxruntime version, CPU or format"
    data, model = entry_dir / PREPACKED_DATA, entry_dir / PREPACKED_MODEL
    try:
        if data.stat().st_size != m.get("data_size"):
            return f"{PREPACKED_DATA} has the wrong size"
        if _sha256(model) != m.get("model_sha256"):
            return f"{PREPACKED_MODEL} changed"
        base = entry_dir / m.get("base_model", MODEL_FILE)
        if m.get("base_model_sha256") and _sha256(base) != m["base_model_sha256"]:
            return f"{base.name} changed since the weights were packed"
        if mode == "full" and not content_digest.matches(data, m.get("data_digest")):
            return f"{PREPACKED_DATA} content changed (full digest)"
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
        location = _ext(t).get("location", "") if t.data_location == TensorProto.EXTERNAL else ""
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
    if user is not None:
        for k in _COPIED_CONFIG:
            v = get_config(user, k)
            if v:
                so.add_session_config_entry(k, v)
        if user.intra_op_num_threads:
            so.intra_op_num_threads = user.intra_op_num_threads
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
    ``CacheError``) if a packing session fails or the disk fills; the entry is left without
    pre-packed files then.
    """
    start = time.perf_counter()
    entry_dir = Path(entry_dir)
    rep = report if report is not None else PrepackReport(None)
    if not session_settings(sess_options).prepacking:
        return None
    base_path = entry_dir / model_name
    model = onnx.load(str(base_path), load_external_data=False)
    packables, rep.skipped = _packables(model, entry_dir, weights_name)
    if not packables:
        return None
    types = _value_types(model)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the pid tells a crash leftover (ortmem.cache.reclaim_stale)
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
            "base_model_sha256": _sha256(base_path),
            "model_sha256": _sha256(tmp_model),
            "data_size": tmp_data.stat().st_size,
            "spans": spans,
            "digest": _digest(tmp_data, spans),
            "data_digest": content_digest.file_digest(tmp_data),
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
        from .hygiene import trim
        trim()
    except Exception:  # pragma: no cover - hygiene is best effort
        pass
