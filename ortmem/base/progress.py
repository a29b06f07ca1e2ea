"""Progress display for long work (converting or generating multi-GB models), on stderr.

A terminal gets a live bar (rich, already installed with memray). Anything else (CI, ``| tee``, a
server's log) gets one line when a stage starts and one when it ends: a live bar repainted into a
file is hundreds of carriage-return updates on one line.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

Update = Callable[[int, int, str], None]


@contextmanager
def progress_bar(label: str, stream: TextIO | None = None) -> Iterator[Update]:
    """Yield ``update(done_bytes, total_bytes, name)``: a live bar on a terminal, else stage lines."""
    stream = stream or sys.stderr
    if not stream.isatty():
        with stage_lines(label, stream) as update:
            yield update
        return
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[name]}"), transient=False,
    ) as progress:
        task = progress.add_task(label, total=None, name="")

        def update(done: int, total: int, name: str = "") -> None:
            progress.update(task, completed=done, total=total, name=name[-40:])

        yield update


@contextmanager
def stage_lines(label: str, stream: TextIO) -> Iterator[Update]:
    """``label: started (N MB)`` at the first update and ``label: done, N MB in S s`` at the end."""
    state = {"started": 0.0, "total": 0, "done": 0}

    def update(done: int, total: int, name: str = "") -> None:
        if not state["started"]:
            state["started"] = time.monotonic()
            print(f"{label}: started ({total / 1e6:.0f} MB)", file=stream, flush=True)
        state["done"], state["total"] = done, total

    yield update
    if state["started"]:
        seconds = time.monotonic() - state["started"]
        print(f"{label}: done, {state['done'] / 1e6:.0f} MB in {seconds:.1f} s", file=stream, flush=True)
