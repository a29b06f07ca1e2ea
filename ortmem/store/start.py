"""What the store answers a session start: :class:`Start`, one verdict, and its kinds.

Why a module of its own: the verdict is built in three places of the store (a lookup,
:mod:`ortmem.store.verdict`; a converted entry's hit, :mod:`ortmem.store.hit`; a new entry,
:mod:`ortmem.store.publish`) and read by the handoff, which takes it apart with no further call into the
store: every decision it needs is a field (a hit is :attr:`Start.hit`).

Kinds (:attr:`Start.kind`, also the session's ``ortmem_action`` for a hit):

- ``"cache-hit"``: a converted entry's model itself (pre-packing off, not CPU-only, or ORT has not
  finished it yet: ``later`` then finishes it after the first run);
- ``"prepared"``: ORT's finished model (:mod:`ortmem.store.finished`), loaded with graph optimizations
  off: a converted entry's (``fallback`` is the entry's own model) or the prepared entry of a model
  ortmem does not convert (:mod:`ortmem.store.finished_entries`; ``fallback`` is the source itself);
- ``"converted"``: the entry :func:`ortmem.store.publish.publish` just built (a cold start);
- ``"unconverted"``: nothing to load, and the store knows why: the model's prepared entry is a marker
  (nothing of it worth mapping), recorded under these settings and versions by a start whose loader
  accepted the files as they still are (the lookup's sources check) and converted nothing. The
  caller gives ORT the model without loading it again;
- ``"miss"``: nothing to load: the caller converts (then publishes), or gives ORT the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ortmem.files.layout import Entry
from ortmem.files.layout import MODEL_FILE
from ortmem.store.finished import discard_finished

if TYPE_CHECKING:
    from ortmem.passes.conversion_report import ConversionReport
    from ortmem.store.cache import Cache
    from ortmem.store.finisher import PrepackLater

MISS = "miss"
CONVERTED = "converted"
CACHE_HIT = "cache-hit"
PREPARED = "prepared"
UNCONVERTED = "unconverted"


@dataclass(frozen=True)
class Start:
    """The store's verdict on one start (see the module docstring for the kinds)."""

    kind: str
    #: What ORT loads (None on a miss).
    path: Optional[Path] = None
    #: What ORT loads instead if it refuses ``path`` (:meth:`refused` removes ``path`` first).
    fallback: Optional[Path] = None
    #: The converted or prepared entry behind ``path``.
    entry: Optional[Entry] = None
    #: Work for after the session's first run (:mod:`ortmem.store.finisher`): finishing a converted entry
    #: (new, or found not yet finished), or, on a miss, building the model's prepared entry if ORT gets
    #: the model unconverted.
    later: Optional["PrepackLater"] = None
    cache: Optional["Cache"] = None
    #: What was converted (``"converted"`` only; None on a hit or a miss).
    report: Optional["ConversionReport"] = None
    #: ``"converted"`` by a helper process (:mod:`ortmem.session.cold_start_child`): the starting
    #: process converted nothing.
    in_helper: bool = False
    #: ORT loads a converted entry found in the cache (its model, or ORT's finished one of it).
    hit: bool = False

    def _in_converted_entry(self) -> bool:
        """A finished model kept inside a converted entry (not a prepared entry's own ``model.onnx``)."""
        return self.entry is not None and self.path is not None and self.path.name != MODEL_FILE

    def refused(self) -> None:
        """ORT refused ``path``: remove what it refused (a converted entry's finished model, or the
        prepared entry), so no later start tries it again."""
        if self.entry is None or self.kind != PREPARED:
            return
        if self._in_converted_entry():
            assert self.path is not None
            discard_finished(self.path.parent, self.path.stem)
        elif self.cache is not None:
            self.cache.discard(self.entry)
