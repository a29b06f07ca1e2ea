"""Registry of ways to create a session, each measured in its own fresh process.

A strategy is ``create(model_path: str, options: dict) -> session``, run in the measured child
process. ``session`` only needs ``get_inputs()``, ``get_outputs()`` and ``run(None, feeds)``.
An optional ``prepare(model_path, options, workdir) -> prepared_model_path`` runs *before*
measurement, in its own process, and is not measured (e.g. converting a QDQ model to its native
twin ahead of time, or filling a cache for a warm start). ``prepare_scope="once"`` lets the bench
prepare once per model and reuse the result across repeats; ``"each"`` prepares before every probe
(a cold-cache strategy that must start clean each time).

Callables are referred to as ``"module:function"`` strings (or ``"/path/file.py:function"``) so the
child can import them; the registry stores such references, and adding a strategy is one line::

    register("twin", "ortmem.twin:create_session", prepare="ortmem.twin:prepare_twin")

Strings that are not registered names but contain ``":"`` are user strategies, imported in the child.

``code`` is the same creation written as a user writes it, for ``ortmem bench --whole-process``
(:mod:`ortmem.measure.whole_process`), which times ``python -c CODE`` from outside: a template with
``{model}`` (the model path's ``repr``), ``{so}`` (``"so, "`` when session options were asked for,
else empty; :func:`whole_process_code` then defines ``so`` first), ``{options}`` (``so``, else a new
``onnxruntime.SessionOptions()``, for a template that edits them) and ``{cache[KIND]}`` (the ``repr``
of the strategy's private cache folder, as ``create`` uses it). A strategy without ``code`` is run
through :func:`resolve` in that process (which then also pays for importing this module).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Literal, Union

CreateFn = Callable[[str, dict], Any]
PrepareFn = Callable[[str, dict, str], str]
Ref = Union[str, Callable[..., Any]]


@dataclass(frozen=True)
class Strategy:
    """One way of creating a session. ``create``/``prepare`` are ``module:function`` references."""

    name: str
    create: str
    prepare: str | None = None
    prepare_scope: Literal["once", "each"] = "once"
    description: str = ""
    default: bool = False  # measured by ``ortmem bench`` when no --strategy is given
    code: str | None = None  # ``python -c`` source of the same creation (module docstring)


STRATEGIES: dict[str, Strategy] = {}


def to_ref(fn: Ref) -> str:
    """``module:qualname`` for a callable (it must be importable by that name in the child)."""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{fn!r} is not importable by name; pass a 'module:function' string")
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if not main_file:
            raise ValueError(f"{fn!r} lives in an interactive __main__; put it in a module")
        module = os.path.abspath(main_file)
    return f"{module}:{qualname}"


def register(
    name: str,
    create: Ref,
    *,
    prepare: Ref | None = None,
    prepare_scope: Literal["once", "each"] = "once",
    description: str = "",
    default: bool = False,
    code: str | None = None,
) -> Strategy:
    """Add (or replace) a named strategy; returns it."""
    strat = Strategy(
        name=name,
        create=to_ref(create),
        prepare=to_ref(prepare) if prepare is not None else None,
        prepare_scope=prepare_scope,
        description=description,
        default=default,
        code=code,
    )
    STRATEGIES[name] = strat
    return strat


def get_strategy(spec: str | Strategy) -> Strategy:
    """A registered name, a ``module:function`` user strategy, or a :class:`Strategy` as is."""
    if isinstance(spec, Strategy):  # normalise callables given directly to references
        prep = to_ref(spec.prepare) if spec.prepare is not None else None
        return replace(spec, create=to_ref(spec.create), prepare=prep)
    if spec in STRATEGIES:
        return STRATEGIES[spec]
    if ":" in spec:
        return Strategy(name=spec, create=spec, description="user strategy")
    known = ", ".join(sorted(STRATEGIES))
    raise KeyError(f"unknown strategy {spec!r}; known: {known}; or give 'module:function'")


def default_strategies() -> list[str]:
    return [name for name, s in STRATEGIES.items() if s.default]


def resolve(ref: str) -> Callable[..., Any]:
    """Import ``module:function`` (dotted attribute paths allowed) or ``/path/file.py:function``."""
    mod_name, sep, attr = ref.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"strategy reference {ref!r} is not 'module:function'")
    if mod_name.endswith(".py") or os.sep in mod_name:
        module = _import_file(mod_name)
    else:
        module = importlib.import_module(mod_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{ref!r} is not callable")
    return obj


def _import_file(path: str) -> Any:
    """Import a module from a file path once; register it so pickling/relative lookups work."""
    path = os.path.abspath(path)
    mod_name = "_ortmem_user_" + os.path.splitext(os.path.basename(path))[0]
    if mod_name in sys.modules and getattr(sys.modules[mod_name], "__file__", None) == path:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import strategy module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


# --- whole-process source -------------------------------------------------------------------------


class _CacheFolders:
    """``{cache[KIND]}`` in a ``code`` template: the repr of the bench's cache folder for KIND."""

    def __getitem__(self, kind: str) -> str:
        return repr(str(_bench_cache(kind)))


def whole_process_code(strategy: Strategy, model_path: str, options: dict) -> str:
    """``python -c`` source creating a session the strategy's way (see the module docstring)."""
    config = {str(k): str(v) for k, v in (options.get("session_config") or {}).items()}
    threads = options.get("intra_op_num_threads")
    prelude = ""
    if config or threads is not None:
        lines = ["import onnxruntime", "so = onnxruntime.SessionOptions()"]
        lines += [f"so.add_session_config_entry({k!r}, {v!r})" for k, v in config.items()]
        if threads is not None:
            lines.append(f"so.intra_op_num_threads = {int(threads)}")
        prelude = "\n".join(lines) + "\n"
    if strategy.code is None:
        return (f"from ortmem.measure.strategies import resolve\n"
                f"resolve({strategy.create!r})({model_path!r}, {options!r})")
    so = "so, " if prelude else ""
    options_expr = "so" if prelude else "onnxruntime.SessionOptions()"
    return prelude + strategy.code.format(model=repr(model_path), so=so, options=options_expr,
                                          cache=_CacheFolders())


# --- built-in strategies -------------------------------------------------------------------------


def _session_options(options: dict) -> Any:
    """SessionOptions from the JSON options: ``session_config`` entries and thread count; None when they
    ask for neither, so a strategy's call is ``InferenceSession(path, providers=...)``, as a plain
    program's and as the whole-process code (:func:`whole_process_code`) make it."""
    import onnxruntime as ort

    if not options.get("session_config") and "intra_op_num_threads" not in options:
        return None
    so = ort.SessionOptions()
    for key, value in (options.get("session_config") or {}).items():
        so.add_session_config_entry(str(key), str(value))
    if "intra_op_num_threads" in options:
        so.intra_op_num_threads = int(options["intra_op_num_threads"])
    return so


def create_ort(model_path: str, options: dict) -> Any:
    """Plain ``onnxruntime.InferenceSession(path)``: the reference every ratio is taken against."""
    import onnxruntime as ort

    return ort.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"])


def create_ort_noopt(model_path: str, options: dict) -> Any:
    """ORT with graph optimizations off: shows what fusions (e.g. DQ+MatMul) cost at load time."""
    import onnxruntime as ort

    so = _session_options(options) or ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])


def create_ort_hygiene(model_path: str, options: dict) -> Any:
    """Plain ORT inside ``ortmem.allocator_hygiene()`` only: how much of ORT's cost is glibc retention."""
    import onnxruntime as ort

    from ortmem.base.hygiene import allocator_hygiene

    with allocator_hygiene():
        return ort.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"])


def _bench_cache(kind: str):
    """A cache folder private to one bench strategy, under ortmem's cache root."""
    from ortmem.store.cache import cache_root

    return cache_root() / "bench" / kind


def prepare_cold(model_path: str, options: dict, workdir: str) -> str:
    """Empty the cold strategy's cache so the measured start converts from scratch."""
    from ortmem.store.cache import Cache

    Cache(_bench_cache("cold")).clear()
    return model_path


def create_ortmem(model_path: str, options: dict) -> Any:
    """``ortmem.InferenceSession`` with an empty cache: conversion included in the measurement."""
    import ortmem

    return ortmem.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"],
                                   cache=_bench_cache("cold"))


def prepare_warm(model_path: str, options: dict, workdir: str) -> str:
    """Fill the warm strategy's cache (in this unmeasured process): a cold start converts and, after its
    first run, leaves ORT's finishing of the entry to the background job, which is waited for.

    On a private copy of the model's files: an entry hard-links its source, and the cold strategies
    create and remove entries of the same model between the warm probes, which moves the shared
    source's ctime every time; each warm start would then read the source in full again to tell that
    from an edit (:mod:`ortmem.files.sources`). A deployment's warm start sees a source nobody links
    in between, which the copy gives it.

    Then one more start once the files are no longer new: it checks every file in full and stamps them
    (:mod:`ortmem.files.stamps`), as a deployment's first warm start of the boot does, so the measured
    starts are the steady ones."""
    import time

    from ortmem.files.stamps import RACY_SECONDS

    from ortmem.store.finisher import wait_background
    from ortmem.ort.feeds import make_inputs

    copy = _private_copy(model_path, _bench_cache("warm-sources") / _path_tag(model_path))
    session = create_ortmem_warm(copy, options)
    session.run(None, make_inputs(session, options))  # its first run leaves ORT's finishing to the background
    del session
    wait_background()
    time.sleep(RACY_SECONDS)
    create_ortmem_warm(copy, options)
    return copy


def _path_tag(model_path: str) -> str:
    """A short stable name for a model path (one private copy and one warm entry per model, reused by
    every bench run, rather than one left behind per run)."""
    import hashlib

    return hashlib.sha1(os.path.abspath(model_path).encode()).hexdigest()[:12]


def _private_copy(model_path: str, folder: Path) -> str:
    """The model file and every file its weights live in, copied (once, and again when the model
    changed) into ``folder``: the same bytes under other inodes."""
    import shutil

    import ortmem
    from ortmem.store.writer import source_paths

    target = folder / Path(model_path).name
    if target.exists() and target.stat().st_mtime_ns < Path(model_path).stat().st_mtime_ns:
        shutil.rmtree(folder)  # the model was written again since: copy it again
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with ortmem.load(model_path) as model:
            files = set(source_paths(model)) - {Path(model_path).resolve()}
        for f in files:
            relative = f.resolve().relative_to(Path(model_path).resolve().parent)
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, folder / relative)
        shutil.copyfile(model_path, target)
    return str(target)


def create_ortmem_warm(model_path: str, options: dict) -> Any:
    """``ortmem.InferenceSession`` on a cache hit: nothing is converted. ``options["prepacked"]``
    (default True) is passed on: False loads the entry itself, as a twin, not ORT's finished model."""
    import ortmem

    return ortmem.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"],
                                   cache=_bench_cache("warm"), prepacked=bool(options.get("prepacked", True)))


def create_ortmem_warm_entry(model_path: str, options: dict) -> Any:
    """A cache hit that loads the entry itself (``prepacked=False``): ORT packs on the heap, as for the twin."""
    return create_ortmem_warm(model_path, dict(options, prepacked=False))


def prepare_warm1(model_path: str, options: dict, workdir: str) -> str:
    """A converted entry without ORT's finished model: the next start is the first warm one."""
    from ortmem.store.finished_entries import discard_every_finished

    session = create_ortmem_warm1(model_path, options)
    discard_every_finished(Path(os.path.dirname(session.ortmem_handoff.fallback or session.ortmem_handoff.model)))
    return model_path


def create_ortmem_warm1(model_path: str, options: dict) -> Any:
    """``ortmem.InferenceSession`` on the first cache hit: ORT's finished model is not made yet, so it
    loads the converted entry (its first run would leave the finishing to the background job)."""
    import ortmem

    return ortmem.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"],
                                   cache=_bench_cache("warm1"))


def prepare_start2(model_path: str, options: dict, workdir: str) -> str:
    """Start 1 in this unmeasured process: an empty cache, a cold start and its first run, then wait
    for the finisher it leaves (``ortmem.store.finisher``), so the measured start is the second one."""
    from ortmem.store.cache import Cache
    from ortmem.store.finisher import wait_background
    from ortmem.ort.feeds import make_inputs

    Cache(_bench_cache("start2")).clear()
    session = create_ortmem_start2(model_path, options)
    session.run(None, make_inputs(session, options))
    wait_background()
    return model_path


def create_ortmem_start2(model_path: str, options: dict) -> Any:
    """``ortmem.InferenceSession``, the second start ever on this model: what a user's second start is."""
    import ortmem

    return ortmem.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"],
                                   cache=_bench_cache("start2"))


def create_ortmem_nocache(model_path: str, options: dict) -> Any:
    """``ortmem.InferenceSession(cache=False)``: converted for this session only."""
    import ortmem

    return ortmem.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"],
                                   cache=False)


def prepare_twin(model_path: str, options: dict, workdir: str) -> str:
    """Convert the model to its native MatMulNBits form ahead of time; plain ORT then loads that."""
    import ortmem
    from ortmem.session.convert import convert_to
    from ortmem.ort.settings import session_settings

    out = Path(workdir) / ("twin-" + _path_tag(model_path))
    if not (out / "model.onnx").exists():
        with ortmem.load(model_path) as model:
            convert_to(model, out, session_settings(_session_options(options)))
    return str(out / "model.onnx")


def prepare_prepared(model_path: str, options: dict, workdir: str) -> str:
    """What ``ortmem prepare MODEL --cache DIR`` does (:func:`ortmem.session.deploy.prepare_path`),
    into this strategy's cache, unmeasured: a QDQ model's converted entry and its pre-packed weights,
    any other model's finished entry (or nothing, where ortmem prepares nothing: a marker where ORT
    packs nothing). ``ortmem prepare`` builds what a
    default session looks up, so ``--session-config`` entries that change the key make the measured
    start miss it: the probe's ``ortmem_action`` says what the start did."""
    _prepare_into(model_path, _bench_cache("prepared"))
    return model_path


def _prepare_into(model_path: str, cache: Path) -> None:
    """:func:`ortmem.session.deploy.prepare_path` of ``model_path`` into ``cache``; a failure raises."""
    from ortmem.session.deploy import prepare_path
    from ortmem.store.cache import Cache

    code = prepare_path(Path(model_path), Cache(cache))
    if code:
        raise RuntimeError(f"ortmem prepare {model_path} failed (exit code {code})")


def create_ortmem_prepared(model_path: str, options: dict) -> Any:
    """``ortmem.InferenceSession`` on the cache ``ortmem prepare`` filled: the warm start of a
    deployment that prepared its models beforehand (a finished entry, or a converted one with its
    pre-packed weights)."""
    import ortmem

    return ortmem.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"],
                                   cache=_bench_cache("prepared"))


def prepare_ort_finished(model_path: str, options: dict, workdir: str) -> str:
    """``ortmem prepare`` into this strategy's cache, unmeasured, then what an ortmem start hands ORT
    written down (the file, its config entries, whether it is ORT's finished model), so the measured
    child runs plain ORT on it with nothing of ortmem's start: what ORT itself holds and takes for its
    finished model, beside ``ortmem-prepared-warm``. A start that gets no finished model leaves plain
    ORT on the source."""
    import ortmem

    cache = _bench_cache("ort-finished")
    _prepare_into(model_path, cache)
    session = ortmem.InferenceSession(model_path, _session_options(options), providers=["CPUExecutionProvider"],
                                      cache=cache)
    finished = session.ortmem_action == "finished"
    handoff = session.ortmem_handoff
    spec = {"model": handoff.model if finished else model_path,
            "config": dict(handoff.config) if finished else {}, "finished": finished}
    del session
    path = Path(workdir) / f"ort-finished-{_path_tag(model_path)}.json"
    path.write_text(json.dumps(spec))
    return str(path)


def create_ort_finished(spec_path: str, options: dict) -> Any:
    """Plain ORT on what :func:`prepare_ort_finished` wrote down: ORT's finished model with the
    config entries and ``ORT_DISABLE_ALL`` an ortmem start gives it."""
    import onnxruntime as ort

    spec = json.loads(Path(spec_path).read_text())
    so = _session_options(options) or ort.SessionOptions()
    for key, value in spec["config"].items():
        so.add_session_config_entry(key, value)
    if spec["finished"]:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(spec["model"], so, providers=["CPUExecutionProvider"])


ORT_CODE = "import onnxruntime as o\no.InferenceSession({model}, {so}providers=['CPUExecutionProvider'])"
ORTMEM_CODE = ("import ortmem\nortmem.InferenceSession({model}, {so}providers=['CPUExecutionProvider'], "
               "cache={cache[%s]}%s)")

register("ort", create_ort, default=True, description="onnxruntime.InferenceSession(path)", code=ORT_CODE)
register("ort-noopt", create_ort_noopt, description="ORT_DISABLE_ALL optimizations",
         code="import onnxruntime\nso = {options}\n"
              "so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL\n"
              "onnxruntime.InferenceSession({model}, so, providers=['CPUExecutionProvider'])")
register("ort-hygiene", create_ort_hygiene, description="plain ORT inside ortmem.allocator_hygiene()",
         code="import onnxruntime as o, ortmem\nwith ortmem.allocator_hygiene():\n"
              "    o.InferenceSession({model}, {so}providers=['CPUExecutionProvider'])")
register("twin", create_ort, prepare=prepare_twin, default=True, code=ORT_CODE,
         description="plain ORT on the model converted to native MatMulNBits ahead of time: the floor ORT reaches")
register("ortmem", create_ortmem, prepare=prepare_cold, prepare_scope="each", default=True,
         description="ortmem.InferenceSession, cold cache (converts)", code=ORTMEM_CODE % ("cold", ""))
register("ortmem-warm", create_ortmem_warm, prepare=prepare_warm, default=True,
         description="ortmem.InferenceSession, cache hit", code=ORTMEM_CODE % ("warm", ""))
register("ortmem-warm-entry", create_ortmem_warm_entry, prepare=prepare_warm,
         description="ortmem.InferenceSession, cache hit loading the converted entry, not onnxruntime's finished model",
         code=ORTMEM_CODE % ("warm", ", prepacked=False"))
register("ortmem-warm1", create_ortmem_warm1, prepare=prepare_warm1, prepare_scope="each",
         description="ortmem.InferenceSession, first cache hit (before onnxruntime's finished model exists)",
         code=ORTMEM_CODE % ("warm1", ""))
register("ortmem-start2", create_ortmem_start2, prepare=prepare_start2, prepare_scope="each",
         description="ortmem.InferenceSession, second start (after a cold start that ran once)",
         code=ORTMEM_CODE % ("start2", ""))
register("ortmem-nocache", create_ortmem_nocache, description="ortmem.InferenceSession(cache=False)",
         code="import ortmem\nortmem.InferenceSession({model}, {so}providers=['CPUExecutionProvider'], cache=False)")
register("ortmem-prepared-warm", create_ortmem_prepared, prepare=prepare_prepared,
         description="ortmem.InferenceSession on a cache `ortmem prepare` filled beforehand (any model)",
         code=ORTMEM_CODE % ("prepared", ""))
register("ort-finished", create_ort_finished, prepare=prepare_ort_finished,
         description="plain ORT on ORT's finished model from a cache `ortmem prepare` filled, no ortmem in the "
                     "process",
         code="import json, onnxruntime\nspec = json.load(open({model}))\nso = {options}\n"
              "for k, v in spec['config'].items():\n    so.add_session_config_entry(k, v)\n"
              "if spec['finished']:\n    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL\n"
              "onnxruntime.InferenceSession(spec['model'], so, providers=['CPUExecutionProvider'])")
register("genai", "ortmem.measure.genai_session:create_genai_plain",
         description="onnxruntime-genai og.Model(og.Config(FOLDER)), greedy tokens from a fixed prompt",
         code="import onnxruntime_genai as og\nog.Model(og.Config({model}))")
register("genai-prepared", "ortmem.measure.genai_session:create_genai_prepared",
         prepare="ortmem.measure.genai_session:prepare_genai",
         description="ortmem.session.genai.genai_model(FOLDER) after `ortmem prepare FOLDER`",
         code="import ortmem.session.genai\nortmem.session.genai.genai_model({model})")
