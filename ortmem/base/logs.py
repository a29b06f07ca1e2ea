"""Log calls for the modules every hooked process imports, without importing :mod:`logging` there.

Why: ``python -m ortmem run`` imports the hook, the file-facts reader and the allocator hygiene into
every program it runs, including those whose models ortmem leaves to ORT, where its cost must stay
within the budget docs/hook.md states; importing ``logging`` alone would take a large share of it. A
*debug* record made while nothing has imported ``logging`` has no listener (configuring logging means
importing it), so it is dropped without being made; a *warning* imports ``logging``, since Python's
last-resort handler shows it even where nobody configured anything. Records go to the logger named
``name`` (the calling module's ``__name__``), exactly as ``logging.getLogger(__name__)`` would.
"""
from __future__ import annotations

import sys


def debug(name: str, msg: str, *args: object) -> None:
    """``logging.getLogger(name).debug(msg, *args)`` where logging is loaded; nothing otherwise."""
    logging = sys.modules.get("logging")
    if logging is not None:
        logging.getLogger(name).debug(msg, *args)


def warning(name: str, msg: str, *args: object) -> None:
    """``logging.getLogger(name).warning(msg, *args)``, importing logging if nothing has yet."""
    import logging

    logging.getLogger(name).warning(msg, *args)


def info(name: str, msg: str, *args: object) -> None:
    """``logging.getLogger(name).info(msg, *args)`` where logging is loaded; nothing otherwise (an info
    record reaches no handler unless someone configured logging, which imports it)."""
    logging = sys.modules.get("logging")
    if logging is not None:
        logging.getLogger(name).info(msg, *args)
