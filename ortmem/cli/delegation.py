"""Subcommands whose work belongs to another stage: that stage's own parser and main, imported on use."""
from __future__ import annotations

import argparse
import importlib
from typing import Callable


def delegate(owner: str, add: str, main: str) -> tuple[Callable[[argparse.ArgumentParser], None],
                                                       Callable[[argparse.Namespace], int]]:
    """``(add_arguments, run)`` that hand the subcommand to ``owner.add`` / ``owner.main``; ``owner`` is
    imported when the parser is built or the command runs, not when the CLI package is."""

    def add_arguments(p: argparse.ArgumentParser) -> None:
        getattr(importlib.import_module(owner), add)(p)

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(owner), main)(args)

    return add_arguments, run
