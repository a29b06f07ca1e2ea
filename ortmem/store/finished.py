"""ORT's finished model: the graph as ORT optimized it for the caller's settings, every weight it holds
(the optimizer-made and constant-folded ones included) and its pre-packed buffers, saved in a file ORT maps.

Why
---
A session ORT creates from a source model runs the graph optimizers at its level, and every weight
they make (NCHWc-reordered convolution filters, folded Transposes of tied embeddings, fused weights, the
int8 kernels' packed B) and every pre-packed buffer lands on that process's private heap. ORT can save
the model as it finished it (``optimized_model_filepath`` with
``session.optimized_model_external_initializers_file_name`` and
``session.save_external_prepacked_constant_initializers``); a session on that save with graph
optimizations off maps all of it. Measured on onnxruntime 1.32.0, fresh processes, private memory
after creation and one run: a conv net 94 -> 33 MiB, an fp32 encoder 68 -> 28, its ``quantize_dynamic``
int8 copy 40 -> 30, a 0.6 GB native int4 decoder 891 -> 42 (an empty interpreter: 21.5), outputs identical.

How
---
A throw-away session over the source at the caller's effective settings (``settings``: optimization level,
disabled optimizers, and every config entry the caller set that this ORT defines,
:func:`ortmem.ort.settings.caller_config`) writes ``<stem>.onnx`` and ``<stem>.data``: every
initializer of :data:`EXTERNAL_MIN_BYTES` or more in the data file (smaller ones stay in the graph: ORT's
shape inference reads an axes or shape input only from the graph, and ORT keeps such a tensor in its
proto, not on the heap), then the ``prepacked_<i>`` blobs. onnxruntime 1.32.0 has no option that aligns
the offsets of a saved model's external initializers (only the compile API does): ORT maps each tensor
from the page its offset falls in, so an unaligned one shares its first and last page with its
neighbours. The model is loaded with ``ORT_DISABLE_ALL`` set on the caller's options for the creation
call only (:meth:`ortmem.session.handoff.Handoff.creation_options`); pre-packing stays on (the saved
blobs are used only by a session that pre-packs), and the save's own opset imports name every domain
its nodes use (``com.microsoft.nchwc`` included).

Before anything is published, :func:`worth_mapping` runs the source at the caller's settings and the
finished model at ``ORT_DISABLE_ALL`` on the same feeds (:func:`ortmem.ort.feeds.make_inputs`; a
decoder's first step: empty KV cache, its head size and head count from ``genai_config.json`` or its
attention nodes) and requires identical outputs, the source's graph inputs and outputs (no free dimension
baked in) and measurably less private memory. A model those feeds cannot run is not judged at all:
:class:`FinishCheckError`, nothing is written, and a later finishing tries again (a verdict such as
"nothing ORT keeps is mapped" is recorded only where the check ran). A release that cannot save or
reload a finished model correctly gives other outputs or fails, and publishes nothing.

What is checked, and when (:func:`finished_path`, on every use)
-------------------------------------------------------------
``<stem>.json`` is written last and atomically; it records what the finished model is valid for
(:func:`finished_key_parts`: ORT release and build, CPU, format, and the settings it was finished at), the source's identity (the
.onnx and each external data file: :func:`ortmem.files.sources.source_record`) and a full digest of each
written file. Before use, every file passes the cache's one trust check
(:func:`ortmem.files.trust.cache_file_problem`: owner, mode, no symbolic link, size and, in ``"full"``
mode, every byte), the key parts must equal this ORT's, CPU's and settings' and (``source`` given) the source must
be unchanged. This module knows nothing of the cache: :mod:`ortmem.store.finished_entries` keeps these files
in cache entries; onnxruntime-genai folders keep them inside the folder.
"""
from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import onnxruntime as ort

from ortmem.base.records import record
from ortmem.base import logs
from ortmem.files import digest
from ortmem.files.sources import source_record, sources_problem
from ortmem.errors import CacheError
from ortmem.files.trust import (PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, cache_file_problem, fsync_dir, read_nofollow, write_new)
from ortmem.base.ort_class import ORT_SESSION  # ORT's own class: never a hooked session
from ortmem.ort.settings import OrtSettings



def finished_key_parts(settings: Optional[OrtSettings] = None) -> dict[str, Any]:
    """What a finished model depends on beyond its source: the ORT release and build (its version, its
    build info and its native module's identity), the CPU's features and this format, and (``settings``
    given) the optimization level, disabled optimizers and config entries it was finished at."""
    from ortmem.ort.release import cpu_flags, installed, machine

    parts: dict[str, Any] = {"finished_format": FINISHED_FORMAT, "onnxruntime": ort.__version__,
                             "machine": machine(), "cpu_flags": list(cpu_flags()),
                             "build": installed().build, "build_info": getattr(ort, "get_build_info", lambda: "")()}
    if settings is not None:
        parts["settings"] = settings_parts(settings)
    return parts


def settings_parts(settings: OrtSettings) -> dict[str, Any]:
    """The parts of ``settings`` a finished model depends on (level, disabled optimizers, every config
    entry), as JSON."""
    return {"level": int(settings.graph_optimization_level), "disabled": sorted(settings.disabled_optimizers),
            "config": dict(sorted(settings.session_config.items()))}

#: Bumped whenever what :func:`finish_model` writes, or the rule deciding whether it is published,
#: changes. 2: published only where :func:`worth_mapping` measured a gain (a format-1 entry may be one
#: that holds more private memory than plain ORT; its key no longer matches, so it is never served).
#: 3: the check runs decoders on their first step (format 2 ran them on made-up cache shapes ORT's attention
#: refused, and recorded "packs nothing" for every such decoder).
#: 4: ORT's finished model at the caller's settings (format 3 saved the source graph at ORT_DISABLE_ALL).
FINISHED_FORMAT = 4
#: Initializers of at least this many bytes go to the data file (ORT keeps smaller ones in its proto
#: rather than on the heap, and its shape inference reads an axes or shape input only from the graph).
EXTERNAL_MIN_BYTES = 128
_WORK_PREFIX = ".prepare-"


class FinishError(CacheError):
    """ORT could not save the finished model (names the source)."""


class NoSpaceError(FinishError):
    """The finished model could not be written: its filesystem is full (names the folder). No verdict on
    the model: nothing but the full disk may be recorded of it."""


#: Free bytes below which a failed save is put down to a full disk: a write that runs out of space fills
#: the filesystem to its last block first (a partial write, then ENOSPC), and ORT's partial file is still
#: there when this is checked; a filesystem with a MiB free did not fill.
NEARLY_FULL_BYTES = 1 << 20


def free_bytes(folder: Path) -> Optional[int]:
    """Bytes still free on ``folder``'s filesystem (None: unknown)."""
    import shutil

    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _no_space(folder: Path, what: str, exc: BaseException) -> NoSpaceError:
    """The error for a write into ``folder`` that found its filesystem full (ORT's own words kept)."""
    last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    detail = last.rsplit(" : ", 1)[-1][-300:]
    return NoSpaceError(f"no space left on device in {folder}: {what} ({detail})", file=str(folder))


class FinishCheckError(FinishError):
    """The check that decides whether a finished model may be used could not run (the source fails on
    the feeds ortmem makes): no verdict, so nothing may be recorded of it (names the source)."""


@record
class FinishedReport:
    """What :func:`finish_model` did."""

    seconds: float
    prepacked: int  # initializers ORT saved pre-packed blobs for
    data_bytes: int  # size of <stem>.data
    useful: bool  # worth_mapping: identical outputs, and mapping saves heap (False: the caller keeps no files)
    #: Why a model with pre-packed blobs is still not worth mapping (:func:`worth_mapping`), else "".
    refusal: str = ""


#: Why a finished model in which ORT made no weight and packed none is not kept: it maps what the source
#: maps already.
NOTHING_MADE = "onnxruntime makes no weight of it and packs none: nothing to map"


def _initializer_names(source: Path) -> set[str]:
    """The names of the source's initializers (its graph only: what ORT may replace or add to)."""
    import onnx

    return {t.name for t in onnx.load(str(source), load_external_data=False).graph.initializer}


def source_files(source: Path) -> list[Path]:
    """The .onnx file and every external data file its tensors point into (what a finished model is
    made from, so what must stay unchanged for it to be used)."""
    import onnx  # the writing half parses models; a warm start only reads this module's manifest checks

    from ortmem.onnxfile.walk import external_data_dict, is_external, iter_tensor_sites

    model = onnx.load(str(source), load_external_data=False)
    folder = Path(source).resolve().parent
    locations = {external_data_dict(s.tensor).get("location", "") for s in iter_tensor_sites(model)
                 if is_external(s.tensor)}
    return [Path(source).resolve(), *sorted(folder / loc for loc in locations if loc)]


def finish_model(source: Path, folder: Path, stem: str = "prepared", *, settings: Optional[OrtSettings] = None,
                  threads: int = 0) -> FinishedReport:
    """Write ``folder/<stem>.onnx``, ``folder/<stem>.data`` and, last and atomically,
    ``folder/<stem>.json`` (see the module docstring). ``settings``: what the caller's session asks of
    ORT (optimization level, disabled optimizers, and every config entry it set that this ORT defines,
    :func:`ortmem.ort.settings.caller_config`): the model is finished at those; ``prepacking``
    False writes nothing (``useful`` False).
    ``threads``: intra-op threads of the throw-away session (0: ORT's default).

    Raises :class:`FinishError` when ORT fails to load or save the model, :class:`NoSpaceError` when
    ``folder``'s filesystem is full (ENOSPC, or ORT's failed write with less than
    :data:`NEARLY_FULL_BYTES` left), :class:`FinishCheckError` when the source cannot be run to check
    the saved model; nothing is published then.
    """
    try:
        return _finish_model(Path(source), Path(folder), stem, settings, threads)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(Path(folder), "the finished model could not be written", exc) from exc
        raise


def _finish_model(source: Path, folder: Path, stem: str, settings: Optional[OrtSettings],
                   threads: int) -> FinishedReport:
    """:func:`finish_model`'s work; an OSError of a full disk is turned into :class:`NoSpaceError` there."""
    import shutil
    import uuid

    import onnx

    from ortmem.onnxfile.walk import external_data_dict

    start = time.perf_counter()
    source, folder = Path(source), Path(folder)
    settings = settings or OrtSettings()
    if not settings.prepacking:
        return FinishedReport(time.perf_counter() - start, 0, 0, False)
    record = source_record(source_files(source))  # before ORT reads it: an edit meanwhile shows later
    work = folder / f"{_WORK_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.mkdir(work, PRIVATE_DIR_MODE)  # exclusively: whatever is planted under this name is never written through
    os.chmod(work, PRIVATE_DIR_MODE)
    try:
        try:
            _save(source, work, stem, settings, threads)
        except FinishError as exc:
            left = free_bytes(work)  # before ORT's partial file goes (the finally below)
            if left is not None and left < NEARLY_FULL_BYTES:
                raise _no_space(folder, "onnxruntime could not write the finished model", exc) from exc
            raise
        saved = onnx.load(str(work / f"{stem}.onnx"), load_external_data=False)
        prepacked = sum(any(k.startswith("prepacked") for k in external_data_dict(t)) for t in saved.graph.initializer)
        made = prepacked or bool({t.name for t in saved.graph.initializer} - _initializer_names(source))
        refusal = worth_mapping(source, work / f"{stem}.onnx", settings, threads) if made else NOTHING_MADE
        if refusal:
            logs.info(__name__, "ortmem: %s is not finished: %s", source, refusal)
        names = [n for n in (f"{stem}.onnx", f"{stem}.data") if (work / n).exists()]
        for name in names:
            os.chmod(work / name, PRIVATE_FILE_MODE)
        files = {n: (work / n).stat().st_size for n in names}
        manifest = {"format": FINISHED_FORMAT, "key_parts": finished_key_parts(settings), "created": time.time(),
                    "files": files, "digests": {n: digest.file_digest(work / n) for n in names}, **record}
        if f"{stem}.data" in files:  # what verify="sampled" reads: the first and last page of every span
            spans = data_spans(saved, f"{stem}.data")
            manifest.update(spot_spans=spans, spot_digest=digest.sampled_digest(work / f"{stem}.data", spans))
        _publish(work, folder, stem, names)
        report = FinishedReport(time.perf_counter() - start, prepacked, files.get(f"{stem}.data", 0), refusal is None,
                                refusal or "")
        manifest["report"] = report._asdict()
        tmp = folder / f".{stem}.json.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        write_new(tmp, json.dumps(manifest, indent=1).encode(), sync=True)
        os.replace(tmp, folder / f"{stem}.json")
        fsync_dir(folder)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: A finished model is used only where the session over it keeps at most this fraction of the private
#: memory a session over the source keeps (both measured in the finishing process, after a run and
#: ``malloc_trim``). Measured on onnxruntime 1.32.0: the fp32 MLP keeps 0.05x, a native int4 Llama 0.05x,
#: while a ``quantize_dynamic`` int8 model keeps 1.0x (its blobs, saved from MatMulInteger at
#: ORT_DISABLE_ALL, never match once the session fuses it), where mapping only adds ortmem's costs.
GAIN_FRACTION = 0.8
#: Below this much private memory kept by the source's session the in-process measurement cannot tell a
#: gain from allocator noise (a 0.5 MiB MLP measured either way from run to run on 1.31.1): such a model
#: (finished only below the default size threshold) is judged by its outputs alone.
MEASURABLE_BYTES = 4 << 20


#: Sizes the check tries for axes nothing names, after the default sequence length, when the source
#: refuses its feeds (a convolution network's image sides must divide by its stride).
UNKNOWN_DIM_RETRIES = (32, 64)


def worth_mapping(source: Path, finished: Path, settings: OrtSettings, threads: int = 0) -> Optional[str]:
    """None when the finished model at ``ORT_DISABLE_ALL`` gives the source's outputs at ``settings`` bit
    for bit, has the source's graph inputs and outputs, and keeps measurably less private memory; else
    why not (the caller then keeps no files).

    Each is asked of the installed ORT, not assumed: onnxruntime 1.28.0 reloads the saved blobs of a
    native MatMulNBits model as NaN (a silently wrong output had the entry been used). Feeds are synthetic
    (floats from a fixed seed, integers 0, batch 1, sequence 8; a decoder's first step, its cache empty:
    :func:`ortmem.ort.feeds.decoder_dims`; axes nothing names at 32, then 64, if the source refuses
    them), made once from the source and given to both.

    Raises :class:`FinishCheckError` when the source itself cannot be run on them: that is no verdict
    on the finished model, and the caller records none. ORT's own log stays quiet (the error says why).
    """
    from ortmem.base.hygiene import trim
    from ortmem.ort.feeds import decoder_dims, make_inputs

    feeds: dict[str, Any] = {}
    dims = decoder_dims(source)

    def run(path: Path, finished: bool) -> tuple[list[Any], int, list[tuple[Any, ...]]]:
        so = session_options(settings, threads, finished=finished)
        trim()
        before = _rss_anon()
        session = ORT_SESSION(str(path), so, providers=["CPUExecutionProvider"],
                                       disabled_optimizers=None if finished else sorted(settings.disabled_optimizers))
        if not feeds:
            feeds.update(make_inputs(session, {"int_high": 1, "dims": dims}))
        signature = [(v.name, v.type, tuple(v.shape)) for v in (*session.get_inputs(), *session.get_outputs())]
        outputs = session.run(None, feeds)
        trim()
        kept = _rss_anon() - before
        del session
        return outputs, kept, signature

    attempts = (None, *UNKNOWN_DIM_RETRIES)
    for attempt, seq in enumerate(attempts):
        if seq is not None:  # the source refused the feeds: unknown axes larger (image sides that must
            feeds.clear()    # divide by a network's stride, e.g. a detector's 32)
            dims = {**dims, "seq": seq}
        try:
            expected, source_kept, source_signature = run(source, False)
            break
        except Exception as exc:  # noqa: BLE001 - ORT's own types: a model synthetic feeds cannot run
            if not feeds or attempt == len(attempts) - 1:  # no feeds made: creation failed, retrying is no use
                shapes = ", ".join(f"{k} {list(np.shape(v))}" for k, v in feeds.items())
                raise FinishCheckError(f"the check of the finished model could not run the source ({_ort_message(exc)}; "
                                       f"feeds: {shapes or 'none made'}); nothing recorded, a later start tries again",
                                       file=str(source)) from exc
    try:
        got, finished_kept, signature = run(finished, True)
    except Exception as exc:  # noqa: BLE001 - the source runs on these feeds, the saved model does not
        return f"onnxruntime {ort.__version__} cannot run the finished model ({_ort_message(exc)})"
    if signature != source_signature:
        return "the finished model's graph inputs or outputs are not the source's"
    same = len(got) == len(expected) and all(
        np.asarray(a).shape == np.asarray(b).shape and np.array_equal(a, b, equal_nan=False) for a, b in zip(got, expected))
    if not same:
        return f"onnxruntime {ort.__version__} gives other outputs on the finished model than on the source"
    if source_kept >= MEASURABLE_BYTES and finished_kept > GAIN_FRACTION * source_kept:
        return (f"the finished model keeps {finished_kept / 2**20:.1f} MiB private against the source's "
                f"{source_kept / 2**20:.1f} MiB: nothing ORT keeps is mapped")
    return None


def session_options(settings: OrtSettings, threads: int = 0, *, finished: bool = False) -> ort.SessionOptions:
    """Fresh options for a session at ``settings`` (level, config entries; disabled optimizers are
    ``InferenceSession``'s keyword), or, ``finished``, for a session on a finished model
    (``ORT_DISABLE_ALL``: ORT uses it as it was saved). Quiet: a failure is said by ortmem's error."""
    so = ort.SessionOptions()
    so.log_severity_level = _ORT_QUIET
    for key, value in settings.session_config.items():
        so.add_session_config_entry(key, value)
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if finished
                                   else ort.GraphOptimizationLevel(min(int(settings.graph_optimization_level), 99)))
    if threads:
        so.intra_op_num_threads = threads
    return so


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
    from ortmem.base.procfs import read_status

    return (read_status("self") or {}).get("RssAnon", 0)


def _save(source: Path, work: Path, stem: str, settings: OrtSettings, threads: int) -> None:
    """The throw-away session that finishes the source at ``settings`` and writes ``work/<stem>.onnx`` and
    ``.data`` (freed before return: saving keeps every initializer alive in it)."""
    from ortmem.ort.settings import SAVE_CONFIG_KEYS

    so = session_options(settings, threads)
    so.optimized_model_filepath = str(work / f"{stem}.onnx")
    own = dict(zip(SAVE_CONFIG_KEYS, (f"{stem}.data", str(EXTERNAL_MIN_BYTES), "1")))
    for key, value in own.items():  # after the caller's: ortmem's own override any it set
        so.add_session_config_entry(key, value)
    try:
        session = ORT_SESSION(str(source), so, providers=["CPUExecutionProvider"],
                                       disabled_optimizers=sorted(settings.disabled_optimizers) or None)
        del session
    except Exception as exc:  # noqa: BLE001 - ORT raises its own pybind types
        raise FinishError(f"onnxruntime could not save the finished model: {exc}", file=str(source)) from exc
    if not (work / f"{stem}.onnx").exists():
        raise FinishError("onnxruntime saved no finished model", file=str(source))


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
    if not isinstance(manifest, dict) or manifest.get("format") != FINISHED_FORMAT:
        return None, f"{path.name} from another format"
    return manifest, None


def finished_problem(folder: Path, stem: str = "prepared", *, source: Optional[Path] = None,
                     mode: str = "full", settings: Optional[OrtSettings] = None) -> Optional[str]:
    """Why ``folder/<stem>.onnx`` may not be used now, or None (:func:`finished_path`)."""
    mode = digest.check_mode(mode)
    folder = Path(folder)
    manifest, problem = read_manifest(folder, stem)
    if manifest is None:
        return problem
    parts = manifest.get("key_parts")
    if not isinstance(parts, dict) or {k: v for k, v in parts.items() if k != "settings"} != finished_key_parts():
        return "saved for another onnxruntime version or build, CPU or format"
    if settings is not None and parts.get("settings") != settings_parts(settings):
        return "finished at other session settings"
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
            return f"finished from {recorded[0].get('path')}, not {source}"
        problem, _ = sources_problem(manifest)
        if problem:
            return problem
    return None


def finished_for(folder: Path, stem: str, settings: OrtSettings) -> Optional[dict[str, Any]]:
    """``folder/<stem>.json`` when it passes the cache's file check and was written for this ORT, CPU and
    ``settings`` (its files are not checked: :func:`finished_problem` does that), else None."""
    manifest, _ = read_manifest(folder, stem)
    parts = manifest.get("key_parts") if manifest is not None else None
    if (isinstance(parts, dict) and {k: v for k, v in parts.items() if k != "settings"} == finished_key_parts()
            and parts.get("settings") == settings_parts(settings)):
        return manifest
    return None


def finished_settled(folder: Path, stem: str, settings: OrtSettings) -> bool:
    """Whether ``folder/<stem>.json`` records, for this ORT, CPU and ``settings``, that the finished model
    was judged and not kept (its ``report`` says not ``useful``): nothing to map, so nothing to finish
    again."""
    report = (finished_for(folder, stem, settings) or {}).get("report")
    return isinstance(report, dict) and report.get("useful") is False


def keep_decision_only(folder: Path, stem: str) -> None:
    """Remove ``<stem>.onnx`` and ``<stem>.data`` of a finished model not worth mapping, keeping
    ``<stem>.json`` (its report records the decision, :func:`finished_settled`)."""
    for suffix in (".onnx", ".data"):
        try:
            os.unlink(Path(folder) / f"{stem}{suffix}")
        except FileNotFoundError:
            pass


def discard_finished(folder: Path, stem: str) -> None:
    """Remove a finished model's files (the manifest first, so no reader trusts a half-removed set)."""
    for suffix in (".json", ".onnx", ".data"):
        try:
            os.unlink(Path(folder) / f"{stem}{suffix}")
        except OSError:  # absent, or a read-only folder: the manifest check refuses the rest
            pass


def data_spans(saved: Any, location: str) -> list[tuple[int, int]]:
    """Every span of ``location`` a model ORT saved with its pre-packed weights names, in file order:
    each initializer's bytes and each of its pre-packed blobs (``prepacked_<i>``: ``key|offset;length;
    checksum|...``). ``verify="sampled"`` reads the first and last page of each."""
    from ortmem.onnxfile.walk import external_data_dict

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
    """Why the sampled pages of ``path`` (:func:`ortmem.files.digest.sampled_digest` of ``spans``) are not
    those recorded, or None."""
    try:
        if digest.sampled_digest(path, [(int(o), int(n)) for o, n in spans]) == recorded:
            return None
    except (OSError, TypeError, ValueError) as exc:
        return f"{path.name} unreadable: {exc}"
    return f"{path.name} content changed (sampled digest)"


def finished_path(folder: Path, stem: str = "prepared", *, source: Optional[Path] = None,
                  mode: str = "full", settings: Optional[OrtSettings] = None) -> Optional[Path]:
    """``folder/<stem>.onnx`` when ``<stem>.json``, ``<stem>.onnx`` and ``<stem>.data`` all pass
    :func:`ortmem.files.trust.cache_file_problem` (owner, mode, no symlink, size, and the full digest when
    ``mode`` is "full" or "always"; ``"sampled"`` digests the first and last page of every span of the data
    file, each initializer and each pre-packed blob; ``"off"`` checks its size only), the manifest's key
    parts equal this ORT's (release and build) and CPU's, and ``settings``' where given, and (``source``
    given) the source is unchanged; else None (logged)."""
    problem = finished_problem(folder, stem, source=source, mode=mode, settings=settings)
    if problem is None:
        return Path(folder) / f"{stem}.onnx"
    logs.info(__name__, "ortmem: not using the finished model in %s (%s)", folder, problem)
    return None
