"""The one entry point of a start: what the caller asked (a frozen :class:`~ortmem.session.request.Request`)
and any model input in, a :class:`~ortmem.session.handoff.Handoff` out.

For a path, the store answers first (:func:`ortmem.store.verdict.start`, one verdict, read without
parsing the model): a converted entry (pre-packed or not) or a finished one is loaded by path and
nothing else is imported (no onnx either). A miss that converts does so in a helper process
(:mod:`ortmem.session.cold_start_child`), so the session's process imports no onnx then either. A model that needs nothing of the loader or the conversion
(decided from its bytes, or settled by the store) is handed over from its bytes (:func:`_plain`).
Otherwise the model is loaded and converted or handed over as given (:mod:`ortmem.session.cold_start` and the
loader, imported only then); bytes and ``onnx.ModelProto`` are written once to a private
temporary file first, so their weights can be mapped instead of copied.

Every store verdict that names something ORT loads (a hit, or the entry a conversion just published)
becomes a handoff here, in :func:`_from_verdict`, and nowhere else.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from ortmem.onnxfile.model import Model
from ortmem.onnxfile.scan import (DEQUANTIZE, FOLDER_KEY, file_mentions, min_finished_bytes, needs_session_path, plain_handoff)
from ortmem.base.options import get_config
from ortmem.store.handoff_records import facts_of, records_folder
from ortmem.store.start import Decision, Start
from ortmem.store.verdict import start
from ortmem.session.handoff import Handoff
from ortmem.session.request import AS_GIVEN, Request

if TYPE_CHECKING:  # onnx is imported by a start that parses a model, never by a warm start
    import onnx

ModelInput = Union[str, os.PathLike, bytes, "onnx.ModelProto", Model]


def prepare(model: ModelInput, request: Optional[Request] = None) -> Handoff:
    """Turn any supported model input into a :class:`Handoff` (may load or convert; never copies weights)."""
    request = request if request is not None else AS_GIVEN
    if isinstance(model, Model):
        from ortmem.session.cold_start import converted_or_as_is

        return _from_verdict(converted_or_as_is(model, request))
    if isinstance(model, (str, os.PathLike)):
        return _from_path(model, request)
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _spill(lambda f: f.write(model), request)
    if _is_model_proto(model):
        return _spill(lambda f: f.write(model.SerializeToString()), request)
    raise TypeError(f"ortmem cannot load a model from {type(model).__name__}; pass a path, bytes, ModelProto or ortmem.Model")


def _is_model_proto(model: object) -> bool:
    """Whether ``model`` is an ``onnx.ModelProto``, asked without importing onnx: a caller holding one
    has imported it already."""
    onnx = sys.modules.get("onnx")
    return onnx is not None and isinstance(model, onnx.ModelProto)


def _from_path(model: Union[str, os.PathLike], request: Request) -> Handoff:
    """A model file: the store's entry when it has one, else the model loaded, converted or as given."""
    if request.sess_options is not None and get_config(request.sess_options, FOLDER_KEY):
        # ORT would look for every external file in the caller's folder, not beside what we give it
        return Handoff(model=str(model), action=Decision.UNTOUCHED, reason=f"the caller's SessionOptions set {FOLDER_KEY}")
    path = Path(model)
    if path.is_file() and path.stat().st_size < min_finished_bytes():
        # No entry can exist for a small file with nothing to convert: the store is not asked
        plain = _plain(path, request, settled=False)
        if plain is not None:
            return plain
    verdict = Start(Decision.MISS)
    if request.cache is not None:
        verdict = start(request.cache, path, settings=request.settings, fp16_in_fp32=request.fp16_in_fp32,
                        converting=request.converting, prepacked=request.prepacked, packing=request.packing)
    if verdict.path is not None:  # a warm start: nothing to parse but the entry, which ORT reads itself
        return _from_verdict(verdict)
    if verdict.kind is Decision.UNCONVERTED:
        plain = _plain(path, request, settled=True)
        if plain is not None:
            return plain
    from ortmem.session.cold_start_child import converted_on_a_miss

    handoff = _from_verdict(converted_on_a_miss(path, request))
    if FOLDER_KEY in handoff.config and handoff.memory is None and request.sess_options is not None:
        # Only the caller's options could carry the folder entry, and ortmem leaves them alone.
        handoff.after_create()
        return Handoff(model=str(model), action=Decision.UNTOUCHED,
                       reason="no hard link possible beside the caller's SessionOptions")
    if (handoff.action in (Decision.AS_IS, Decision.MAPPED) and handoff.memory is None and handoff.report is None
            and not handoff.declined and handoff.source is not None):
        # ORT gets the model unconverted: its finished entry is built after the first run (if worth it)
        # (small models stay at zero cost)
        if verdict.later is not None and handoff.source.weight_bytes >= min_finished_bytes():
            return replace(handoff, later=verdict.later)
    return handoff


def _plain(path: Path, request: Request, *, settled: bool) -> Optional[Handoff]:
    """The handoff of a model file that needs nothing of the loader or the conversion, decided from its
    bytes (:mod:`ortmem.onnxfile.scan`, as the hook's light route decides): ORT gets the file, or its
    skeleton beside a hard link (``mapped``), and no onnx, loader or pass is imported, so ortmem costs
    nothing where it does nothing. Asked of a file below the finished-entry threshold (nothing in the
    store can be meant for it unless it has something to convert: a byte search, cheaper than the
    walk) and of a model the store has ``settled`` (its verdict ``UNCONVERTED``: an earlier start
    loaded it, converted nothing, and its files are unchanged, so neither the conversion nor the
    loader's checks are needed again). None sends the model the loader's way."""
    if not path.is_file() or not settled and request.converting and file_mentions(path, DEQUANTIZE):
        return None
    records = records_folder(request.cache.root) if request.cache is not None else None
    facts = facts_of(path, records)
    if settled and not facts.embedded_bytes and not facts.recompute and facts.has_graph:
        return Handoff(model=str(path), action=Decision.AS_IS)  # external data ORT maps itself, as plain ORT does
    if needs_session_path(facts, request.converting and not settled):
        return None
    plain = plain_handoff(path, facts)
    if plain is None:
        return None
    if plain.action == Decision.AS_IS.value:  # the scan's own word (onnxfile sits below the store)
        return Handoff(model=str(plain.model), action=Decision.AS_IS)
    # ORT refusing the skeleton gets the file itself (its own error, or the model as given, one warning)
    return Handoff(model=str(plain.model), action=Decision.MAPPED,
                   tempdirs=(plain.workdir,) if plain.workdir is not None else (), fallback=str(path))


def _spill(write: Callable, request: Request) -> Handoff:
    """Write an in-memory model to a private file so its weights can be mapped instead of copied."""
    from ortmem.onnxfile.loader import load
    from ortmem.session.cold_start import converted_or_as_is

    tempdir = Path(tempfile.mkdtemp(prefix="ortmem-"))
    try:
        path = tempdir / "model.onnx"
        with open(path, "wb") as f:
            write(f)
        # a temporary file has no identity worth caching under (and is gone before a background
        # cache write could read it)
        handoff = _from_verdict(converted_or_as_is(load(path), replace(request, cache=None), own_folder=True))
    except BaseException:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise
    return replace(handoff, tempdirs=(*handoff.tempdirs, tempdir))


def _from_verdict(outcome: Union[Handoff, Start]) -> Handoff:
    """The handoff of a store verdict that names something ORT loads (a hit, or the entry a conversion
    just published); a handoff made without the store is returned as it is."""
    if isinstance(outcome, Handoff):
        return outcome
    assert outcome.path is not None
    return Handoff(model=str(outcome.path), action=outcome.kind, cache_hit=outcome.hit,
                   start=outcome, report=outcome.report, later=outcome.later,
                   converted_in_helper=outcome.in_helper,
                   fallback=str(outcome.fallback) if outcome.fallback is not None else None)
