"""The ``ortmem`` command (also ``python -m ortmem``): one module per subcommand in this package.

The protocol, after memray's ``commands/``: each module defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``, and imports what the command needs only inside
``run`` (``ortmem --help`` loads no planner, ORT session code or plotting). A subcommand whose work
belongs to another stage (``bench`` to ``ortmem.measure``, ``estimate`` to ``ortmem.plan``...) is a
thin module that hands its arguments to that stage's own parser and main.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Optional, Sequence

from ..errors import OrtmemError

#: Subcommand modules of this package, in the order ``--help`` lists them.
COMMANDS = ("inspect", "convert", "prepare", "cache", "doctor", "bench", "estimate", "stats", "partition", "recompute", "run")


def command(name: str) -> ModuleType:
    """The module that implements subcommand ``name``."""
    return importlib.import_module(f"{__name__}.{name}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``ortmem`` command. ``ortmem run -- script.py args`` (no option) goes straight to the
    launcher: argparse's import, parser and message-catalogue probes cost 5-6 ms of every hooked
    process, whose cost over a plain run is held to 20 ms (docs/hook.md); what argparse would have
    parsed there is every option's default and the program (tests/reach/test_session_hook.py compares)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from ..reach import launcher

        program = launcher.bare_program(argv[1:])
        if program is not None:
            return launcher.start(None, program)
    from .parser import build_parser, named_command

    args = build_parser(named_command(argv)).parse_args(argv)
    try:
        return args.func(args)
    except OrtmemError as e:
        print(f"ortmem: error: {e}", file=sys.stderr)
        return 1
