"""What the store answers a session start: :class:`Start`, one verdict, and its kinds.

Why a module of its own: the verdict is built in three places of the store (a lookup,
:mod:`ortmem.store.verdict`; a converted entry's hit, :mod:`ortmem.store.hit`; a new entry,
:mod:`ortmem.store.publish`) and read by the handoff, which takes it apart with no further call into the
store: every decision it needs is a field (a hit is ``kind in HIT_KINDS``).

Kinds (:attr:`Start.kind`, also the session's ``ortmem_action`` for a hit):

- ``"pre-packed"``: a converted entry's pre-packed model (ORT maps its packed weights); ``fallback``
  is the entry's own model;
- ``"cache-hit"``: a converted entry's model itself (pre-packing off, not CPU-only, or another
  process is packing it right now);
- ``"prepared"``: a model ortmem does not convert, loaded from its prepared entry
  (:mod:`ortmem.store.prepared_entries`); ``fallback`` is the source itself;
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

from .layout import Entry
from .prepacked import discard_prepacked

if TYPE_CHECKING:
    from ..passes.conversion_report import ConversionReport
    from .cache import Cache
    from .packer import PrepackLater

MISS = "miss"
CONVERTED = "converted"
CACHE_HIT = "cache-hit"
PRE_PACKED = "pre-packed"
PREPARED = "prepared"
UNCONVERTED = "unconverted"
#: The kinds that load a converted entry found in the cache (pre-packed or not).
HIT_KINDS = frozenset({CACHE_HIT, PRE_PACKED})


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
    #: Work for after the session's first run (:mod:`ortmem.store.packer`): a new entry's packing,
    #: or, on a miss, building the model's prepared entry if ORT gets the model unconverted.
    later: Optional["PrepackLater"] = None
    cache: Optional["Cache"] = None
    #: What was converted (``"converted"`` only; None on a hit or a miss).
    report: Optional["ConversionReport"] = None
    #: ``"converted"`` by a helper process (:mod:`ortmem.handoff.conversion_process`): the starting
    #: process converted nothing.
    in_helper: bool = False

    def refused(self) -> None:
        """ORT refused ``path``: remove what it refused (the entry's pre-packed files, or the prepared
        entry), so no later start tries it again."""
        if self.entry is None:
            return
        if self.kind == PRE_PACKED:
            discard_prepacked(self.entry.path)
        elif self.kind == PREPARED and self.cache is not None:
            self.cache.discard(self.entry)
