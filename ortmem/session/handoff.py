"""What ORT is given, and what ortmem decided on the way: read-only, built once.

A :class:`Handoff` is made by :func:`ortmem.session.decide.prepare` and never edited afterwards. The
two things that change what ORT loads after it is made are steps that return a new handoff:
:meth:`Handoff.with_recorded_settings` (the settings a model written by ``ortmem recompute`` records)
and :meth:`Handoff.refused` (ORT refused its finished model or a mapped skeleton: discard it,
load the fallback; a failure of resources keeps it).
The session only reads it (``ortmem.InferenceSession.ortmem_handoff``), and creates ORT's session with
the options :meth:`Handoff.creation_options` yields.

What is not a decision but a resource (our mappings of the source, the buffer ORT borrows, temporary
folders) is given back by :meth:`Handoff.after_create`, which may be called more than once.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Union

import onnxruntime as ort

from ortmem.base.records import record
from ortmem.onnxfile.scan import FOLDER_KEY, RECOMPUTE_METADATA, file_mentions
from ortmem.ort.recorded_settings import merge_config_value, recorded_settings
from ortmem.base.options import get_config, scoped_config
from ortmem.store.start import Decision, Start

if TYPE_CHECKING:  # the conversion (and onnx) is imported only by a start that converts
    import onnx

    from ortmem.onnxfile.model import Model  # a loaded source: its start imported it already
    from ortmem.store.finisher import FinishLater  # a warm start leaves nothing for later: no finisher imported

    from ortmem.session.inmemory import InMemoryConversion
    from ortmem.passes.conversion_report import ConversionReport

#: The decisions whose model is a folder of ortmem's own that ORT maps every weight from: a cache entry
#: (found, or just built here or by a helper process) or a conversion's private temporary folder. ORT
#: copies none of those weights to its heap but its packed ones, so its creation needs no allocator
#: pin (``ortmem.InferenceSession`` trims after it instead).
ENTRY_ACTIONS = frozenset({Decision.CACHE_HIT, Decision.FINISHED, Decision.CONVERTED, Decision.CONVERTED_TEMPORARY})
#: The decisions whose model is ORT's finished model (:mod:`ortmem.store.finished`): ORT uses it as it
#: was saved, so its session is created with graph optimizations off (for that call only).
FINISHED_ACTIONS = frozenset({Decision.FINISHED})
#: The default of the handoff's read-only mappings: an empty read-only view (of an empty dict nothing
#: else holds, so nothing can fill it).
NOTHING: Mapping[str, Any] = MappingProxyType({})


@record
class Handoff:
    """What ORT is given: a path or skeleton bytes, the session config entries it needs, and (for a
    conversion done in memory) the buffer ORT borrows, which this object keeps alive; and what ortmem
    decided: :attr:`action` (and its :attr:`reason`), :attr:`report`, :attr:`cache_hit`.
    A named tuple, not a dataclass: every warm start imports it, and a frozen dataclass compiles its
    methods at import (about 1.5 ms each here)."""

    model: Union[str, bytes]
    #: Session config entries ORT needs for ``model`` (set only for the creation call; read-only, a
    #: ``MappingProxyType``).
    config: Mapping[str, str] = NOTHING
    #: What ortmem did (:class:`ortmem.store.start.Decision`): the store's verdict for what it loads
    #: (``CONVERTED``, ``CACHE_HIT``, ``FINISHED``: ORT's finished model, loaded with graph
    #: optimizations off, :mod:`ortmem.store.finished`), or ``AS_IS``, ``MAPPED``, ``IN_MEMORY``,
    #: ``CONVERTED_TEMPORARY`` (a private folder removed after creation) or ``UNTOUCHED``.
    action: Decision = Decision.AS_IS
    #: Why, where the decision needs a reason (``UNTOUCHED``: what made ortmem leave the model alone);
    #: for reading, never parsed.
    reason: str = ""
    #: What was converted (None when nothing was, or on a cache hit).
    report: Optional["ConversionReport"] = None
    #: Whether ORT loads a converted entry found in the cache.
    cache_hit: bool = False
    #: ortmem declined to convert a model it could have (a validity fault, a failed rewrite): ORT
    #: judges such a model as given, and nothing is finished from it either.
    declined: bool = False
    source: Optional[Model] = None
    memory: Optional["InMemoryConversion"] = None
    #: Private folders removed once ORT's session exists (ORT's mappings keep what it still reads).
    tempdirs: tuple[Path, ...] = ()
    #: ``model`` is ORT's finished model of a cache entry, or a skeleton beside a hard link to the
    #: source (``mapped`` from its bytes): what to load instead if ORT refuses it.
    fallback: Optional[str] = None
    #: The store's verdict behind ``model`` (:meth:`refused` asks it to discard what ORT refused).
    start: Optional[Start] = None
    #: ORT's finishing of a converted entry (or building of a finished entry), started once the
    #: session has run (:mod:`ortmem.store.finisher`); None when nothing is left for the background.
    later: Optional[FinishLater] = None
    #: The conversion ran in a helper process (:mod:`ortmem.session.cold_start_child`): this
    #: process imported and allocated nothing of it.
    converted_in_helper: bool = False
    #: Session changes a recompute-written model records (``execution_order``, ``session_config``;
    #: :meth:`with_recorded_settings`).
    recompute: Mapping[str, Any] = NOTHING

    def refused(self, *, keep: bool = False) -> "Handoff":
        """ORT failed on ``model``: load ``fallback`` instead. ORT refused what ``model`` holds: discard it
        (no later start tries it again). ``keep``: ORT ran out of resources (memory, threads, file
        descriptors; :func:`ortmem.errors.resource_failure`), which says nothing about the entry: it
        stays for later starts."""
        if self.start is not None and not keep:
            self.start.refused()
        return self._replace(model=self.fallback, fallback=None, start=None,
                                   action=Decision.CACHE_HIT if self.cache_hit else Decision.AS_IS)

    def with_recorded_settings(self) -> "Handoff":
        """Replay the settings a model written by ``ortmem recompute`` records (its execution order and
        the optimizers ORT must skip, :mod:`ortmem.ort.recorded_settings`) on what ORT is about to get."""
        if not self._may_record_recompute():
            return self  # a warm start: decided from the entry's bytes, nothing parsed, no onnx imported
        skeleton = self.skeleton()
        if not any(p.key.startswith(RECOMPUTE_METADATA) for p in skeleton.metadata_props):
            return self  # the common case: nothing recorded
        return self._replace(recompute=MappingProxyType(recorded_settings(skeleton)))

    @contextmanager
    def creation_options(self, user_options: Optional[ort.SessionOptions]) -> Iterator[ort.SessionOptions]:
        """The options ORT's session is created with: the caller's (or fresh ones) carrying this
        handoff's config entries and recompute settings for the duration of the call only (a finished
        model's ``ORT_DISABLE_ALL`` too: the caller's object reads back unchanged); in-memory files are
        registered only on options ortmem made itself (:mod:`ortmem.base.options`)."""
        config = dict(self.config)
        for key, value in (self.recompute.get("session_config") or {}).items():
            config[key] = merge_config_value(key, str(value), get_config(user_options, key) if user_options else None)
        with scoped_config(user_options, config) as options:
            if options is not user_options and self.memory is not None:
                self.memory.register(options)
            previous_order, previous_level = options.execution_order, options.graph_optimization_level
            if "execution_order" in self.recompute:
                options.execution_order = getattr(ort.ExecutionOrder, str(self.recompute["execution_order"]))
            if self.action in FINISHED_ACTIONS:
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            try:
                yield options
            finally:
                options.execution_order = previous_order
                options.graph_optimization_level = previous_level

    def after_create(self) -> None:
        """ORT has mapped what it needs: give back our own mappings, pages ORT no longer reads, and
        temporary files. Safe to call again."""
        if self.source is not None:
            self.source.store.mark_handed()
            self.source.release()
            self.source.close()
        if self.memory is not None:
            self.memory.release_unread()
        self.cleanup()

    def cleanup(self) -> None:
        """Remove the temporary folders (what ORT mapped from them stays readable to it)."""
        if not self.tempdirs:
            return  # most starts: nothing to remove, and shutil is not imported for it
        import shutil

        for d in self.tempdirs:
            shutil.rmtree(d, ignore_errors=True)

    def _may_record_recompute(self) -> bool:
        """False when what ORT gets records no recompute settings; True when it may (parse to know)."""
        if self._parsed_source():
            return any(p.key.startswith(RECOMPUTE_METADATA) for p in self.source.skeleton.metadata_props)
        if isinstance(self.model, str):
            return file_mentions(Path(self.model), RECOMPUTE_METADATA.encode())  # an entry's or a skeleton's file: small
        return RECOMPUTE_METADATA.encode() in self.model

    def _parsed_source(self) -> bool:
        """Whether ORT gets the loader's own model file, whose skeleton is already parsed."""
        return self.source is not None and self.source.pristine and self.model == str(self.source.path)

    def skeleton(self) -> onnx.ModelProto:
        """The weightless ModelProto ORT is about to be given (parsed from the path or the bytes)."""
        if self._parsed_source():
            return self.source.skeleton  # already parsed by the loader
        import onnx

        if isinstance(self.model, str):
            return onnx.load(self.model, load_external_data=False)
        return onnx.ModelProto.FromString(self.model)

    @property
    def folder(self) -> Optional[str]:
        """Where the external data of :meth:`skeleton` lives."""
        if FOLDER_KEY in self.config:
            return self.config[FOLDER_KEY]
        return str(Path(self.model).resolve().parent) if isinstance(self.model, str) else None
