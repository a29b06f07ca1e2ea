"""A cold start's conversion in a helper process, so the session's own process never imports onnx.

Why: a cold start's peak is ORT creating the session from the entry the conversion just published,
and whatever the conversion left in the process is still there then: onnx's import (11 MiB of RSS:
its C++ schemas, protobuf, ``ml_dtypes``, 115 modules), the loader's and the passes' (3 more), and
what glibc kept of the conversion's heap. On the 0.6 GB synthetic Llama (onnxruntime 1.32.0) the
cold start peaked at 1116.5 MiB against the twin's 1099.2 (1.016x, docs/benchmarks.md); within 1%
of the twin was out of reach with onnx imported at all. The allocator pin that held the conversion's
heap down (:func:`ortmem.base.hygiene.allocator_hygiene`) also stayed on while ORT created the session,
where it turned ORT's buffers into fresh mappings: 0.2-0.7 s of a 4 s cold start, depending on the
run. Converted here, the session's process imports nothing of the conversion, creates its
session the way a cache hit does (no pin; a trim after), and peaks at 1101.2 MiB (1.002x the twin);
the helper's own peak is 315 MiB, and it has exited before ORT starts.

What it costs: an interpreter with numpy, onnxruntime and onnx (0.30 s, against 0.13 s for the same
imports in the session's process), which the pin's cost it removes outweighs at this size
(the whole cold start, this helper included, is timed by ``ortmem bench
--whole-process``).

When: a model path, a usable cache, converting, no ``progress`` callback (it would run in another
process), model files of at least :data:`ortmem.onnxfile.scan.MIN_HELPER_BYTES` (below that the
interpreter's start is a large share of the cold start, ``$ORTMEM_CONVERT_HELPER_MIN_BYTES`` sets it),
and a file that may hold a DequantizeLinear ortmem converts (nothing else can be converted:
:func:`ortmem.onnxfile.scan.convertible_file`, read from the file's structure, its weights skipped).
The helper does what the session's process would have done: load, check, plan and publish the entry
under its creator lock (:func:`ortmem.session.cold_start.into_cache`). Only two answers come back:
the entry it published (key, report, its log records), or "the store has an entry now" (another
process built it while the helper waited), on which the session's process asks the store again
(its own verdict: pre-packed weights, the caller's options). Any other outcome (nothing to convert,
a model ortmem declines, a cache error, a failure, a crash, a helper that cannot start, no answer
within :func:`helper_timeout`)
comes back as nothing, and the session's
process converts as before: every outcome but the common one keeps its one code path, and its
warnings are emitted once, by that process.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Union

from ortmem.base.records import record
from ortmem.base.child_env import helper_environment
from ortmem.base.logs import debug, warning
from ortmem.onnxfile.scan import convertible_file, min_helper_bytes, model_files_bytes
from ortmem.ort.settings import OrtSettings
from ortmem.store.publish import new_entry_start
from ortmem.store.start import Decision, Start
from ortmem.store.verdict import start
from ortmem.session.handoff import Handoff
from ortmem.session.request import Request

#: The helper's answer when the store has an entry for the model that it did not build itself.
STORED = "stored"


@record
class Job:
    """What the helper is asked: the model and everything of the request the conversion reads."""

    path: str
    cache_root: str
    verify: str
    settings: OrtSettings
    fp16_in_fp32: Optional[bool]
    #: The caller's ``intra_op_num_threads`` (0: ORT's default): the conversion's thread count follows it.
    intra_op_num_threads: int


@record
class Published:
    """The entry the helper built: its key, the conversion's report, and its log records
    (``(logger name, level, message)``), which the session's process emits as its own."""

    key: str
    report: object
    records: list[tuple[str, int, str]]


def converted_on_a_miss(path: Path, request: Request, *, convertible: Optional[bool] = None) -> Union[Handoff, Start]:
    """A model file the store has no entry for: converted in a helper process when that is worth it
    (see the module docstring), else loaded here and converted or handed over as given
    (:func:`ortmem.session.cold_start.converted_or_as_is`). A file whose structure holds nothing
    ortmem converts (:func:`ortmem.onnxfile.scan.convertible_file`, unless the caller found out
    already: ``convertible``) is loaded and handed over without a plan or a helper."""
    if convertible is None and request.converting and path.is_file():
        convertible = convertible_file(path)
    if request.converting and convertible is False:
        request = request._replace(converting=False)
    model_bytes = _worth_a_helper(path, request)
    if model_bytes:
        start = _converted_in_helper(path, request, model_bytes)
        if start is not None:
            return start
    from ortmem.onnxfile.loader import load
    from ortmem.session.cold_start import converted_or_as_is

    return converted_or_as_is(load(path), request)


def _worth_a_helper(path: Path, request: Request) -> int:
    """The size of the model's files when its start converts in a helper, else 0: files that reach
    :func:`ortmem.onnxfile.scan.min_helper_bytes`, a usable cache this process may write (the helper
    publishes into it), converting (the caller found something that may convert), and no
    ``progress`` callback."""
    if (request.cache is None or not request.cache.writable or not request.converting or request.progress is not None
            or not path.is_file()):
        return 0
    model_bytes = model_files_bytes(path)
    return model_bytes if model_bytes >= min_helper_bytes() else 0


def helper_timeout(model_bytes: int) -> float:
    """How long a start waits for its conversion helper: 120 s plus 30 s per GB of model files, 15 to
    60 times what the conversion takes on 2 cores (0.6 GB in 1.6 s, interpreter included).
    Past it the helper is killed (its creator lock goes with it, and the cache reclaims its
    unpublished folder) and the start converts in its own process: a helper that cannot start (an
    embedding host whose ``sys.executable`` is not a Python) or hangs never makes the start wait
    without bound."""
    return 120.0 + 30.0 * model_bytes / 1e9


def _converted_in_helper(path: Path, request: Request, model_bytes: int) -> Optional[Start]:
    """The new entry's verdict (``"converted"``) when the helper built it; a hit when the store has
    an entry now that another process built (asked again with this start's own request); None when
    the caller converts in its own process (see the module docstring)."""
    assert request.cache is not None
    job = Job(str(path), str(request.cache.root), request.cache.verify_mode,
              request.settings._replace(session_config=dict(request.settings.session_config)), request.fp16_in_fp32,
              request.packing[1])
    started = time.perf_counter()
    timeout = helper_timeout(model_bytes)
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=helper_environment())
    except OSError as exc:  # no interpreter to start, no process left: this process converts
        warning(__name__, "ortmem: could not start the conversion helper for %s (%s); converting in this process",
                path, exc)
        return None
    try:
        out, err = proc.communicate(pickle.dumps(job), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        warning(__name__, "ortmem: the conversion helper for %s did not answer within %.0f s; converting in "
                "this process", path, timeout)
        return None
    except BaseException:  # interrupted: the helper must not outlive the start that asked for it
        proc.kill()
        proc.wait()
        raise
    answer = None
    if proc.returncode == 0 and out:
        try:
            answer = pickle.loads(out)
        except Exception:  # noqa: BLE001 - a truncated answer is no answer
            answer = None
    debug(__name__, "ortmem: conversion helper for %s: exit %s, %.2f s, answer %s%s", path, proc.returncode,
          time.perf_counter() - started, type(answer).__name__, f"; stderr: {err.decode(errors='replace')}" if err else "")
    if answer == STORED:
        verdict = start(request.cache, path, settings=request.settings, fp16_in_fp32=request.fp16_in_fp32,
                        converting=request.converting, prepacked=request.prepacked, packing=request.packing)
        return verdict if verdict.path is not None else None
    if not isinstance(answer, Published):
        return None
    entry = request.cache.entry(answer.key)
    if not entry.model_path.is_file():  # removed since (a cache clear): the caller converts
        return None
    _emit(answer.records)
    made = new_entry_start(request.cache, entry, answer.report, finishing=request.prepacked, settings=request.settings,
                           packing=request.packing)
    return made._replace(in_helper=True)


def _emit(records: list[tuple[str, int, str]]) -> None:
    """The helper's log records, emitted by this process's loggers (its handlers, its levels)."""
    if not records:
        return
    import logging

    for name, level, message in records:
        logging.getLogger(name).log(level, "%s", message)


def _convert(job: Job) -> object:
    """In the helper: what the session's process would have done with a miss (load, check, plan,
    publish), answered as :class:`Published`, :data:`STORED` or None."""
    import logging

    from ortmem.onnxfile.loader import load
    from ortmem.store.cache import open_cache
    from ortmem.session.cold_start import conversion_check, into_cache

    records: list[tuple[str, int, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.name, record.levelno, record.getMessage()))

    root = logging.getLogger("ortmem")
    root.addHandler(Collect(logging.DEBUG))
    root.setLevel(logging.DEBUG)
    root.propagate = False  # nothing printed here: the session's process emits what it keeps
    cache = open_cache(Path(job.cache_root), verify=job.verify)
    if cache is None:
        return None
    model = load(job.path)
    if not conversion_check(model)[0]:
        return None
    # prepacked=False: a hit found here is loaded (and finished later) by the session's process, with its options
    request = Request(converting=True, settings=job.settings, cache=cache, fp16_in_fp32=job.fp16_in_fp32,
                      packing=({}, job.intra_op_num_threads))
    outcome = into_cache(model, request, own_folder=False)
    if isinstance(outcome, Handoff):  # nothing to convert: the caller hands the model over itself
        outcome.after_create()
        return None
    if outcome is None or outcome.path is None:
        return None
    if outcome.kind is Decision.CONVERTED and outcome.entry is not None:
        return Published(outcome.entry.key, outcome.report, records)
    return STORED


def main() -> None:
    """``python -m ortmem.session.cold_start_child``: a :class:`Job` pickled on stdin, the answer
    pickled on stdout. What the conversion prints goes to stderr; the answer is written last and
    the process ends without Python's teardown (nothing is left to flush or join)."""
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    job = pickle.loads(sys.stdin.buffer.read())
    try:
        answer = _convert(job)
    except Exception as exc:  # noqa: BLE001 - the session's process converts, and reports it, itself
        print(f"ortmem conversion helper: {type(exc).__name__}: {exc}", file=sys.stderr)
        answer = None
    data = pickle.dumps(answer)
    with os.fdopen(answer_fd, "wb") as out:
        out.write(data)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # Run from the module under its own name: the answer's classes must unpickle in the session's
    # process, where ``__main__`` is the user's program.
    from ortmem.session.cold_start_child import main as run_as_module

    run_as_module()
