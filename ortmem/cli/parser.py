"""The ``ortmem`` command's argparse parser: the subcommands' own, built from their modules in ``ortmem.cli``.

Kept apart from :func:`ortmem.cli.main` so that ``ortmem run -- script.py`` (no option to parse) starts
the program without importing argparse at all (:func:`ortmem.intercept.launcher.bare_program`).
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from ortmem.cli import COMMANDS, command


def _version_line() -> str:
    import onnxruntime as ort

    from ortmem import __version__
    from ortmem.ort.release import SUPPORTED, TESTED_RELEASES, installed

    lo = ".".join(map(str, SUPPORTED[0]))
    state = "in range" if installed().supported else "OUT OF RANGE: zero-copy loading only"
    return (f"ortmem {__version__}; onnxruntime {ort.__version__} ({state}; supported {lo} on, decided by its "
            f"probe; tested {', '.join(TESTED_RELEASES)})")


class TerminalWidthFormatter(argparse.HelpFormatter):
    """argparse's help formatter, asking the terminal's width only when it formats help.

    Why: argparse makes a formatter for every ``add_argument`` (to check the metavar), and
    ``HelpFormatter`` asks ``shutil.get_terminal_size`` in its constructor: importing shutil (with
    bz2, lzma and zlib) cost 2.9 ms of every process ``ortmem run`` starts, whose cost over a plain
    run is held to 20 ms (docs/hook.md). The width it would have asked is asked here, once, when help
    or usage is printed; ``width`` given explicitly is kept as it is."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: Optional[int] = None, **kwargs) -> None:
        self._asked = (indent_increment, max_help_position, width)
        super().__init__(prog, indent_increment, max_help_position, 80 if width is None else width, **kwargs)

    def format_help(self) -> str:
        indent_increment, max_help_position, width = self._asked
        if width is None:  # what HelpFormatter.__init__ would have computed
            import shutil

            width = shutil.get_terminal_size().columns - 2
            self._width = width
            self._max_help_position = min(max_help_position, max(width - 20, indent_increment * 2))
        return super().format_help()


class _Version(argparse.Action):
    """``--version``: computed only when asked (it imports onnxruntime)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="the ortmem and onnxruntime releases, and the supported range")

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version_line())
        parser.exit()


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole CLI's parser; with ``only``, just that subcommand's (see :func:`named_command`)."""
    parser = argparse.ArgumentParser(
        prog="ortmem",
        formatter_class=TerminalWidthFormatter,
        description="Own the memory of ONNX model weights around ONNX Runtime: load without copies, "
        "fuse QDQ models into MatMulNBits, measure and plan memory.",
    )
    parser.add_argument("--version", action=_Version)
    # prog given: argparse would format the parent's usage to make it (a formatter's help, so the width)
    sub = parser.add_subparsers(dest="command", required=True, prog=parser.prog)
    for name in COMMANDS if only is None else (only,):
        module = command(name)
        p = sub.add_parser(module.NAME, help=module.HELP, formatter_class=TerminalWidthFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def named_command(argv: Sequence[str]) -> Optional[str]:
    """The subcommand ``argv`` starts with, if any. Building every subcommand's parser imports their
    modules (the bench's measurement stack among them, 55 ms); ``ortmem run`` starts every hooked
    program, whose cost over a plain run is held to 20 ms (docs/hook.md), so a named subcommand
    builds only its own parser."""
    return argv[0] if argv and argv[0] in COMMANDS else None
