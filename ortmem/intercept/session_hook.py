"""``ortmem.hook()``: every ORT session the process creates goes through ortmem, unmodified code included.

How it reaches sessions: ``onnxruntime.InferenceSession`` and
``onnxruntime.capi.onnxruntime_inference_collection.InferenceSession`` are replaced by a factory class
(:class:`HookedInferenceSession`); module-level names already bound to ORT's class in imported modules
(``from onnxruntime import InferenceSession`` executed before the hook) are rebound to it as well.
Calling it creates an :class:`ortmem.InferenceSession` with the hook's options, which is an instance
of ORT's class, so ``isinstance`` checks, methods and properties behave as before. What it cannot
reach: a reference to ORT's class held anywhere but a module global (a closure, a default
argument, a class or instance attribute, a container) taken before the hook, classes that derive
from ``onnxruntime.InferenceSession`` (they get plain ORT: their overrides expect ORT's internals),
and sessions created through ORT's C/C++ API (see docs/hook.md, where each path is tested).

Safety: a model ortmem cannot help with goes to ORT untouched (bytes under :data:`MIN_BYTES`, a
provider for which ortmem makes no difference, session options ortmem cannot read, anything that is
neither a path nor ``bytes`` — a ``bytearray`` stays ORT's ``TypeError``), and any exception from
ortmem's side falls back to plain ORT, its imports included: where ortmem itself cannot work in this
process (its session path cannot be imported, or the ``ortmem`` this process imported is a folder
that shadows the installed package: :mod:`ortmem.intercept.own_package`), every session is plain ORT's,
with one warning for the process that names the cause. Every input plain ORT refuses is refused as plain ORT refuses
it: ortmem tries without ORT's EP fallback (no "EP Error" banner) and holds its own log records back
until it has succeeded, and the fallback creates ORT's session outside the failed attempt, so the
application sees ORT's own exception, unchained, and ORT's own output, once. The one warning is logged
only when plain ORT then succeeds (tests/intercept/test_session_hook_parity.py compares both, input by input). With
``strict=True`` ortmem's exceptions propagate instead. Sessions ortmem itself creates while making
one (pre-packing, probes) always go to ORT directly: the hook is off inside its own work.

Every session created while the hook is on is recorded (:func:`sessions`): model, providers, what
ortmem did, creation time and the process's memory; ``python -m ortmem run --report`` writes them.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import types
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Optional, Union

import onnxruntime as ort
from onnxruntime.capi import onnxruntime_inference_collection as _collection

from ortmem.base.records import record
from ortmem.errors import OrtmemError
from ortmem.base.child_env import ENV_OPTIONS, ENV_SWITCH, store_folder
from ortmem.base.hygiene import trim as trim_heap
from ortmem.base.logs import warning
from ortmem.onnxfile.scan import (FOLDER_KEY, finished_entry_possible, for_call, min_finished_bytes,
                                  needs_session_path, plain_handoff)
from ortmem.base.options import at_defaults, get_config
from ortmem.base.ort_class import ORT_SESSION
from ortmem.ort.providers import FUSING_PROVIDERS, not_fusing, provider_names
from ortmem.intercept.hook_options import HookOptions
from ortmem.intercept.own_package import OWN_MODULES, problem
from ortmem.intercept.plain_run import process_memory  # the standard library only: the hook stays light


#: ORT's own class, captured before any hook: what the hook falls back to and what ortmem builds on.
ORIGINAL = ORT_SESSION
#: A bytes model smaller than this goes to ORT untouched: spilling it to a file to map its weights
#: would cost more than the copies it saves.
MIN_BYTES = 1 << 20
# ENV_SWITCH ("ORTMEM_HOOK") and ENV_OPTIONS live in ortmem.base.child_env, beside the environment of
# ortmem's helper processes, which must never carry them.

_state_lock = threading.RLock()
_inside = threading.local()  # set while ortmem creates a session: nested creations go to ORT directly


@record
class SessionRecord:
    """One session created while the hook was on."""

    model: str
    providers: list[str]
    action: str  # what ortmem did: the session's ortmem_action, "untouched: <why>" or "fallback: <error>"
    create_seconds: float
    rss_anon_mib: float  # the process's private (anonymous) memory right after creation
    rss_file_mib: float  # its file-backed resident memory then
    peak_mib: float  # the process's VmHWM then (since start or the last reset)
    thread: str  # the creating thread's name


class _HookMeta(type):
    """``isinstance(x, onnxruntime.InferenceSession)`` keeps meaning "an ORT session" after the hook."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, ORIGINAL)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, ORIGINAL)


class HookedInferenceSession(ORIGINAL, metaclass=_HookMeta):
    """Stands in for ``onnxruntime.InferenceSession`` while the hook is on.

    Calling the class itself returns an :class:`ortmem.InferenceSession` (or a plain ORT session, see
    the module docstring); a class deriving from it is constructed exactly as ORT's would be.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is not HookedInferenceSession:
            return ORIGINAL.__new__(cls)
        return _create(args, kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # reached only by derived classes
        ORIGINAL.__init__(self, *args, **kwargs)


class _Hook:
    def __init__(self, options: HookOptions) -> None:
        self.options = options
        self.rebound: list[tuple[Any, str]] = []  # (namespace, name) we pointed at the factory


_active: Optional[_Hook] = None
_records: list[SessionRecord] = []
#: Why ortmem cannot work in this process at all (None: it can), once asked (:func:`_process_problem`),
#: and whether the one warning saying so has been logged.
_broken: Optional[str] = None
_broken_checked = False
_broken_told = False


class _Unhooker(AbstractContextManager):
    """Returned by :func:`hook`: ``with ortmem.hook(): ...`` unhooks on exit."""

    def __exit__(self, *exc: Any) -> None:
        unhook()


def hook(*, convert: bool = True, cache: Union[bool, str] = True, trim: bool = True, prepacked: bool = True,
         strict: bool = False, observe_only: bool = False, rebind: bool = True) -> _Unhooker:
    """Route every ORT session this process creates from now on through ortmem (see the module docstring).

    ``convert``, ``cache``, ``trim``, ``prepacked`` mean what they mean to :class:`ortmem.InferenceSession`;
    ``strict`` lets ortmem's own exceptions propagate; ``observe_only`` creates plain ORT sessions and
    only records them (for comparisons); ``rebind`` also rebinds module globals already
    bound to ORT's class. Calling it again replaces the options. Use as a context manager to unhook.
    """
    global _active
    options = HookOptions(convert=convert, cache=cache, trim=trim, prepacked=prepacked, strict=strict,
                          observe_only=observe_only)
    with _state_lock:
        if _active is None:
            _active = _Hook(options)
            ort.InferenceSession = HookedInferenceSession
            _collection.InferenceSession = HookedInferenceSession
            if rebind:
                _active.rebound = _rebind_globals(ORIGINAL, HookedInferenceSession)
        else:
            _active.options = options
    return _Unhooker()


def unhook() -> None:
    """Give ``onnxruntime.InferenceSession`` (and every name the hook rebound) back its own class."""
    global _active
    with _state_lock:
        if _active is None:
            return
        ort.InferenceSession = ORIGINAL
        _collection.InferenceSession = ORIGINAL
        for namespace, name in _active.rebound:
            if namespace.get(name) is HookedInferenceSession:
                namespace[name] = ORIGINAL
        logging = sys.modules.get("logging")  # no filter was put anywhere if nothing imported it
        for logger in logging.Logger.manager.loggerDict.values() if logging else ():
            if isinstance(logger, logging.Logger) and _HOLD in logger.filters:
                logger.removeFilter(_HOLD)
        _active = None


def hook_from_environment() -> bool:
    """Install the hook when ``$ORTMEM_HOOK`` is "1", with the options in ``$ORTMEM_HOOK_OPTIONS``
    (JSON of :class:`HookOptions` fields); used by the launcher's sitecustomize in child interpreters."""
    if os.environ.get(ENV_SWITCH) != "1":
        return False
    options = os.environ.get(ENV_OPTIONS)
    if options:  # the launcher exports only options that differ from the defaults
        import json

        given = json.loads(options)
    else:
        given = {}
    hook(**given, rebind=False)  # installed as onnxruntime finishes importing: no module holds its class yet
    return True


def is_hooked() -> bool:
    return _active is not None


def sessions() -> list[SessionRecord]:
    """Every session created while the hook was on, oldest first."""
    with _state_lock:
        return list(_records)


def report() -> list[dict[str, Any]]:
    return [r._asdict() for r in sessions()]


def _rebind_globals(old: type, new: type) -> list[tuple[dict, str]]:
    """Point module globals bound to ``old`` at ``new``: one pass over loaded modules' namespaces."""
    rebound = []
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType) or module is ort or module is _collection:
            continue  # sys.modules may hold lazy proxies: touching their attributes could import
        namespace = object.__getattribute__(module, "__dict__")
        if str(namespace.get("__name__", "")).startswith("ortmem"):
            continue  # ortmem builds on ORT's own class
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new
                rebound.append((namespace, name))
    return rebound


def _create(args: tuple, kwargs: dict) -> Any:
    hooked = _active
    if hooked is None or getattr(_inside, "busy", False):
        return ORIGINAL(*args, **kwargs)
    with OWN_MODULES:  # this package's modules, where the program has an ``ortmem`` of its own
        return _create_hooked(hooked.options, args, kwargs)


def _create_hooked(opts: HookOptions, args: tuple, kwargs: dict) -> Any:
    if not args and "path_or_bytes" in kwargs:  # ORT's keyword name; ortmem's is positional
        kwargs = dict(kwargs)
        args = (kwargs.pop("path_or_bytes"),)
    model = args[0] if args else None
    if opts.observe_only:
        return _record(model, lambda: ORIGINAL(*args, **kwargs), lambda s: "plain onnxruntime (hook off)")
    broken = _process_problem()
    if broken is not None:
        if opts.strict:
            raise OrtmemError(broken)
        return _plain_for_process(model, args, kwargs, broken)
    why = _untouched_reason(model, args, kwargs)
    if why is not None:
        return _record(model, lambda: ORIGINAL(*args, **kwargs), lambda s: f"untouched: {why}")
    try:
        light = _light_route(model, args, kwargs, opts)
    except Exception:  # noqa: BLE001 - a file the walk cannot read: the session path (or ORT) judges it
        light = None
    if light is not None:
        return light
    failure = None
    try:
        refused = _options_refused(args[1] if len(args) > 1 else kwargs.get("sess_options"), kwargs)
        # Imported only now, for a model that needs ortmem: the session path (3.5 MiB private, about
        # 0.05 s; onnx, the loader and the passes only for a model it loads or converts), which a
        # model left to ORT never pays.
        from ortmem.session.inference import InferenceSession
    except Exception as exc:  # noqa: BLE001 - ortmem's own code before ORT is called: ORT takes over
        if opts.strict:
            raise
        failure = _one_line(exc)
        if isinstance(exc, ImportError):  # a broken install: no later session can go through ortmem either
            _set_broken(f"ortmem cannot be imported ({failure})")
    if failure is not None:  # outside the except block: ORT's own exception, if any, is unchained
        broken = _process_problem()
        return _plain_for_process(model, args, kwargs, broken) if broken else _fall_back(model, args, kwargs, failure)
    if refused is not None:
        return _record(model, lambda: ORIGINAL(*args, **kwargs), lambda s: f"untouched: {refused}")

    own = {"convert": opts.convert, "cache": opts.cache, "trim": opts.trim, "prepacked": opts.prepacked}

    def make() -> Any:
        return _quiet_attempt(lambda: InferenceSession(*args, **{**kwargs, "enable_fallback": 0}, **own), kwargs)

    try:
        return _record(model, make, _action_of)
    except Exception as exc:  # noqa: BLE001 - any failure of ortmem's falls back to ORT
        if opts.strict:
            raise
        failure = _one_line(exc)  # only the text: the exception would keep ortmem's frames alive
    return _fall_back(model, args, kwargs, failure)


#: Session config keys that change what ORT does with DequantizeLinear (read by the session path's
#: settings): options that set them go the session path's way, which checks them as ORT would.
_QDQ_CONFIG_KEYS = ("session.qdq_matmulnbits_accuracy_level", "session.qdq_matmulnbits_block_size")


def _light_route(model: Any, args: tuple, kwargs: dict, opts: HookOptions) -> Optional[Any]:
    """The session, made without importing ortmem's session path, for a model file that needs nothing
    of it (decided from the file's bytes, :mod:`ortmem.onnxfile.scan`); None when the model needs it:
    DequantizeLinear to convert, recompute metadata, external data or tensors the loader must check,
    weights enough for a finished entry (the session path looks it up or builds it; not where the file's
    handoff record says the store settled it as given and the call is at ORT's defaults), caller options
    that set ortmem-relevant keys, or embedded weights that cannot be handed over by a hard link
    without a folder config entry.

    What is done here is what the session path would do with such a file: nothing (``as-is``), or
    its skeleton by path beside a hard link (``mapped``). The walk's facts, and that skeleton with
    its link, are kept as a handoff record in the store's folder (not with ``cache=False``), so a
    program started again reads them instead of walking (:mod:`ortmem.store.handoff_records`). Weights inside subgraphs (``If`` branches)
    with the caller's options cannot be mapped (ORT's checker refuses external data in a subgraph
    from a hard-linked file, and only the caller's options could carry the folder key): those go
    to ORT as given, at the cost of the walk up to the first such weight (10 of silero-vad's 1278
    messages: 0.1 ms instead of 7.3 for the whole walk and the count that followed it). ``trim``: ``malloc_trim(0)`` after creation,
    thresholds untouched, so the process never keeps more than plain ORT's would."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    path = Path(os.fspath(model))
    if not path.is_file():
        return None
    finishable = opts.cache is not False and opts.prepacked
    sess_options = args[1] if len(args) > 1 else kwargs.get("sess_options")
    defaults = at_defaults(sess_options, args[2] if len(args) > 2 else kwargs.get("providers"),
                           args[3] if len(args) > 3 else kwargs.get("provider_options"),
                           kwargs.get("disabled_optimizers"), convert=opts.convert, prepacked=opts.prepacked)
    # A file large enough for a finished entry is the store's, unless its record says the store settled it as given.
    large = finishable and path.stat().st_size >= min_finished_bytes()
    if large and not defaults:
        return None
    if sess_options is not None and any(get_config(sess_options, k) is not None for k in (FOLDER_KEY, *_QDQ_CONFIG_KEYS)):
        return None
    # With the caller's options, a weight outside the main graph settles it: the walk stops there.
    # Imported with the first model handed over here: `ortmem --help` and processes that create no
    # session never load the store.
    from ortmem.store.handoff_records import as_given_facts, facts_of, records_folder

    if large:
        settled = as_given_facts(store_folder(opts.cache), path)
        if settled is None:
            return None  # the session path looks its finished entry up, or builds it
        facts = settled
    else:
        records = records_folder(store_folder(opts.cache)) if opts.cache is not False else None
        facts = facts_of(path, records, stop_outside_main_graph=sess_options is not None)
    facts = for_call(facts, defaults)
    if needs_session_path(path, facts, opts.convert):
        return None
    if finished_entry_possible(facts, finishable):
        return None  # external weights enough for a finished entry: the session path looks it up or builds it
    if not facts.main_graph_only:
        if sess_options is None:
            return None  # the session path hands the skeleton over as bytes with the folder entry
        return _record(model, _trimmed(lambda: ORIGINAL(*args, **kwargs), opts),
                       lambda s: "untouched: weights inside subgraphs, with the caller's SessionOptions")
    plain = plain_handoff(path, facts)
    if plain is None:
        return None  # the session path tries the cache's file system too
    if plain.action == "as-is":
        return _record(model, _trimmed(lambda: ORIGINAL(*args, **kwargs), opts), _tagged("as-is"))
    try:
        session = _record(model, _trimmed(lambda: _quiet_attempt(
            lambda: ORIGINAL(str(plain.model), *args[1:], **{**kwargs, "enable_fallback": 0}), kwargs), opts),
            _tagged("mapped"))
    except Exception as exc:  # noqa: BLE001 - ORT refused the skeleton: ORT gets the model as given
        if opts.strict:
            raise
        failure = _one_line(exc)
    else:
        return session
    finally:
        if plain.workdir is not None:  # a skeleton written for this start, not a record's
            import shutil  # only then: a process whose models go as-is or from records never imports it

            shutil.rmtree(plain.workdir, ignore_errors=True)  # ORT has mapped what it needs
    return _fall_back(model, args, kwargs, failure)


def _trimmed(make: Callable[[], Any], opts: HookOptions) -> Callable[[], Any]:
    """``make``, then ``malloc_trim(0)`` when ``opts.trim``: what ORT freed during creation goes back
    to the system, and glibc's thresholds (and their dynamic adjustment) stay as plain ORT leaves them."""
    def made() -> Any:
        session = make()
        if opts.trim:
            trim_heap()
        return session
    return made


def _action_of(session: Any) -> str:
    """The record's action for an ``ortmem.InferenceSession``: its ``ortmem_action``, with its reason
    where it gives one (``"untouched: <why>"``, as the hook words what it leaves alone itself)."""
    return f"{session.ortmem_action}: {session.ortmem_reason}" if session.ortmem_reason else session.ortmem_action


def _tagged(action: str) -> Callable[[Any], str]:
    """The record's action for a session the light route made, set on the session as well: ORT's own
    object then answers ``ortmem_action`` as an ``ortmem.InferenceSession`` does."""
    def tag(session: Any) -> str:
        session.ortmem_action = action
        return action
    return tag


def _quiet_attempt(make: Callable[[], Any], kwargs: dict) -> Any:
    """Create ortmem's session so that a failure leaves no trace an application could see.

    ORT's EP fallback is off while ortmem tries (else ORT prints its "EP Error" banner and retries on
    ortmem's model), and ortmem's own log records from this thread are held back: a failure drops
    them and plain ORT takes over (:func:`_fall_back`); a success emits them and gives the session
    ORT's EP fallback back as the caller asked for it (``enable_fallback``, ORT's keyword)."""
    _hold_ortmem_logs()
    _inside.busy, _inside.held = True, []
    try:
        session = make()
        held = _inside.held
    finally:
        _inside.busy, _inside.held = False, None
    if int(kwargs.get("enable_fallback", 1)) == 1:
        session.enable_fallback()
    if held:
        import logging

        for record in held:
            logging.getLogger(record.name).handle(record)
    return session


def _process_problem() -> Optional[str]:
    """Why no session of this process can go through ortmem, if so: the ``ortmem`` it imported is not
    this package (asked once), or ortmem's session path failed to import (:func:`_set_broken`)."""
    global _broken, _broken_checked
    if not _broken_checked:
        found = problem()
        with _state_lock:
            if not _broken_checked:
                _broken = _broken or found
                _broken_checked = True
    return _broken


def _set_broken(why: str) -> None:
    global _broken
    with _state_lock:
        _broken = _broken or why


def _plain_for_process(model: Any, args: tuple, kwargs: dict, why: str) -> Any:
    """Plain ORT's session where ortmem cannot work in this process at all (``why``). One warning for
    the whole process, logged once ORT has made a session (as :func:`_fall_back`'s); every session is
    recorded with the cause as its action."""
    global _broken_told
    session = _record(model, lambda: ORIGINAL(*args, **kwargs), lambda s: f"fallback: {why}")
    with _state_lock:
        tell, _broken_told = not _broken_told, True
    if tell:
        warning(__name__, "ortmem: %s; sessions run as plain onnxruntime", why)
    return session


def _fall_back(model: Any, args: tuple, kwargs: dict, failure: str) -> Any:
    """Plain ORT's session after ortmem failed. Called outside any ``except`` block, so an exception
    ORT raises reaches the application exactly as without the hook (nothing chained to it); the one
    warning is logged only once ORT has succeeded, since when ORT refuses the input too there was
    nothing to fall back from."""
    reason = f"fallback: {failure}"
    session = _record(model, lambda: ORIGINAL(*args, **kwargs), lambda s: reason)
    warning(__name__, "ortmem hook: %s on %s; created the session with plain onnxruntime", failure, _name(model))
    return session


class _HoldInThisThread:
    """On ortmem's loggers: while this thread tries ortmem (``_inside.held`` is a list), its records
    are kept there instead of emitted (see :func:`_quiet_attempt`). A logging filter need only have
    this method; not deriving from ``logging.Filter`` keeps logging out of the hook's import."""

    def filter(self, record: Any) -> bool:
        held = getattr(_inside, "held", None)
        if held is None:
            return True
        held.append(record)
        return False


_HOLD = _HoldInThisThread()


def _hold_ortmem_logs() -> None:
    """Put the holding filter on the logger of every ortmem module imported now (``_create`` has
    imported the session path by then), made here if the module has not logged yet: the modules every
    hooked process imports log through :mod:`ortmem.base.logs`, which makes their loggers on first use.
    Where nothing has imported logging, nothing is held: the only attempt made then is ORT's own
    creation from a skeleton (the light route), in which no ortmem code runs to log anything."""
    logging = sys.modules.get("logging")
    if logging is None:
        return
    for name in [n for n in sys.modules if n == "ortmem" or n.startswith("ortmem.")]:
        logger = logging.getLogger(name)
        if _HOLD not in logger.filters:
            logger.addFilter(_HOLD)


def _untouched_reason(model: Any, args: tuple, kwargs: dict) -> Optional[str]:
    if isinstance(model, bytes):  # ORT's own test: a bytearray or memoryview is a TypeError to it
        if len(model) < MIN_BYTES:
            return f"bytes model under {MIN_BYTES >> 20} MiB"
    elif not isinstance(model, (str, os.PathLike)):
        return f"model given as {type(model).__name__}"
    providers = args[2] if len(args) > 2 else kwargs.get("providers")
    others = not_fusing(provider_names(providers))
    if others:
        return f"provider {others[0]} (ortmem handles {', '.join(sorted(FUSING_PROVIDERS))})"
    return None


def _options_refused(sess_options: Any, kwargs: dict) -> Optional[str]:
    """Why ortmem cannot read the session's options, if so: a value ORT itself fails session creation
    on (an accuracy level that is no integer or out of range), or no options object at all. Left to
    ORT before anything is made, so ORT's error is printed and raised once, as without the hook."""
    # Imported here, for a model that needs the session path (the release model and its settings).
    from ortmem.ort.settings import session_settings

    try:
        settings = session_settings(sess_options, disabled_optimizers=kwargs.get("disabled_optimizers"))
        settings.accuracy_level, settings.block_size_option  # noqa: B018 - both parse the raw text
    except Exception as exc:  # noqa: BLE001 - whatever it is, ORT answers it for the model as given
        return f"session options ortmem cannot read ({_one_line(exc)})"
    return None


def _record(model: Any, make, action) -> Any:
    start = time.perf_counter()
    session = make()
    seconds = time.perf_counter() - start
    memory = process_memory()
    record = SessionRecord(
        model=_name(model),
        providers=list(session.get_providers()),
        action=action(session),
        create_seconds=round(seconds, 4),
        rss_anon_mib=memory["rss_anon_mib"],
        rss_file_mib=memory["rss_file_mib"],
        peak_mib=memory["peak_mib"],
        thread=threading.current_thread().name,
    )
    with _state_lock:
        _records.append(record)
    return session


def _name(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    if isinstance(model, (bytes, bytearray, memoryview)):
        return f"<{len(model)} bytes>"
    return f"<{type(model).__name__}>"


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
