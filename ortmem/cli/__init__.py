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

from ortmem.errors import OrtmemError

#: Subcommand modules of this package, in the order ``--help`` lists them.
COMMANDS = ("inspect", "convert", "prepare", "cache", "doctor", "bench", "estimate", "stats", "partition", "recompute", "run")


def command(name: str) -> ModuleType:
    """The module that implements subcommand ``name``."""
    return importlib.import_module(f"{__name__}.{name}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``ortmem`` command. ``ortmem run -- script.py args`` (no option) goes straight to the
    launcher: argparse's import, parser and message-catalogue probes cost 5-6 ms of every hooked
    process, whose cost over a plain run is held to 20 ms (docs/hook.md); what argparse would have
    parsed there is every option's default and the program (tests/intercept/test_session_hook.py compares).

    Where ``ortmem`` is not this installed package (a folder named ``ortmem`` in the current folder
    shadows it), every command but ``run`` says so and returns 1; an ImportError ends in one line and 1,
    not a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # a shadowed package: the program runs, its sessions plain (launcher.start)
        from ortmem.intercept import launcher

        program = launcher.bare_program(argv[1:])
        if program is not None:
            return launcher.start(None, program)
    else:
        from ortmem.intercept.own_package import problem

        shadowed = problem()
        if shadowed is not None:  # every command would fail on the package's own names (__version__...)
            print(f"ortmem: error: {shadowed}; run ortmem from another folder, or rename that one", file=sys.stderr)
            return 1
    try:
        from ortmem.cli.parser import build_parser, named_command

        args = build_parser(named_command(argv)).parse_args(argv)
        return args.func(args)
    except OrtmemError as e:
        print(f"ortmem: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:  # a broken install, or an optional extra that is not installed
        print(f"ortmem: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
