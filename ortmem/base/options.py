"""Add session config entries for one session creation without leaving them in the user's options.

``onnxruntime.SessionOptions`` cannot be copied (no copy constructor, not picklable) and its config
entries cannot be listed, so a faithful private copy is impossible. ORT copies the options into
the C++ session when it is created, though, so ortmem sets what it needs on the user's object for
the duration of that call and puts back what was there before. A key that was absent is reset to
the empty string, which ORT treats as unset for every key ortmem uses (ORT cannot delete a key).
A lock serialises this, so threads sharing one options object never see ortmem's entries.
"""
from __future__ import annotations

from _thread import RLock  # threading's own RLock; the threading module costs a warm start 1.5 ms
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import onnxruntime as ort

_lock = RLock()


def get_config(options: ort.SessionOptions, key: str) -> Optional[str]:
    try:
        return options.get_session_config_entry(key)
    except (RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail):  # absent keys raise
        return None


def at_defaults(sess_options: Optional[ort.SessionOptions], providers: Optional[Sequence[Any]],
                provider_options: Optional[Sequence[Any]], disabled_optimizers: Any, *, convert: bool,
                prepacked: bool) -> bool:
    """Whether a session's creation leaves ORT, and ortmem, at their defaults in everything ORT's
    finished model depends on: no SessionOptions, no disabled optimizers, no provider options, ORT's
    CPU EP alone (or no providers named), conversion and pre-packed weights on. What the store settles
    for such a start holds for every such start of the same release
    (:func:`ortmem.store.handoff_records.mark_as_given`)."""
    return (sess_options is None and provider_options is None and not disabled_optimizers and convert and prepacked
            and all(p == "CPUExecutionProvider" for p in providers or ()))


@contextmanager
def scoped_config(options: Optional[ort.SessionOptions], entries: Mapping[str, str]) -> Iterator[ort.SessionOptions]:
    """Yield options carrying ``entries``; the user's object reads back unchanged afterwards."""
    if options is None:
        fresh = ort.SessionOptions()
        for k, v in entries.items():
            fresh.add_session_config_entry(k, v)
        yield fresh
        return
    with _lock:
        previous = {k: get_config(options, k) for k in entries}
        changed = [k for k, v in entries.items() if previous[k] != v]
        for k in changed:
            options.add_session_config_entry(k, entries[k])
        try:
            yield options
        finally:
            for k in changed:
                options.add_session_config_entry(k, previous[k] if previous[k] is not None else "")
