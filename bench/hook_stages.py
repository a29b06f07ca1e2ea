"""Where a hooked program's extra time goes, stage by stage, measured inside fresh processes.

    python -m bench.hook_stages tests/hook_clients/silero_client.py [--repeat 10]

``ortmem run --compare`` gives the whole-process difference, which on a shared 2-core machine moves by tens
of milliseconds between runs. This splits what the hooked side does into the stages
``python -m ortmem run -- CLIENT`` goes through, each timed with ``perf_counter`` in the same process,
after numpy and onnxruntime are imported (the client imports them either way):

- ``cli``: ``import ortmem.cli`` (the package; argparse is imported only where options are given);
- ``launcher``: importing the launcher and the hook (``session_hook``, ``scan``, ``hygiene``;
  ``ortmem run -- CLIENT`` gives no option, so no argparse);
- ``hook``: installing it as the launcher does (no rebinding: the program has imported nothing yet);
- ``client``: running the client, plain in the plain process; in the hooked one it includes
  ``facts_of`` (a handoff record's read, or the walk of the model's non-weight bytes, shown as
  ``walk``, and the record written; :mod:`ortmem.store.handoff_records`) and ``trim`` (``malloc_trim`` after each
  creation), also shown on their own.

``--wall`` times whole processes instead, alternated per round (the order rotated) with ``sync``
before each and stdout discarded: ``python CLIENT`` (plain), ``ORTMEM_HOOK=0 python -m ortmem run --
CLIENT`` (the launcher alone) and ``python -m ortmem run -- CLIENT`` (hooked), each with its fastest,
first quartile and median. Unlike ``ortmem run --compare``, no side writes a report, so the three differ only in the
launcher and the hook.

The fastest of ``--repeat`` processes per stage is printed (noise on a shared machine only ever adds), with
the client's plain and hooked times side by side. ortmem's bytecode is brought up to date first, as
an installed ortmem has it (:func:`ortmem.base.bytecode.ensure_bytecode`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CHILD = r"""
import json, runpy, sys, time
hooked, client = sys.argv[1] == "hooked", sys.argv[2]
import numpy, onnxruntime
times, start = {}, time.perf_counter()
def mark(name):
    global start
    now = time.perf_counter()
    times[name] = times.get(name, 0.0) + now - start
    start = now
def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - t
    return wrapper
if hooked:
    import ortmem.cli
    mark("cli")
    from ortmem.intercept import launcher, session_hook
    mark("launcher")
    from ortmem.store import handoff_records  # imported by the hook with its first model: timed here
    handoff_records.facts_of = timed("  facts_of", handoff_records.facts_of)
    handoff_records.read_facts = timed("    walk", handoff_records.read_facts)
    session_hook.trim_heap = timed("  trim", session_hook.trim_heap)
    session_hook.hook(**launcher.default_options(), rebind=False)
    mark("hook")
sys.argv = [client]
runpy.run_path(client, run_name="__main__")
mark("client")
print(json.dumps(times), file=sys.stderr)
"""


def measure(client: str, repeat: int) -> dict[str, dict[str, float]]:
    """Per side, the fastest seconds of each stage over ``repeat`` fresh processes, sides alternated."""
    fastest: dict[str, dict[str, float]] = {"plain": {}, "hooked": {}}
    for _ in range(repeat):
        for side in ("plain", "hooked"):
            done = subprocess.run([sys.executable, "-c", _CHILD, side, client], capture_output=True, text=True,
                                  check=True)
            times = json.loads(done.stderr.strip().splitlines()[-1])
            for stage, seconds in times.items():
                fastest[side][stage] = min(seconds, fastest[side].get(stage, seconds))
    return fastest


def measure_wall(client: str, repeat: int) -> dict[str, list[float]]:
    """``--wall``: seconds per whole process of each command, ``repeat`` rounds, the order rotated
    per round so that no command always runs right after the same other."""
    py = sys.executable
    commands = {"plain": ([py, client], {}),
                "launcher, hook off": ([py, "-m", "ortmem", "run", "--", client], {"ORTMEM_HOOK": "0"}),
                "launcher, hooked": ([py, "-m", "ortmem", "run", "--", client], {})}
    times: dict[str, list[float]] = {name: [] for name in commands}
    order = list(commands.items())
    for round_ in range(repeat):
        shift = round_ % len(order)
        for name, (cmd, env) in order[shift:] + order[:shift]:
            os.sync()
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env})
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("client", help="a Python program that creates ORT sessions (e.g. tests/hook_clients/*.py)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--wall", action="store_true", help="whole processes: plain, the launcher alone, hooked")
    args = p.parse_args(argv)
    from ortmem.base.bytecode import ensure_bytecode

    print(ensure_bytecode(), file=sys.stderr)
    import onnxruntime

    if args.wall:
        times = measure_wall(args.client, max(1, args.repeat))
        print(f"onnxruntime {onnxruntime.__version__}; {args.repeat} rounds, ms: fastest, first quartile, median")
        for name, values in times.items():
            values.sort()
            print(f"{name:20} {values[0] * 1e3:7.0f} {values[len(values) // 4] * 1e3:7.0f} "
                  f"{statistics.median(values) * 1e3:7.0f}")
        return 0
    fastest = measure(args.client, max(1, args.repeat))
    print(f"onnxruntime {onnxruntime.__version__}; fastest of {args.repeat} fresh processes per side, ms")
    for stage, seconds in fastest["hooked"].items():
        plain = fastest["plain"].get(stage)
        extra = f"  (plain {plain * 1e3:.1f}, +{(seconds - plain) * 1e3:.1f})" if plain is not None else ""
        print(f"{stage:18} {seconds * 1e3:7.1f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
