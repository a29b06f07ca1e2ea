"""ORT's own pre-packed weights for any model, saved beside a copy of it that ORT maps as is.

Why
---
Every kernel that pre-packs a constant input (MatMul/Gemm in fp32 and fp16, MatMulNBits, the int8
QOperator kernels, LSTM/GRU, attention...) keeps its packed copy on the heap, one per process. ORT
can save those packed buffers (``session.save_external_prepacked_constant_initializers``) beside the
model's initializers; a later session maps them from the file. Measured on onnxruntime 1.32.0 (fp32
MLP, 12 x MatMul 2048x2048, 192 MiB of weights): a fresh process loading the saved model with default
options, inside :func:`ortmem.hygiene.allocator_hygiene`, holds 23 MiB private (RssAnon) after
creation and its first run (an empty interpreter with ORT imported: 21) against plain ORT's 216 on
the source, with bit-identical outputs. Which kernels pack is asked of the installed ORT (it saves
what it packs), never listed here.

How
---
A throw-away session over the source with ``ORT_DISABLE_ALL`` writes ``<stem>.onnx`` (the source
graph, every initializer external in ``<stem>.data``) plus the ``prepacked_<i>`` blobs. The saved
graph is the source graph: nothing the user's options might switch off is baked in; the user's own
session still optimizes at its level and maps each saved blob only where its kernel's fresh packing
hashes to the saved key (ORT >= 1.32 also re-packs and compares on reload), so the files are safe
whatever the caller's ``SessionOptions`` hold. Initializers created by ORT's own optimizers (NCHWc
convolution weights, fused ones) are therefore *not* captured: a model whose only packing happens on
such tensors (a Conv net: plain ``Conv`` does not pre-pack, the NCHWc one made at level 3 does) gets
``useful=False``.

Before anything is published, :func:`worth_mapping` runs the source and the saved model on the same
feeds (:func:`ortmem.measure.inputs.make_inputs`; a decoder's first step: empty KV cache, its head
size and head count from ``genai_config.json`` or its attention nodes). A model those feeds cannot run
is not judged at all: :class:`PrepareCheckError`, nothing is written, and a later preparation tries
again (a verdict such as "ORT packs nothing" is recorded only where the check ran).

What is checked, and when (:func:`prepared_path`, on every use)
-------------------------------------------------------------
``<stem>.json`` is written last and atomically; it records what the blobs are valid for
(:func:`ortmem.store.prepacked.prepacked_key_parts`: ORT release, CPU, format), the source's identity (the
.onnx and each external data file: :func:`ortmem.store.sources.source_record`) and a full digest of each
written file. Before use, every file passes the cache's one trust check
(:func:`ortmem.store.trust.cache_file_problem`: owner, mode, no symbolic link, size and, in ``"full"``
mode, every byte), the key parts must equal this ORT and CPU's and (``source`` given) the source must
be unchanged. This module knows nothing of the cache: :mod:`ortmem.store.prepared_entries` keeps these files
in cache entries; onnxruntime-genai folders keep them inside the folder.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import onnxruntime as ort

from . import digest
from .sources import source_record, sources_problem
from ..errors import CacheError
from .trust import PRIVATE_FILE_MODE, cache_file_problem, fsync_dir, make_private_dir, read_nofollow, write_new
from ..ortmodel.settings import OrtSettings
from .prepacked import prepacked_key_parts

log = logging.getLogger(__name__)

#: Bumped whenever what :func:`prepare_model` writes, or the rule deciding whether it is published,
#: changes. 2: published only where :func:`worth_mapping` measured a gain (a format-1 entry may be one
#: that holds more private memory than plain ORT; its key no longer matches, so it is never served).
#: 3: the check runs decoders on their first step (format 2 ran them on made-up cache shapes ORT's attention
#: refused, and recorded "packs nothing" for every such decoder).
PREPARED_FORMAT = 3
_WORK_PREFIX = ".prepare-"


class PrepareError(CacheError):
    """ORT could not save the prepared model (names the source)."""


class PrepareCheckError(PrepareError):
    """The check that decides whether a prepared model may be used could not run (the source fails on
    the feeds ortmem makes): no verdict, so nothing may be recorded of it (names the source)."""


@dataclass
class PreparedReport:
    """What :func:`prepare_model` did."""

    seconds: float
    prepacked: int  # initializers ORT saved pre-packed blobs for
    data_bytes: int  # size of <stem>.data
    useful: bool  # prepacked > 0 and worth_mapping: mapping saves heap (False: the caller keeps no files)
    #: Why a model with pre-packed blobs is still not worth mapping (:func:`worth_mapping`), else "".
    refusal: str = ""


def source_files(source: Path) -> list[Path]:
    """The .onnx file and every external data file its tensors point into (what a prepared model is
    made from, so what must stay unchanged for it to be used)."""
    import onnx  # the writing half parses models; a warm start only reads this module's manifest checks

    from ..onnx_walk import external_data_dict, is_external, iter_tensor_sites

    model = onnx.load(str(source), load_external_data=False)
    folder = Path(source).resolve().parent
    locations = {external_data_dict(s.tensor).get("location", "") for s in iter_tensor_sites(model)
                 if is_external(s.tensor)}
    return [Path(source).resolve(), *sorted(folder / loc for loc in locations if loc)]


def prepare_model(source: Path, folder: Path, stem: str = "prepared", *, settings: Optional[OrtSettings] = None,
                  threads: int = 0) -> PreparedReport:
    """Write ``folder/<stem>.onnx``, ``folder/<stem>.data`` and, last and atomically,
    ``folder/<stem>.json`` (see the module docstring). ``settings``: its ``session_config`` entries go
    to the throw-away session (pass those ORT's packing depends on,
    :func:`ortmem.ortmodel.settings.packing_settings`); ``prepacking`` False writes nothing (``useful`` False).
    ``threads``: intra-op threads of the throw-away session (0: ORT's default).

    Raises :class:`PrepareError` when ORT fails to load or save the model, :class:`PrepareCheckError`
    when the source cannot be run to check the saved model; nothing is published then.
    """
    import onnx

    from ..onnx_walk import external_data_dict

    start = time.perf_counter()
    source, folder = Path(source), Path(folder)
    settings = settings or OrtSettings()
    if not settings.prepacking:
        return PreparedReport(time.perf_counter() - start, 0, 0, False)
    record = source_record(source_files(source))  # before ORT reads it: an edit meanwhile shows later
    work = folder / f"{_WORK_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    make_private_dir(work)
    try:
        _save(source, work, stem, settings, threads)
        saved = onnx.load(str(work / f"{stem}.onnx"), load_external_data=False)
        prepacked = sum(any(k.startswith("prepacked") for k in external_data_dict(t)) for t in saved.graph.initializer)
        refusal = worth_mapping(source, work / f"{stem}.onnx", settings, threads) if prepacked else None
        if refusal:
            log.info("ortmem: %s is not prepared: %s", source, refusal)
        names = [n for n in (f"{stem}.onnx", f"{stem}.data") if (work / n).exists()]
        for name in names:
            os.chmod(work / name, PRIVATE_FILE_MODE)
        files = {n: (work / n).stat().st_size for n in names}
        report = PreparedReport(0.0, prepacked, files.get(f"{stem}.data", 0), prepacked > 0 and refusal is None,
                                refusal or "")
        manifest = {"format": PREPARED_FORMAT, "key_parts": prepacked_key_parts(), "created": time.time(),
                    "files": files, "digests": {n: digest.file_digest(work / n) for n in names}, **record}
        if f"{stem}.data" in files:  # what verify="sampled" reads: the first and last page of every span
            spans = data_spans(saved, f"{stem}.data")
            manifest.update(spot_spans=spans, spot_digest=digest.sampled_digest(work / f"{stem}.data", spans))
        _publish(work, folder, stem, names)
        report.seconds = time.perf_counter() - start
        manifest["report"] = asdict(report)
        tmp = folder / f".{stem}.json.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        write_new(tmp, json.dumps(manifest, indent=1).encode(), sync=True)
        os.replace(tmp, folder / f"{stem}.json")
        fsync_dir(folder)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: A prepared model is used only where the session over it keeps at most this fraction of the private
#: memory a session over the source keeps (both measured in the preparing process, after a run and
#: ``malloc_trim``). Measured on onnxruntime 1.32.0: the fp32 MLP keeps 0.05x, a native int4 Llama 0.05x,
#: while a ``quantize_dynamic`` int8 model keeps 1.0x (its blobs, saved from MatMulInteger at
#: ORT_DISABLE_ALL, never match once the session fuses it), where mapping only adds ortmem's costs.
GAIN_FRACTION = 0.8
#: Below this much private memory kept by the source's session the in-process measurement cannot tell a
#: gain from allocator noise (a 0.5 MiB MLP measured either way from run to run on 1.31.1): such a model
#: (prepared only below the default size threshold) is judged by its outputs alone.
MEASURABLE_BYTES = 4 << 20


def worth_mapping(source: Path, prepared: Path, settings: OrtSettings, threads: int = 0) -> Optional[str]:
    """None when the prepared model gives the source's outputs bit for bit and keeps measurably less
    private memory; else why not (the caller then keeps no files).

    Both are asked of the installed ORT, not assumed: onnxruntime 1.28.0 reloads the saved blobs of a
    native MatMulNBits model as NaN (a silently wrong output had the entry been used), and a saved blob
    whose kernel is fused away at the session's optimization level is never mapped. Feeds are synthetic
    (floats from a fixed seed, integers 0, batch 1, sequence 8; a decoder's first step, its cache empty:
    :func:`ortmem.measure.inputs.decoder_dims`), made once from the source and given to both.

    Raises :class:`PrepareCheckError` when the source itself cannot be run on them: that is no verdict
    on the prepared model, and the caller records none. ORT's own log stays quiet (the error says why).
    """
    from ..hygiene import trim
    from ..measure.inputs import decoder_dims, make_inputs

    feeds: dict[str, Any] = {}

    def run(path: Path) -> tuple[list[Any], int]:
        so = ort.SessionOptions()
        so.log_severity_level = _ORT_QUIET
        for key, value in settings.session_config.items():
            so.add_session_config_entry(key, value)
        if threads:
            so.intra_op_num_threads = threads
        trim()
        before = _rss_anon()
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        if not feeds:
            feeds.update(make_inputs(session, {"int_high": 1, "dims": decoder_dims(source)}))
        outputs = session.run(None, feeds)
        trim()
        kept = _rss_anon() - before
        del session
        return outputs, kept

    try:
        expected, source_kept = run(source)
    except Exception as exc:  # noqa: BLE001 - ORT's own types: a model synthetic feeds cannot run
        shapes = ", ".join(f"{k} {list(np.shape(v))}" for k, v in feeds.items())
        raise PrepareCheckError(f"the check of the prepared model could not run the source ({_ort_message(exc)}; "
                                f"feeds: {shapes or 'none made'}); nothing recorded, a later start tries again",
                                file=str(source)) from exc
    try:
        got, prepared_kept = run(prepared)
    except Exception as exc:  # noqa: BLE001 - the source runs on these feeds, the saved model does not
        return f"onnxruntime {ort.__version__} cannot run the prepared model ({_ort_message(exc)})"
    same = len(got) == len(expected) and all(
        np.asarray(a).shape == np.asarray(b).shape and np.array_equal(a, b, equal_nan=False) for a, b in zip(got, expected))
    if not same:
        return f"onnxruntime {ort.__version__} gives other outputs on the prepared model than on the source"
    if source_kept >= MEASURABLE_BYTES and prepared_kept > GAIN_FRACTION * source_kept:
        return (f"the prepared model keeps {prepared_kept / 2**20:.1f} MiB private against the source's "
                f"{source_kept / 2**20:.1f} MiB: nothing ORT keeps is mapped")
    return None


#: ``SessionOptions.log_severity_level`` of the sessions ortmem makes here: fatal only, so a failure is
#: said once, by the error ortmem raises, not also by ORT's log.
_ORT_QUIET = 4


def _ort_message(exc: BaseException) -> str:
    """ORT's message without its status prefix, on one line and short."""
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", " ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text[:300]}"


def _rss_anon() -> int:
    """Private resident bytes of this process (``RssAnon``; 0 where /proc is absent). Imported here, as
    :func:`worth_mapping` imports its feeds: only the builder measures, the session path loads no
    measure code (tests/test_import.py)."""
    from ..measure.procfs import read_status

    return (read_status("self") or {}).get("RssAnon", 0)


def _save(source: Path, work: Path, stem: str, settings: OrtSettings, threads: int) -> None:
    """The throw-away session that writes ``work/<stem>.onnx`` and ``.data`` (freed before return:
    saving keeps every initializer alive in it)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.optimized_model_filepath = str(work / f"{stem}.onnx")
    so.log_severity_level = _ORT_QUIET
    entries = {**dict(settings.session_config),
               "session.save_external_prepacked_constant_initializers": "1",
               "session.optimized_model_external_initializers_file_name": f"{stem}.data"}
    for key, value in entries.items():
        so.add_session_config_entry(key, value)
    if threads:
        so.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(str(source), so, providers=["CPUExecutionProvider"])
        del session
    except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind types
        raise PrepareError(f"onnxruntime could not save the prepared model: {exc}", file=str(source)) from exc
    if not (work / f"{stem}.onnx").exists():
        raise PrepareError("onnxruntime saved no prepared model", file=str(source))


def _publish(work: Path, folder: Path, stem: str, names: list[str]) -> None:
    """Move the written files into ``folder``; the old manifest goes first, so no reader trusts a
    half-replaced set (the new one is written after)."""
    for stale in (f"{stem}.json", f"{stem}.data", f"{stem}.onnx"):
        try:
            os.unlink(folder / stale)
        except FileNotFoundError:
            pass
    for name in names:
        os.replace(work / name, folder / name)


def read_manifest(folder: Path, stem: str = "prepared") -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(``<stem>.json`` once it passed the cache's file check, None) or (None, why not)."""
    path = Path(folder) / f"{stem}.json"
    problem = cache_file_problem(path)
    if problem:
        return None, problem
    try:
        manifest = json.loads(read_nofollow(path))
    except (OSError, ValueError) as exc:
        return None, f"{path.name} unreadable: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != PREPARED_FORMAT:
        return None, f"{path.name} from another format"
    return manifest, None


def prepared_problem(folder: Path, stem: str = "prepared", *, source: Optional[Path] = None,
                     mode: str = "full") -> Optional[str]:
    """Why ``folder/<stem>.onnx`` may not be used now, or None (:func:`prepared_path`)."""
    mode = digest.check_mode(mode)
    folder = Path(folder)
    manifest, problem = read_manifest(folder, stem)
    if manifest is None:
        return problem
    if manifest.get("key_parts") != prepacked_key_parts():
        return "saved for another onnxruntime version, CPU or format"
    files, digests = manifest.get("files"), manifest.get("digests")
    if not isinstance(files, dict) or not isinstance(digests, dict) or f"{stem}.onnx" not in files:
        return f"{stem}.json lists no files"
    for name, size in files.items():
        if name not in (f"{stem}.onnx", f"{stem}.data"):
            return f"{stem}.json names {name!r}"
        # the graph is small: always digested; so is a data file whose spans are not recorded
        full = mode in digest.FULL_MODES or name.endswith(".onnx") or (
            mode == "sampled" and not isinstance(manifest.get("spot_spans"), list))
        problem = cache_file_problem(folder / name, size=size, recorded=digests.get(name, "") if full else None,
                                     matches=digest.matcher(mode))
        if problem:
            return problem
        if mode == "sampled" and not full:
            problem = _sampled_problem(folder / name, manifest["spot_spans"], manifest.get("spot_digest"))
            if problem:
                return problem
    if source is not None:
        recorded = manifest.get("sources") or [{}]
        if recorded[0].get("path") != str(Path(source).resolve()):
            return f"prepared from {recorded[0].get('path')}, not {source}"
        problem, _ = sources_problem(manifest)
        if problem:
            return problem
    return None


def data_spans(saved: Any, location: str) -> list[tuple[int, int]]:
    """Every span of ``location`` a model ORT saved with its pre-packed weights names, in file order:
    each initializer's bytes and each of its pre-packed blobs (``prepacked_<i>``: ``key|offset;length;
    checksum|...``). ``verify="sampled"`` reads the first and last page of each."""
    from ..onnx_walk import external_data_dict

    spans: set[tuple[int, int]] = set()
    for t in saved.graph.initializer:
        ext = external_data_dict(t)
        if ext.get("location") != location:
            continue
        if int(ext.get("length") or 0):
            spans.add((int(ext.get("offset") or 0), int(ext["length"])))
        for key, value in ext.items():
            if key.startswith("prepacked"):
                for blob in value.split("|")[1:]:
                    offset, length = blob.split(";")[:2]
                    if int(length):
                        spans.add((int(offset), int(length)))
    return sorted(spans)


def _sampled_problem(path: Path, spans: Any, recorded: Any) -> Optional[str]:
    """Why the sampled pages of ``path`` (:func:`ortmem.store.digest.sampled_digest` of ``spans``) are not
    those recorded, or None."""
    try:
        if digest.sampled_digest(path, [(int(o), int(n)) for o, n in spans]) == recorded:
            return None
    except (OSError, TypeError, ValueError) as exc:
        return f"{path.name} unreadable: {exc}"
    return f"{path.name} content changed (sampled digest)"


def prepared_path(folder: Path, stem: str = "prepared", *, source: Optional[Path] = None,
                  mode: str = "full") -> Optional[Path]:
    """``folder/<stem>.onnx`` when ``<stem>.json``, ``<stem>.onnx`` and ``<stem>.data`` all pass
    :func:`ortmem.store.trust.cache_file_problem` (owner, mode, no symlink, size, and the full digest when
    ``mode`` is "full" or "always"; ``"sampled"`` digests the first and last page of every span of the data
    file, each initializer and each pre-packed blob; ``"off"`` checks its size only), the manifest's key
    parts equal this ORT and CPU's, and (``source`` given) the source is unchanged; else None (logged)."""
    problem = prepared_problem(folder, stem, source=source, mode=mode)
    if problem is None:
        return Path(folder) / f"{stem}.onnx"
    log.info("ortmem: not using the prepared model in %s (%s)", folder, problem)
    return None
