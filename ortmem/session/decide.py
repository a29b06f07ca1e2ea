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
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from ortmem.onnxfile import DEQUANTIZE
from ortmem.onnxfile.scan import (FOLDER_KEY, FileFacts, dequantize_facts, finished_entry_possible, for_call,
                                  may_mention, min_finished_bytes, needs_session_path, plain_handoff, read_facts)
from ortmem.base.child_env import store_folder
from ortmem.base.options import get_config, scoped_config

if TYPE_CHECKING:  # onnx is imported by a start that parses a model, never by a warm start
    import onnx
    import onnxruntime as ort

    from ortmem.onnxfile.model import Model
    from ortmem.session.handoff import Handoff
    from ortmem.session.request import Request
    from ortmem.store.start import Start

ModelInput = Union[str, os.PathLike, bytes, "onnx.ModelProto", "Model"]


def prepare(model: ModelInput, request: Optional[Request] = None) -> Handoff:
    """Turn any supported model input into a :class:`Handoff` (may load or convert; never copies weights)."""
    if request is None:
        from ortmem.session.request import AS_GIVEN

        request = AS_GIVEN
    if _is_loaded_model(model):
        from ortmem.session.cold_start import converted_or_as_is

        return _from_verdict(converted_or_as_is(model, request))
    if isinstance(model, (str, os.PathLike)):
        return _from_path(model, request)
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _spill(lambda f: f.write(model), request)
    if _is_model_proto(model):
        return _spill(lambda f: f.write(model.SerializeToString()), request)
    raise TypeError(f"ortmem cannot load a model from {type(model).__name__}; pass a path, bytes, ModelProto or ortmem.Model")


class BytesHandoff:
    """What ORT is given for a model file decided from its bytes alone (:func:`bytes_start`): the file
    as it is (``"as-is"``) or its skeleton beside a hard link (``"mapped"``, the file itself the
    fallback). It answers what a session's creation asks of a :class:`~ortmem.session.handoff.Handoff`
    without importing the handoff or the store; :meth:`handoff` makes the equal ``Handoff`` when
    more is asked (``ortmem_handoff``, a retry on the fallback)."""

    __slots__ = ("model", "action", "tempdirs", "fallback", "weight_bytes")
    #: Nothing is left for after the first run, and no recompute setting is replayed (the bytes
    #: decide only a file that records none).
    later = None
    reason = ""
    report = None
    cache_hit = False

    def __init__(self, model: str, action: str, tempdirs: tuple[Path, ...] = (), fallback: Optional[str] = None,
                 weight_bytes: int = 0):
        self.model, self.action, self.tempdirs, self.fallback = model, action, tempdirs, fallback
        #: The weights ORT maps (:attr:`ortmem.onnxfile.scan.FileFacts.weight_bytes`; 0 where not walked).
        self.weight_bytes = weight_bytes

    def handoff(self) -> Handoff:
        """The :class:`~ortmem.session.handoff.Handoff` :func:`prepare` makes of the same decision."""
        from ortmem.session.handoff import Handoff
        from ortmem.store.start import Decision

        return Handoff(model=self.model, action=Decision(self.action), tempdirs=self.tempdirs, fallback=self.fallback)

    def with_recorded_settings(self) -> "BytesHandoff":
        return self  # the file's bytes hold no recompute metadata (else the session path decides)

    @contextmanager
    def creation_options(self, user_options: Optional[ort.SessionOptions]) -> Iterator[ort.SessionOptions]:
        """``Handoff.creation_options`` for a handoff with no config entry, no recompute setting, no
        borrowed memory and no finished model: the caller's options (or fresh ones), unchanged."""
        with scoped_config(user_options, {}) as options:
            yield options

    def after_create(self) -> None:
        """Remove the private folder of a skeleton written for this start (safe to call again)."""
        if self.tempdirs:
            import shutil  # only then: a file ORT gets as it is, or a record's skeleton, removes nothing

            for d in self.tempdirs:
                shutil.rmtree(d, ignore_errors=True)


def bytes_start(model: Any, sess_options: Optional[ort.SessionOptions], *, convert: bool, cache: Any,
                verify: str, at_defaults: bool = False) -> Optional[BytesHandoff]:
    """What :func:`prepare` decides for a model file with nothing to convert, decided from its bytes
    (:mod:`ortmem.onnxfile.scan`) before anything of the store, the request or the handoff is imported:
    ORT gets the file, or its skeleton beside a hard link. For a file below the finished-entry
    threshold; for a larger one only where its handoff record says the store settled it as given and
    the start is at ORT's defaults (``at_defaults``, :func:`ortmem.base.options.at_defaults`; no walk).
    None where the model needs more (:func:`prepare` decides then, as for any model): not a path,
    the caller's options naming the external-data folder, a larger file without that record,
    DequantizeLinear to convert, facts :func:`_plain` would not hand over, a ``verify`` value the
    cache refuses, or a cache folder not there yet or one the store would not use (the request opens
    the cache then: it creates the folder, or warns once, :func:`ortmem.store.cache.open_cache`). The
    walk is recorded as :func:`_plain` records it (:mod:`ortmem.store.handoff_records`)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    if not (cache is True or cache is False or isinstance(cache, (str, os.PathLike))):
        return None
    if sess_options is not None and get_config(sess_options, FOLDER_KEY):
        return None
    path = Path(model)
    if not path.is_file():
        return None
    large = path.stat().st_size >= min_finished_bytes()
    if large and not (at_defaults and cache is not False):
        return None
    root = None
    if cache is not False:
        from ortmem.files.digest import VERIFY_MODES

        root = store_folder(cache)
        if verify not in VERIFY_MODES or not root.is_dir():
            return None  # the cache refuses the value, or creates its folder: the request opens it
    if large:
        from ortmem.store.handoff_records import as_given_facts

        settled = as_given_facts(root, path)
        if settled is None:
            return None  # the store decides (it may hold, or build, the file's finished entry)
        return _bytes_decision(path, convert, None, settled=False, recorded=settled, at_defaults=True)
    found = _records_and_facts(path, root, converting=convert)
    if found is None:
        return None  # converted, or not for the providers: the request says which (asked first, as ever)
    records, recorded = found
    if root is not None and records is None:  # an untrusted folder: the store's own checks decide (and warn)
        return None
    # Nothing to convert whatever the providers: ``convert`` stands for the request's ``converting``
    # (the walk finds DequantizeLinear only where the search does).
    return _bytes_decision(path, convert, records, settled=False, recorded=recorded, finishable=root is not None,
                           at_defaults=at_defaults)


def _is_loaded_model(model: object) -> bool:
    """Whether ``model`` is an :class:`ortmem.Model`, asked without importing the loader: a caller
    holding one has imported it already."""
    loaded = sys.modules.get("ortmem.onnxfile.model")
    return loaded is not None and isinstance(model, loaded.Model)


def _is_model_proto(model: object) -> bool:
    """Whether ``model`` is an ``onnx.ModelProto``, asked without importing onnx: a caller holding one
    has imported it already."""
    onnx = sys.modules.get("onnx")
    return onnx is not None and isinstance(model, onnx.ModelProto)


def _from_path(model: Union[str, os.PathLike], request: Request) -> Handoff:
    """A model file: the store's entry when it has one, else the model loaded, converted or as given."""
    from ortmem.session.handoff import Handoff
    from ortmem.store.start import Decision, Start
    from ortmem.store.verdict import start

    if request.sess_options is not None and get_config(request.sess_options, FOLDER_KEY):
        # ORT would look for every external file in the caller's folder, not beside what we give it
        return Handoff(model=str(model), action=Decision.UNTOUCHED, reason=f"the caller's SessionOptions set {FOLDER_KEY}")
    path = Path(model)
    small = path.is_file() and path.stat().st_size < min_finished_bytes()
    convertible = None
    if small:
        # Only `ortmem prepare` makes an entry for a small file with nothing to convert, and its
        # handoff record says so: the store is asked for no other
        plain, convertible = _plain(path, request, settled=False)
        if plain is not None:
            return plain
    verdict = Start(Decision.MISS)
    if request.cache is not None:
        verdict = start(request.cache, path, settings=request.settings, fp16_in_fp32=request.fp16_in_fp32,
                        converting=request.converting, prepacked=request.prepacked, packing=request.packing)
    if verdict.path is not None:  # a warm start: nothing to parse but the entry, which ORT reads itself
        return _from_verdict(verdict)
    if verdict.kind is Decision.MISS and not convertible:
        # nothing in the store (or a prepared entry for other settings, or one pruned since): a file
        # with nothing to convert or to check goes as its bytes decide, its finished entry built later
        plain, convertible = _plain(path, request, settled=False, store_missed=True, later=verdict.later)
        if plain is not None:
            return plain
    if verdict.kind is Decision.UNCONVERTED:
        plain, _ = _plain(path, request, settled=True)
        if plain is not None:
            if request.at_defaults and request.cache is not None:
                from ortmem.store.handoff_records import mark_as_given, records_folder

                # kept with the file's handoff record: the next such start needs no store
                mark_as_given(records_folder(request.cache.root), path)
            return plain
    from ortmem.session.cold_start_child import converted_on_a_miss

    handoff = _from_verdict(converted_on_a_miss(path, request, convertible=convertible))
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
            return handoff._replace(later=verdict.later)
    return handoff


def _plain(path: Path, request: Request, *, settled: bool, store_missed: bool = False,
           later: Optional[Any] = None) -> tuple[Optional[Handoff], Optional[bool]]:
    """The handoff of a model file that needs nothing of the loader or the conversion, decided from its
    bytes (:func:`_bytes_decision`, as the hook's light route decides), or None, which sends the model
    the loader's way; with whether the file may hold a DequantizeLinear ortmem converts, where that
    was found on the way (None: not asked), so the caller does not look again. ``later``: the store's
    work for after the first run (its finished entry), kept where the weights ORT maps reach
    :func:`ortmem.onnxfile.scan.min_finished_bytes`."""
    if not path.is_file():
        return None, None
    asked = request.converting and not settled
    found = _records_and_facts(path, request.cache.root if request.cache is not None else None, converting=asked)
    if found is None:
        return None, True
    records, recorded = found
    convertible = (recorded is not None and recorded.convertible) if asked else None
    decided = _bytes_decision(path, request.converting, records, settled=settled, store_missed=store_missed,
                              recorded=recorded, finishable=request.cache is not None and request.prepacked,
                              at_defaults=request.at_defaults)
    if decided is None:
        return None, convertible
    handoff = decided.handoff()
    if later is not None and decided.weight_bytes >= min_finished_bytes():
        return handoff._replace(later=later), convertible
    return handoff, convertible


def _records_and_facts(path: Path, store: Optional[Path], *,
                       converting: bool) -> Optional[tuple[Optional[Path], Optional[FileFacts]]]:
    """(the handoff records folder of ``store``, the facts its record for ``path`` holds) for a file with
    nothing to convert; None where ``converting`` and the file may hold a DequantizeLinear ortmem
    converts. Its record answers that where there is one, so a start of a file seen before reads none
    of its bytes; else a search of its bytes for the op's name (cheaper than the walk), and only where
    it is found, the walk (:func:`ortmem.onnxfile.convertible.may_convert`: most int8 QDQ models hold
    none ortmem converts), recorded (in a folder made for it when there is none yet and nothing in the
    file converts). The folder is None with no ``store``, or one not trusted."""
    records = recorded = walked = None
    if store is not None:
        from ortmem.store.handoff_records import FOLDER, recorded_facts, records_folder

        records = records_folder(store) if (store / FOLDER).is_dir() else None
        if records is not None:
            try:
                recorded = recorded_facts(records, path, os.stat(path))
            except OSError:
                recorded = None
    if converting and recorded is None:
        # where the op's name is in the file, its structure decides whether any of them converts
        # (walked here, and recorded where there is a records folder, as the bytes decision would be)
        if records is not None:
            from ortmem.store.handoff_records import facts_of

            recorded = facts_of(path, records) if may_mention(path, DEQUANTIZE) else None
        else:
            walked = os.stat(path)
            recorded = dequantize_facts(path)
    if converting and recorded is not None and recorded.convertible:
        return None
    if records is None and store is not None:  # made for a file with nothing to convert (a start that converts makes none)
        records = records_folder(store)
        if records is not None and recorded is not None and walked is not None:
            from ortmem.store.handoff_records import record

            recorded = record(records, path, walked, recorded)  # the walk is kept: the next question reads it
    return records, recorded


def _bytes_decision(path: Path, converting: bool, records: Optional[Path], *, settled: bool,
                    store_missed: bool = False, recorded: Optional[FileFacts] = None,
                    finishable: bool = False, at_defaults: bool = False) -> Optional[BytesHandoff]:
    """What ORT gets for a model file that needs nothing of the loader or the conversion, decided from
    its bytes (:mod:`ortmem.onnxfile.scan`): the file, or its skeleton beside a hard link (``mapped``),
    and no onnx, loader or pass is imported, so ortmem costs nothing where it does nothing. Asked of a
    file below the finished-entry threshold whose bytes the caller searched for DequantizeLinear to
    convert (nothing in the store can be meant for it unless it has something to convert: a byte
    search, cheaper than the walk) and of a model the store has ``settled`` (its verdict
    ``UNCONVERTED``: an earlier start loaded it, converted nothing, and its files are unchanged, so
    neither the conversion nor the loader's checks are needed again). The
    walk's facts come from, and go to, the handoff records in ``records`` (None: walked, not
    recorded; ``recorded``: the record's facts the caller read already). A record's mark that ``ortmem
    prepare`` made an entry sends the model to the store, unless the store has just ``store_missed``
    it; so does a small file whose external weights are worth a finished entry, where the store may
    hold one (``finishable``: a cache, pre-packing on); neither does where the record says the store
    settled the file as given and the start is ``at_defaults`` (:func:`ortmem.onnxfile.scan.for_call`).
    None sends the model the loader's way."""
    if recorded is not None:
        facts = recorded
    elif records is None:
        facts = read_facts(path)
    else:
        from ortmem.store.handoff_records import facts_of

        facts = facts_of(path, records)
    facts = for_call(facts, at_defaults)
    if store_missed:
        facts = facts._replace(prepared=False)
    if settled and not facts.embedded_bytes and not facts.recompute and facts.has_graph:
        return BytesHandoff(str(path), "as-is")  # external data ORT maps itself, as plain ORT does
    if needs_session_path(path, facts, converting and not settled):
        return None
    if not settled and not store_missed and finished_entry_possible(facts, finishable):
        return None  # a small file whose external weights are worth a finished entry: the store is asked
    plain = plain_handoff(path, facts)
    if plain is None:
        return None
    if plain.action == "as-is":  # the scan's own word (onnxfile sits below the store)
        return BytesHandoff(str(plain.model), "as-is", weight_bytes=facts.weight_bytes)
    # ORT refusing the skeleton gets the file itself (its own error, or the model as given, one warning)
    return BytesHandoff(str(plain.model), "mapped", (plain.workdir,) if plain.workdir is not None else (), str(path),
                        facts.weight_bytes)


def _spill(write: Callable, request: Request) -> Handoff:
    """Write an in-memory model to a private file so its weights can be mapped instead of copied."""
    import shutil
    import tempfile
    from ortmem.onnxfile.loader import load
    from ortmem.session.cold_start import converted_or_as_is

    tempdir = Path(tempfile.mkdtemp(prefix="ortmem-"))
    try:
        path = tempdir / "model.onnx"
        with open(path, "wb") as f:
            write(f)
        # a temporary file has no identity worth caching under (and is gone before a background
        # cache write could read it)
        handoff = _from_verdict(converted_or_as_is(load(path), request._replace(cache=None), own_folder=True))
    except BaseException:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise
    return handoff._replace(tempdirs=(*handoff.tempdirs, tempdir))


def _from_verdict(outcome: Union[Handoff, Start]) -> Handoff:
    """The handoff of a store verdict that names something ORT loads (a hit, or the entry a conversion
    just published); a handoff made without the store is returned as it is."""
    from ortmem.session.handoff import Handoff

    if isinstance(outcome, Handoff):
        return outcome
    assert outcome.path is not None
    return Handoff(model=str(outcome.path), action=outcome.kind, cache_hit=outcome.hit,
                   start=outcome, report=outcome.report, later=outcome.later,
                   converted_in_helper=outcome.in_helper,
                   fallback=str(outcome.fallback) if outcome.fallback is not None else None)
