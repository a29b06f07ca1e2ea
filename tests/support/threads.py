"""The same call from several threads at once: what the session, cache and allocator-hygiene tests do to
show that concurrent creators agree and leave nothing behind."""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

R = TypeVar("R")


def run_in_threads(work: Callable[[], R], threads: int = 4) -> list[R]:
    """``work()`` in ``threads`` threads released together by a barrier; what each returned, in the
    order they finished. An exception in a thread would vanish with it: all are collected and the
    test fails here with them."""
    start = threading.Barrier(threads)
    results: list[R] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            start.wait()
            results.append(work())
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    started = [threading.Thread(target=run) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    assert not errors, errors
    return results
