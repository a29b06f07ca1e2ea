"""One worker of ``ortmem bench --workers``: ``python -m ortmem.measure.worker_child SPEC_JSON``.

A worker does what a server worker does at start: import, create a session with a strategy, run
it once. Then it prints one JSON line on stdout (``ready``) and blocks reading stdin, so that the
parent can measure every worker at the same moment while all of them are alive; the parent closes
stdin to let it exit. Unlike ``_child`` (one probe), nothing here resets ``VmHWM`` or hashes
timelines: the parent reads ``/proc/<pid>/smaps_rollup`` from outside.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    # The ready line goes to the original stdout; everything else printed to fd 1 (a strategy's or
    # ORT's own output) goes to stderr, so the parent never reads it as the ready line.
    ready_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for p in reversed(spec.get("sys_path") or []):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        import numpy  # noqa: F401  (same imports as a probe's baseline)
        import onnxruntime  # noqa: F401

        from ortmem.base import procfs
        from ortmem.ort.feeds import hash_outputs, make_inputs
        from ortmem.measure.strategies import resolve

        create = resolve(spec["create"])
        options = spec.get("options") or {}
        t0 = time.monotonic()
        session = create(spec["model"], options)
        t1 = time.monotonic()
        feeds = make_inputs(session, options)
        names = [o.name for o in session.get_outputs()]
        outputs = session.run(None, feeds)
        t2 = time.monotonic()
        status = procfs.read_status("self") or {}
        ready = {
            "pid": os.getpid(),
            "create_wall_s": t1 - t0,
            "run_wall_s": t2 - t1,
            "ready_monotonic": t2,
            "output_hash": hash_outputs(names, outputs),
            # an ortmem session that converted (not a cache hit): how many conversions N workers made
            "converted": getattr(session, "ortmem_report", None) is not None,
            "ortmem_action": getattr(session, "ortmem_action", None),
            # this worker's own peak less the file pages it maps now: its private peak, about (the
            # memory guard's input; unlike the machine's used memory, other tenants do not move it)
            "peak_private": max(status.get("VmHWM", 0) - status.get("RssFile", 0), 0),
        }
    except BaseException:  # report everything, including SystemExit from a strategy
        traceback.print_exc()
        return 1
    ready_out.write(json.dumps(ready) + "\n")
    ready_out.flush()
    sys.stdin.read()  # hold the session until the parent has measured every worker
    del session
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
