"""What the store answers a session start: :class:`Start`, one verdict, and :class:`Decision`, the one
vocabulary of what a start did.

Why a module of its own: the verdict is built in three places of the store (a lookup,
:mod:`ortmem.store.verdict`; a converted entry's hit, :mod:`ortmem.store.hit`; a new entry,
:mod:`ortmem.store.publish`) and read by the handoff, which takes it apart with no further call into the
store: every decision it needs is a field (a hit is :attr:`Start.hit`). The handoff
(:class:`ortmem.session.handoff.Handoff`) carries the same :class:`Decision`, so a store verdict becomes
the session's ``ortmem_action`` with no translation.

The store's decisions (:attr:`Start.kind`):

- :attr:`Decision.CACHE_HIT`: a converted entry's model itself (pre-packing off, not CPU-only, or ORT
  has not finished it yet: ``later`` then finishes it after the first run);
- :attr:`Decision.FINISHED`: ORT's finished model (:mod:`ortmem.store.finished`), loaded with graph
  optimizations off: a converted entry's (``fallback`` is the entry's own model) or the finished entry
  of a model ortmem does not convert (:mod:`ortmem.store.finished_entries`; ``fallback`` is the source
  itself);
- :attr:`Decision.CONVERTED`: the entry :func:`ortmem.store.publish.publish` just built (a cold start);
- :attr:`Decision.UNCONVERTED`: nothing to load, and the store knows why: the model's finished entry
  is a marker (nothing of it worth mapping), recorded under these settings and versions by a start
  whose loader accepted the files as they still are (the lookup's sources check) and converted
  nothing. The caller gives ORT the model without loading it again;
- :attr:`Decision.MISS`: nothing to load: the caller converts (then publishes), or gives ORT the model.
"""
from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ortmem.base.records import record
from ortmem.files.layout import Entry
from ortmem.files.layout import MODEL_FILE
from ortmem.store.finished import discard_finished

if TYPE_CHECKING:
    from ortmem.passes.conversion_report import ConversionReport
    from ortmem.store.cache import Cache
    from ortmem.store.finisher import FinishLater


class Decision(enum.Enum):
    """What a start did, one member per outcome; each value is a short stable string (the session's
    ``ortmem_action``). Defined here, with the store's verdict, because the store decides most of them;
    the ones only the session reaches (``AS_IS``, ``MAPPED``, ``IN_MEMORY``, ``CONVERTED_TEMPORARY``,
    ``UNTOUCHED``) are named here too, so there is one vocabulary and no table translating it."""

    #: The store has nothing to load (a verdict only: a handoff never carries it).
    MISS = "miss"
    #: ORT gets the model file as given (its external data ORT maps itself).
    AS_IS = "as-is"
    #: ORT gets a skeleton of the model beside hard links to its data, so it maps the embedded weights.
    MAPPED = "mapped"
    #: A cold start: the entry a conversion just published.
    CONVERTED = "converted"
    #: Converted into a private temporary folder (no cache), removed once the session exists.
    CONVERTED_TEMPORARY = "converted-temporary"
    #: Converted in memory that ORT borrows.
    IN_MEMORY = "in-memory"
    #: A converted entry found in the cache, loaded as it is.
    CACHE_HIT = "cache-hit"
    #: ORT's finished model (of a converted entry, or of a model ortmem does not convert), loaded with
    #: graph optimizations off.
    FINISHED = "finished"
    #: The store settled that the model needs nothing: it is loaded as given (a verdict only).
    UNCONVERTED = "unconverted"
    #: ortmem left the caller's model and options alone (the handoff's ``reason`` says why).
    UNTOUCHED = "untouched"

    def __str__(self) -> str:
        return self.value


@record
class Start:
    """The store's verdict on one start (see the module docstring for the decisions); a named tuple, as
    every record a warm start imports (:class:`ortmem.session.handoff.Handoff` says why)."""

    kind: Decision
    #: What ORT loads (None on a miss).
    path: Optional[Path] = None
    #: What ORT loads instead if it refuses ``path`` (:meth:`refused` removes ``path`` first).
    fallback: Optional[Path] = None
    #: The converted or finished entry behind ``path``.
    entry: Optional[Entry] = None
    #: Work for after the session's first run (:mod:`ortmem.store.finisher`): finishing a converted entry
    #: (new, or found not yet finished), or, on a miss, building the model's finished entry if ORT gets
    #: the model unconverted.
    later: Optional["FinishLater"] = None
    cache: Optional["Cache"] = None
    #: What was converted (``CONVERTED`` only; None on a hit or a miss).
    report: Optional["ConversionReport"] = None
    #: ``CONVERTED`` by a helper process (:mod:`ortmem.session.cold_start_child`): the starting
    #: process converted nothing.
    in_helper: bool = False
    #: ORT loads a converted entry found in the cache (its model, or ORT's finished one of it).
    hit: bool = False

    def _in_converted_entry(self) -> bool:
        """A finished model kept inside a converted entry (not a finished entry's own ``model.onnx``)."""
        return self.entry is not None and self.path is not None and self.path.name != MODEL_FILE

    def refused(self) -> None:
        """ORT refused ``path``: remove what it refused (a converted entry's finished model, or the
        finished entry), so no later start tries it again."""
        if self.entry is None or self.kind is not Decision.FINISHED:
            return
        if self._in_converted_entry():
            assert self.path is not None
            discard_finished(self.path.parent, self.path.stem)
        elif self.cache is not None:
            self.cache.discard(self.entry)
