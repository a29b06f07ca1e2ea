"""What the hook passes to every session it makes: its options, apart from the hook itself.

Why a module of its own: the launcher needs the defaults (to export only the options that differ to
child interpreters) before the program imports onnxruntime, and :mod:`ortmem.intercept.session_hook`
imports onnxruntime. ``ortmem run`` on a program that never uses ORT (a server's master process, a
script that only starts workers) then imports neither, as a plain run would not.
"""
from __future__ import annotations

from typing import Union

from ortmem.base.records import record


@record
class HookOptions:
    """What the hook passes to :class:`ortmem.InferenceSession` for every session (see its docstring).

    A named tuple, not a dataclass: the hook is imported into every hooked process, and the
    dataclasses of its modules cost about 7 ms of that start (``bench/hook_stages.py``)."""

    convert: bool = True
    cache: Union[bool, str] = True
    trim: bool = True
    prepacked: bool = True
    strict: bool = False  # ortmem's exceptions propagate instead of falling back to plain ORT
    #: Create every session with plain ORT and only record it (the "hook off" run of a comparison).
    observe_only: bool = False
