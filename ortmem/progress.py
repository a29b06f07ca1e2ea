"""Progress display for long work (converting or generating multi-GB models), on stderr.

Uses rich (already installed with memray) so a terminal gets a live bar and a log gets nothing noisy.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


@contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int, str], None]]:
    """Yield ``update(done_bytes, total_bytes, name)``."""
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[name]}"), transient=False,
    ) as progress:
        task = progress.add_task(label, total=None, name="")

        def update(done: int, total: int, name: str = "") -> None:
            progress.update(task, completed=done, total=total, name=name[-40:])

        yield update
