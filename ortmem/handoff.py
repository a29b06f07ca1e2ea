"""Hand a model to ONNX Runtime so that ORT never copies its weights.

ORT memory-maps external data per tensor and drops each mapping once the kernel has pre-packed it,
but it *copies* embedded ``raw_data`` (protobuf, then an OrtValue). So every way into ORT ends as a
skeleton whose large tensors are external data:

- a path whose file has nothing embedded and was not rewritten: given to ORT unchanged;
- an embedded (or rewritten) model: the skeleton (kilobytes) is written into a private temporary
  folder beside hard links to the files its tensors point into (the original .onnx, its data
  files), and ORT loads that folder's skeleton by path. ORT maps the tensors from the same pages
  the original file already has in the page cache (see docs/handoff.md for why this beats borrowing
  buffers through ``add_external_initializers_from_files_in_memory``). Loading by path needs no
  session config entry, so the caller's ``SessionOptions`` are never touched (setting
  ``session.model_external_initializers_file_folder_path`` on them and putting it back made ORT
  print "Config with key ... already exists ... overwritten" and left the key behind as "");
  where no hard link can be made (another file system, protected_hardlinks) the skeleton goes as
  bytes with that config entry instead;
- bytes or an ``onnx.ModelProto``: written once to a private temporary file, and the skeleton
  beside it. The temporary folder is removed right after session creation: ORT's mappings keep
  the pages alive for as long as it needs them and nothing is left on disk.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import onnx

from .store.cache import MODEL_FILE, Cache, Entry, LockBusyError
from .errors import CacheError, OrtmemError
from .convert import convert_cached, lookup_converted, write_converted
from .inmemory import InMemoryConversion, convert_in_memory
from .loader import load
from .model import Model
from .reach.model_facts import FOLDER_KEY, FUSING_PROVIDERS  # noqa: F401 - FUSING_PROVIDERS re-exported
from .options import get_config
from .onnx_walk import is_external, iter_graphs, iter_tensor_sites
from .passes.conversion import plan_conversion
from .passes.conversion_plan import ConversionPlan, ConversionReport
from .passes.writers import Progress
from .ortmodel.settings import OrtSettings
from .ortmodel.release import capabilities
from .store.packer import PrepackLater, prepack_later_for, prepare_later_for
from .store.prepacked import discard_prepacked, packing_settings, prepacked_model, save_prepacked
from .store.prepared_entries import is_marker, lookup_prepared, min_prepared_bytes, prepared_key
from .validity import validity_fault

log = logging.getLogger(__name__)

ModelInput = Union[str, os.PathLike, bytes, onnx.ModelProto, Model]


@dataclass
class Handoff:
    """What ORT is given: a path or skeleton bytes, the session config entries it needs, and (for a
    conversion done in memory) the buffer ORT borrows, which this object keeps alive."""

    model: Union[str, bytes]
    config: dict[str, str] = field(default_factory=dict)
    source: Optional[Model] = None
    tempdir: Optional[Path] = None
    memory: Optional[InMemoryConversion] = None
    extra_tempdirs: list[Path] = field(default_factory=list)
    #: ``model`` is a cache entry's pre-packed or prepared model: what to load instead if ORT refuses it.
    fallback: Optional[str] = None
    #: Removes what ORT refused (the entry's pre-packed files, or the prepared entry), so no later
    #: start tries it again; called by :meth:`use_fallback`.
    discard_refused: Optional[Callable[[], None]] = None
    #: What ortmem did, in a word or two, for reports: "as-is", "mapped", "converted", "cache-hit",
    #: "pre-packed" (mapped ORT's packed weights, saved earlier or by this start), "prepared" (a model
    #: ortmem does not convert, loaded from its prepared cache entry: ORT maps its packed weights,
    #: :mod:`ortmem.store.prepared_entries`), "in-memory", "converted-temporary" (converted into a private
    #: folder removed after creation), or "untouched: <why>".
    action: str = "as-is"
    #: A cold start's packing of ORT's weights, started once the session has run
    #: (:mod:`ortmem.store.packer`); None when nothing is left to pack in the background.
    prepack_later: Optional[PrepackLater] = None

    def use_fallback(self) -> str:
        """ORT refused ``model``: discard it (no later start tries it again) and load ``fallback``."""
        discard, self.discard_refused = self.discard_refused, None
        if discard is not None:
            discard()
        self.model, self.fallback = self.fallback, None
        self.action = "cache-hit" if self.action == "pre-packed" else "as-is"
        return self.model

    def session_ran(self) -> None:
        """The session answered its first run: start what was left for after it (once)."""
        later, self.prepack_later = self.prepack_later, None
        if later is not None:
            later.start()

    def register(self, options) -> None:
        if self.memory is not None:
            self.memory.register(options)

    def after_create(self) -> None:
        """ORT has mapped what it needs: give back our own mappings, pages ORT no longer reads, and
        temporary files."""
        if self.source is not None:
            self.source.store.mark_handed()
            self.source.release()
            self.source.close()
        if self.memory is not None:
            self.memory.release_unread()
        self.cleanup()

    def cleanup(self) -> None:
        for d in [self.tempdir, *self.extra_tempdirs]:
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self.tempdir, self.extra_tempdirs = None, []

    def skeleton(self) -> onnx.ModelProto:
        """The weightless ModelProto ORT is about to be given (parsed from the path or the bytes)."""
        if self.source is not None and self.source.pristine and self.model == str(self.source.path):
            return self.source.skeleton  # already parsed by the loader
        if isinstance(self.model, str):
            return onnx.load(self.model, load_external_data=False)
        return onnx.ModelProto.FromString(self.model)

    @property
    def folder(self) -> Optional[str]:
        """Where the external data of :meth:`skeleton` lives."""
        if FOLDER_KEY in self.config:
            return self.config[FOLDER_KEY]
        return str(Path(self.model).resolve().parent) if isinstance(self.model, str) else None


@dataclass
class ConvertOptions:
    """What the hook may do to the graph before ORT sees it."""

    enabled: bool = True
    settings: Optional[OrtSettings] = None
    cache: Optional[Cache] = None  # None: converted in memory (or a private temporary folder), nothing kept
    progress: Optional[Progress] = None
    fp16_in_fp32: Optional[bool] = None  # None: ask ORT's CPU EP; False when a GPU EP runs fp16 natively
    report: Optional[ConversionReport] = None  # filled in: what was converted (None on a cache hit)
    cache_hit: bool = False
    #: On a cache hit, load ORT's pre-packed MatMulNBits weights saved beside the entry (saving them
    #: on the first hit): CPU EP only, and only when ORT pre-packs at all. See ortmem.store.prepacked.
    prepacked: bool = False
    sess_options: Optional[object] = None  # the user's options (the packing sessions copy MLAS settings)
    #: Set when ortmem declined to convert a model it could have (a validity fault, a failed rewrite):
    #: ORT judges such a model as given, and nothing is prepared from it either.
    declined: bool = False


def prepare(model: ModelInput, convert: Optional[ConvertOptions] = None) -> Handoff:
    """Turn any supported model input into a :class:`Handoff` (may load or convert; never copies weights)."""
    if isinstance(model, Model):
        return _converted_or_as_is(model, convert)
    if isinstance(model, (str, os.PathLike)):
        if convert is not None and convert.sess_options is not None and get_config(convert.sess_options, FOLDER_KEY):
            # ORT would look for every external file in the caller's folder, not beside what we give it
            return Handoff(model=str(model), action=f"untouched: the caller's SessionOptions set {FOLDER_KEY}")
        entry = _cache_hit(Path(model), convert)
        if entry is not None:  # a warm start: nothing to parse but the entry, which ORT reads itself
            handoff = _warm_start(entry, convert)
            if handoff is not None:  # None: the entry failed its full check and was discarded
                return handoff
        key = _prepared_key(Path(model), convert)
        known = False
        if key is not None:  # a model ortmem does not convert: its prepared entry, read without parsing
            handoff, known = _prepared_start(Path(model), key, convert)
            if handoff is not None:
                return handoff
        handoff = _converted_or_as_is(load(model), convert)
        if FOLDER_KEY in handoff.config and handoff.memory is None and convert is not None and convert.sess_options is not None:
            # Only the caller's options could carry the folder entry, and ortmem leaves them alone.
            handoff.after_create()
            return Handoff(model=str(model), action="untouched: no hard link possible beside the caller's SessionOptions")
        if key is not None and not known:
            _prepare_after_first_run(handoff, Path(model), key, convert)
        return handoff
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _spill(lambda f: f.write(model), convert)
    if isinstance(model, onnx.ModelProto):
        return _spill(lambda f: f.write(model.SerializeToString()), convert)
    raise TypeError(f"ortmem cannot load a model from {type(model).__name__}; pass a path, bytes, ModelProto or ortmem.Model")


def _converted_or_as_is(model: Model, convert: Optional[ConvertOptions], own_folder: bool = False) -> Handoff:
    """With a cache: a hit is loaded by path, a miss is converted into a new entry first, so ORT maps
    each converted tensor from the page cache and drops it after pre-packing, exactly as it does for
    a native MatMulNBits model. Without one: converted in memory and borrowed by ORT (ortmem.inmemory)."""
    if convert is None or not convert.enabled or not _has_dequantize(model):
        return from_model(model, own_folder=own_folder, link_root=_cache_root(convert))
    fault = validity_fault(model.skeleton.graph)
    if fault is not None:  # a rewrite could hide it: ORT judges the model as given
        convert.declined = True
        log.info("ortmem: not converting %s (%s); onnxruntime gets it as given", model.path, fault)
        return from_model(model, own_folder=own_folder, link_root=_cache_root(convert))
    try:
        return _convert(model, convert, own_folder)
    except MemoryError:
        raise
    except CacheError:
        raise
    except Exception as exc:  # noqa: BLE001 - any rewrite failure: ORT gets the model as given
        detail = str(exc) if isinstance(exc, OrtmemError) else f"{type(exc).__name__}: {exc}"
        log.warning("ortmem: could not convert %s (%s); onnxruntime gets it as given", model.path, detail)
        convert.report, convert.cache_hit, convert.declined = None, False, True
        return from_model(model, own_folder=own_folder, link_root=_cache_root(convert))


def _convert(model: Model, convert: ConvertOptions, own_folder: bool) -> Handoff:
    """The conversion itself (:func:`_converted_or_as_is` decides whether to try it)."""
    settings = convert.settings or OrtSettings()
    if convert.cache is not None:
        try:
            for _ in range(2):  # a hit found damaged by the full check before pre-packing is rebuilt once
                entry, hit, report = convert_cached(model, settings, convert.cache, progress=convert.progress,
                                                    fp16_in_fp32=convert.fp16_in_fp32)
                convert.cache_hit, convert.report = hit, report
                if entry is None:
                    return from_model(model, own_folder=own_folder, link_root=_cache_root(convert))
                handoff = _warm_start(entry, convert) if hit else _cold_start(entry, convert)
                if handoff is not None:
                    _consume(model)
                    return handoff
        except CacheError as exc:
            log.warning("ortmem: the cache could not be used (%s); converting in memory instead", exc)
        convert.cache_hit = False
    plan = plan_conversion(model, settings, carry_unchanged=True, fp16_in_fp32=convert.fp16_in_fp32)
    if not plan.has_work:
        return from_model(model, own_folder=own_folder)
    if convert.sess_options is not None:
        return _converted_in_tempdir(model, plan, convert, own_folder)
    memory = convert_in_memory(model, plan, progress=convert.progress, prepacking=settings.prepacking)
    convert.report = ConversionReport.from_plan(plan, memory.seconds)
    model.store.release_all()  # source pages read for conversion go back now
    return Handoff(model=memory.skeleton, config=memory.config, source=model, memory=memory, action="in-memory")


def _converted_in_tempdir(model: Model, plan: ConversionPlan, convert: ConvertOptions, own_folder: bool) -> Handoff:
    """Convert into a private temporary folder that ORT loads by path (removed after creation).

    Taken instead of the in-memory conversion when the caller passed ``SessionOptions``: ORT's only
    way to borrow in-memory files is to register them on the options object
    (``add_external_initializers_from_files_in_memory``), a registration that can be neither undone
    nor kept private (``SessionOptions`` cannot be copied). Left on the caller's object, it made a
    later plain-ORT session of another model whose data file has the same name read *this* model's
    weights (issue 20). Unchanged tensors are hard-linked from their source files where possible
    (copied otherwise); a folder that cannot be written (a full disk) leaves the model to ORT as given.
    """
    workdir = Path(tempfile.mkdtemp(prefix="ortmem-convert-", dir=model.folder if own_folder else None))
    try:
        convert.report = write_converted(model, plan, workdir, progress=convert.progress, link=True)
    except OSError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        log.warning("ortmem: could not write the converted model into %s (%s); onnxruntime gets %s as given",
                    workdir, exc, model.path)
        convert.report = None
        return from_model(model, own_folder=own_folder)
    _consume(model)
    return Handoff(model=str(workdir / MODEL_FILE), tempdir=workdir, action="converted-temporary")


def _cache_hit(path: Path, convert: Optional[ConvertOptions]):
    """The cache entry for ``path`` under the conversion options, found without loading the model."""
    if convert is None or not convert.enabled or convert.cache is None or not path.is_file():
        return None
    entry = lookup_converted(convert.cache, path, convert.settings or OrtSettings(), convert.fp16_in_fp32)
    convert.cache_hit = entry is not None
    return entry


def _cold_start(entry: Entry, convert: ConvertOptions) -> Handoff:
    """A freshly built entry, loaded by path; with ``convert.prepacked``, ORT's packed weights are
    saved beside it in the background after the session's first run, so the next start maps them."""
    handoff = Handoff(model=str(entry.model_path), action="converted")
    if convert.prepacked and convert.cache is not None and capabilities().prepacked_save:
        handoff.prepack_later = prepack_later_for(entry, convert.cache, convert.sess_options)
    return handoff


def _warm_start(entry: Entry, convert: ConvertOptions) -> Optional[Handoff]:
    """A cache hit, loaded by path: the entry's pre-packed model when ``convert.prepacked`` (saved
    now if this is the first hit, or if the saved one is for another CPU or ORT), else the entry.
    None when the entry turned out damaged (it is discarded; the caller converts again).

    Nothing is derived from an entry that was not checked in full: before packing, an entry looked
    up with ``verify="sampled"``/``"off"`` is digested whole (a byte flipped in weights.bin would
    otherwise be baked into every later session's pre-packed weights).

    The packing is normally done by then: the cold start left it to a background process after its
    session's first run (:mod:`ortmem.store.packer`). Otherwise (small weights, no run yet, a packer
    that failed) this start packs, once, under the entry's creator lock, before ORT's session exists,
    in groups of a few tensors, peaking well under the session itself. It never waits for that lock:
    whoever holds it (the packer, another worker packing, a process stopped or starved while it
    packs) may take longer than ORT takes to load the entry itself, so a start that finds the lock
    taken loads the entry at once ("cache-hit"; a later start maps the pre-packed weights).
    """
    if convert.prepacked and capabilities().prepacked_save:
        mode = convert.cache.verify_mode if convert.cache is not None else "full"
        path = prepacked_model(entry.path, mode)
        if path is None and convert.cache is not None:
            try:
                with convert.cache.creating(entry.key, timeout=0):  # N workers, or the background packer: one packs
                    if _damaged_for_packing(entry, convert, mode):
                        return None
                    path = prepacked_model(entry.path, mode) or _save_prepacked(entry, convert)
            except LockBusyError as exc:
                log.info("ortmem: another process is packing %s (%s); loading the entry itself", entry.path, exc)
        elif path is None:
            path = _save_prepacked(entry, convert)
        if path is not None:
            return Handoff(model=str(path), fallback=str(entry.model_path), action="pre-packed",
                           discard_refused=lambda: discard_prepacked(entry.path))
    return Handoff(model=str(entry.model_path), action="cache-hit")


def _prepared_key(path: Path, convert: Optional[ConvertOptions]) -> Optional[str]:
    """The key of ``path``'s prepared entry when this start may use one (a cache, the CPU EP with
    pre-packing on, a release that saves pre-packed weights, a file); else None."""
    if (convert is None or convert.cache is None or not convert.prepacked or not path.is_file()
            or not capabilities().prepacked_save):
        return None
    config, _ = packing_settings(convert.sess_options)
    return prepared_key(path, convert.settings or OrtSettings(), config, convert.enabled)


def _prepared_start(path: Path, key: str, convert: ConvertOptions) -> tuple[Optional[Handoff], bool]:
    """(the warm start from ``path``'s prepared entry, or None; whether an entry or a marker exists,
    so nothing is left to build). A marker (ORT packs nothing in this model) leaves the start ORT's."""
    cache = convert.cache
    assert cache is not None
    entry = lookup_prepared(cache, key)
    if entry is None:
        return None, False
    if is_marker(entry):
        return None, True
    return Handoff(model=str(entry.model_path), fallback=str(path), action="prepared",
                   discard_refused=lambda: cache.discard(entry)), True


def _prepare_after_first_run(handoff: Handoff, path: Path, key: str, convert: ConvertOptions) -> None:
    """A cold start of a model ortmem gave ORT unconverted: after the session's first run, one
    niced background process builds its prepared entry (:mod:`ortmem.store.packer`), so the next
    start maps ORT's packed weights. Only for models with at least
    :func:`ortmem.store.prepared_entries.min_prepared_bytes` of initializers (small ones stay at zero cost),
    and not for a model ortmem converted or declined to convert."""
    if (handoff.action not in ("as-is", "mapped") or handoff.memory is not None or convert.report is not None
            or convert.declined or convert.cache_hit or convert.cache is None or handoff.source is None):
        return
    if handoff.source.weight_bytes < min_prepared_bytes():
        return
    handoff.prepack_later = prepare_later_for(path, key, convert.cache, convert.sess_options,
                                              convert.settings or OrtSettings(), convert.enabled)


def _damaged_for_packing(entry: Entry, convert: ConvertOptions, mode: str) -> bool:
    """Check an entry looked up with ``verify="sampled"``/``"off"`` in full before packing from it;
    a damaged one is discarded (True: the caller converts again)."""
    if mode == "full" or convert.cache is None:
        return False
    problem = convert.cache.verify(entry, mode="full")
    if problem is None:
        return False
    log.warning("ortmem: cache entry %s is damaged (%s); rebuilding", entry.path, problem)
    convert.cache.discard(entry)
    convert.cache_hit = False
    return True


def _save_prepacked(entry: Entry, convert: ConvertOptions) -> Optional[Path]:
    """Pack and save the entry's pre-packed weights; None (logged) when ORT packs none or it fails."""
    path = None
    try:
        path = save_prepacked(entry.path, sess_options=convert.sess_options)
        if path is not None and convert.cache is not None:
            convert.cache.enforce_limit(keep=entry.key)  # the entry just grew
    except CacheError as exc:
        log.warning("ortmem: could not save pre-packed weights for %s (%s); loading %s",
                    entry.path, exc, entry.model_path.name)
    return path


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
    model (:mod:`ortmem.ortmodel.value_types`), which a model without DequantizeLinear never needs."""
    return any(n.op_type == "DequantizeLinear" for _, g in iter_graphs(model.skeleton.graph) for n in g.node)


def _consume(model: Model) -> None:
    """The source model has been converted: give back every page of it before ORT starts."""
    model.store.mark_handed()
    model.release()
    model.close()


def from_model(model: Model, own_folder: bool = False, link_root: Optional[Path] = None) -> Handoff:
    """Hand ``model`` over unconverted: its own path when the file is what ORT should load, else its
    skeleton by path beside its weight files (see the module docstring), else skeleton bytes plus
    the folder config entry. ``own_folder``: the model lives in a private folder ortmem made (a
    spilled bytes model), so the skeleton is written there directly."""
    if model.pristine:
        return Handoff(model=str(model.path), source=model)
    if own_folder:
        return Handoff(model=str(_write_skeleton(model, model.folder)), source=model, action="mapped")
    for root in (None, link_root):  # the system temp folder first, then the cache's file system
        handoff = _linked_skeleton(model, root)
        if handoff is not None:
            return handoff
    return Handoff(
        model=model.skeleton.SerializeToString(),
        config={FOLDER_KEY: str(model.folder)},
        source=model,
        action="mapped",
    )


def _linked_skeleton(model: Model, root: Optional[Path]) -> Optional[Handoff]:
    """The skeleton in a new private folder (under ``root``) beside hard links to every file its
    tensors point into; None when a link cannot be made there (the caller tries elsewhere).
    Symbolic links would not do: ORT resolves them and refuses data outside the model's folder."""
    if root is not None and not root.is_dir():
        return None
    workdir = Path(tempfile.mkdtemp(prefix=".tmp-link-" if root else "ortmem-", dir=root))
    try:
        for location in _external_locations(model):
            target = workdir / location
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(model.folder / location, target)
        path = _write_skeleton(model, workdir)
    except OSError as exc:
        log.debug("ortmem: cannot hard-link %s into %s (%s)", model.path, workdir, exc)
        shutil.rmtree(workdir, ignore_errors=True)
        return None
    return Handoff(model=str(path), source=model, tempdir=workdir, action="mapped")


def _external_locations(model: Model) -> set[str]:
    """Every external-data file the skeleton's tensors point into, relative to the model folder.

    Raises ``OSError`` when a tensor outside the main graph (a subgraph's, a function's) is external:
    ORT runs ONNX's checker on subgraphs, which refuses external data in a file with more than one
    hard link ("potential hardlink attack"). Main-graph initializers and Constant values are
    accepted (ORT turns Constants into initializers before checking nodes)."""
    graph = model.skeleton.graph
    main = [*graph.initializer]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                main.append(attr.t)
            elif attr.type == onnx.AttributeProto.TENSORS:
                main.extend(attr.tensors)
    main = [t for t in main if is_external(t)]
    if sum(1 for site in iter_tensor_sites(model.skeleton) if is_external(site.tensor)) != len(main):
        raise OSError("a subgraph or function holds external data, which ORT refuses from a hard-linked file")
    return {e.value for t in main for e in t.external_data if e.key == "location"}


def _write_skeleton(model: Model, folder: Path) -> Path:
    """Write the skeleton into ``folder`` under a name no weight file there uses."""
    taken = {p.name for p in folder.iterdir()}
    name = next(n for n in (f"ortmem-skeleton{i or ''}.onnx" for i in range(len(taken) + 1)) if n not in taken)
    path = folder / name
    path.write_bytes(model.skeleton.SerializeToString())
    return path


def _cache_root(convert: Optional[ConvertOptions]) -> Optional[Path]:
    return convert.cache.root if convert is not None and convert.cache is not None else None


def _spill(write, convert: Optional[ConvertOptions] = None) -> Handoff:
    """Write an in-memory model to a private file so its weights can be mapped instead of copied."""
    tempdir = Path(tempfile.mkdtemp(prefix="ortmem-"))
    try:
        path = tempdir / "model.onnx"
        with open(path, "wb") as f:
            write(f)
        # a temporary file has no identity worth caching under (and is gone before a background
        # cache write could read it)
        uncached = dataclasses.replace(convert, cache=None) if convert is not None else None
        handoff = _converted_or_as_is(load(path), uncached, own_folder=True)
        if convert is not None and uncached is not None:
            convert.report = uncached.report  # what was converted, for the session's ortmem_report
    except BaseException:
        shutil.rmtree(tempdir, ignore_errors=True)
        raise
    handoff.tempdir = tempdir
    return handoff
