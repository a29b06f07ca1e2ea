"""A start that converts: what ORT would fuse, rewritten ahead of time, then handed over by path or memory.

With a cache, the converted model is published as a new entry (:func:`ortmem.store.publish.publish`)
and loaded by path, so ORT maps each converted tensor from the page cache and drops it after
pre-packing, exactly as it does for a native MatMulNBits model. Without one (``cache=False``, or a
cache that cannot be used), into a private temporary folder loaded the same way and removed once the
session exists; where no such folder can be written, into anonymous memory ORT borrows
(:mod:`ortmem.session.inmemory`; never on the caller's ``SessionOptions``). A model ortmem must not or cannot
convert goes to ORT as given (:mod:`.unconverted`).

Imported only by a start that may convert: a warm start loads none of this (nor the passes).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Optional, Union

from ortmem.errors import CacheError, OrtmemError
from ortmem.session.inmemory import convert_in_memory
from ortmem.onnxfile.model import Model
from ortmem.onnxfile.walk import iter_graphs
from ortmem.passes.engine import plan_conversion
from ortmem.passes.conversion_plan import ConversionPlan
from ortmem.passes.conversion_report import ConversionReport
from ortmem.passes.validity import validity_fault
from ortmem.files.layout import MODEL_FILE
from ortmem.store.publish import publish
from ortmem.store.start import Decision, Start
from ortmem.store.writer import write_converted
from ortmem.session.handoff import Handoff
from ortmem.session.unconverted import from_model

if TYPE_CHECKING:
    from ortmem.session.request import Request

log = logging.getLogger(__name__)


def converted_or_as_is(model: Model, request: Request, own_folder: bool = False) -> Union[Handoff, Start]:
    """The handoff of a loaded model: converted where ORT would fuse and nothing forbids it, else as
    given; or, when the conversion went into the store, the store's verdict on the entry it published
    (the caller, :func:`ortmem.session.decide.prepare`, makes the handoff of every verdict).
    ``own_folder``: the model lives in a private folder ortmem made (a spilled bytes model)."""
    link_root = request.cache.root if request.cache is not None else None
    if not request.converting or not _has_dequantize(model):
        return from_model(model, own_folder=own_folder, link_root=link_root)
    fault = validity_fault(model.skeleton.graph)
    if fault is not None:  # a rewrite could hide it: ORT judges the model as given
        log.info("ortmem: not converting %s (%s); onnxruntime gets it as given", model.path, fault)
        return from_model(model, own_folder=own_folder, link_root=link_root)._replace(declined=True)
    try:
        return _convert(model, request, own_folder)
    except MemoryError:
        raise
    except CacheError:
        raise
    except Exception as exc:  # noqa: BLE001 - any rewrite failure: ORT gets the model as given
        detail = str(exc) if isinstance(exc, OrtmemError) else f"{type(exc).__name__}: {exc}"
        log.warning("ortmem: could not convert %s (%s); onnxruntime gets it as given", model.path, detail)
        return from_model(model, own_folder=own_folder, link_root=link_root)._replace(declined=True)


def _convert(model: Model, request: Request, own_folder: bool) -> Union[Handoff, Start]:
    """The conversion itself (:func:`converted_or_as_is` decides whether to try it)."""
    settings = request.settings
    if request.cache is not None and not request.cache.writable:
        # a cache deployed read-only (`ortmem prepare`, then a read-only mount) takes no new entry: the
        # store said so once if the model's entry is there but stale (ortmem.store.verdict.say_stale)
        log.info("ortmem: the cache %s cannot be written; converting %s without it", request.cache.root, model.path)
    elif request.cache is not None:
        try:
            handoff = into_cache(model, request, own_folder)
            if handoff is not None:
                return handoff
        except CacheError as exc:
            log.warning("ortmem: the cache could not be used (%s); converting without it", exc)
    plan = plan_conversion(model, settings, carry_unchanged=True, fp16_in_fp32=request.fp16_in_fp32)
    if not plan.has_work:
        return from_model(model, own_folder=own_folder)
    handoff = _converted_in_tempdir(model, plan, request, own_folder)
    if handoff is not None:
        return handoff
    if request.sess_options is not None:  # ORT could borrow memory only through the caller's options
        log.warning("ortmem: onnxruntime gets %s as given", model.path)
        return from_model(model, own_folder=own_folder)
    log.warning("ortmem: converting %s in memory instead", model.path)
    memory = convert_in_memory(model, plan, progress=request.progress, prepacking=settings.prepacking,
                               threads=request.packing[1])
    report = ConversionReport.from_plan(plan, memory.seconds)
    model.store.release_all()  # source pages read for conversion go back now
    return Handoff(model=memory.skeleton, config=MappingProxyType(memory.config), source=model, memory=memory,
                   action=Decision.IN_MEMORY, report=report)


def into_cache(model: Model, request: Request, own_folder: bool) -> Union[Handoff, Start, None]:
    """The store's verdict on the model's cache entry, built now (or by another process while this one
    waited), which ORT loads by path; the model as given when nothing is convertible. None when the
    store answers a miss even so (an entry found damaged twice): the caller converts without the cache."""
    assert request.cache is not None
    plan = plan_conversion(model, request.settings, fp16_in_fp32=request.fp16_in_fp32)
    if not plan.has_work:
        return from_model(model, own_folder=own_folder, link_root=request.cache.root)
    start = publish(request.cache, model, plan, settings=request.settings, progress=request.progress,
                    fp16_in_fp32=request.fp16_in_fp32, prepacked=request.prepacked, packing=request.packing)
    if start.path is None:
        return None
    _consume(model)
    return start


def _converted_in_tempdir(model: Model, plan: ConversionPlan, request: Request, own_folder: bool) -> Optional[Handoff]:
    """Convert into a private temporary folder that ORT loads by path (removed after creation); None
    when the folder cannot be written (a full disk): the caller converts in memory, or, with the
    caller's ``SessionOptions``, gives ORT the model as given.

    What a start without a cache does first. ORT maps each converted tensor from the file and drops it
    once packed, exactly as from a cache entry, so the peak is the cold start's; converted into memory
    ORT borrows (:mod:`ortmem.session.inmemory`), every converted tensor stays resident until the session
    exists, beside ORT's packed copies: on the 0.6 GB synthetic Llama (onnxruntime 1.32.0) 1663 MiB at
    the peak (712 of them our buffer), against 1412-1496 for plain ORT on the QDQ model and about 1120
    from a file. With the caller's ``SessionOptions`` memory is not even an option: ORT's only way to
    borrow in-memory files is to register them on the options object
    (``add_external_initializers_from_files_in_memory``), a registration that can be neither undone
    nor kept private (``SessionOptions`` cannot be copied). Left on the caller's object, it made a
    later plain-ORT session of another model whose data file has the same name read *this* model's
    weights. Unchanged tensors are hard-linked from their source files where possible
    (copied otherwise).
    """
    workdir: Optional[Path] = None
    try:
        workdir = Path(tempfile.mkdtemp(prefix="ortmem-convert-", dir=model.folder if own_folder else None))
        report = write_converted(model, plan, workdir, progress=request.progress, link=True,
                                 threads=request.packing[1])
    except OSError as exc:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        log.warning("ortmem: could not write the converted model into %s (%s)", workdir or tempfile.gettempdir(), exc)
        return None
    except BaseException:  # a failed rewrite: nothing half written stays behind (the caller decides what next)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    _consume(model)
    return Handoff(model=str(workdir / MODEL_FILE), tempdirs=(workdir,), action=Decision.CONVERTED_TEMPORARY, report=report)


def conversion_check(model: Model) -> tuple[bool, Optional[str]]:
    """(whether ortmem tries to convert ``model``: it has DequantizeLinear nodes; why it declines: a
    validity fault ORT must judge on the model as given, or None). ``ortmem prepare`` asks the same
    questions a session start does."""
    if not _has_dequantize(model):
        return False, None
    fault = validity_fault(model.skeleton.graph)
    return fault is None, fault


def _has_dequantize(model: Model) -> bool:
    """Cheap pre-check: matching indexes every graph and may have ORT resolve a weightless copy of the
    model (:mod:`ortmem.ort.value_types`), which a model without DequantizeLinear never needs."""
    return any(n.op_type == "DequantizeLinear" for _, g in iter_graphs(model.skeleton.graph) for n in g.node)


def _consume(model: Model) -> None:
    """The source model has been converted: give back every page of it before ORT starts."""
    model.store.mark_handed()
    model.release()
    model.close()
