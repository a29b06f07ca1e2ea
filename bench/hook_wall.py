"""A hooked program's wall time against the same program run plain, as whole processes, alternated.

    python -m bench.hook_wall tests/hook_clients/rapidocr_client.py --repeat 12

Three commands per round, ``sync`` before each, stdout discarded: ``python CLIENT`` (plain),
``ORTMEM_HOOK=0 python -m ortmem run -- CLIENT`` (the launcher with the hook off: what the launcher
alone costs) and ``python -m ortmem run -- CLIENT`` (hooked). Prints the fastest, first quartile and
median of each. Unlike ``ortmem run --compare`` no side writes a report, so the three differ only in
the launcher and the hook. ortmem's bytecode is brought up to date first, as an installed ortmem has it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def measure(client: str, repeat: int) -> dict[str, list[float]]:
    """Seconds per command, ``repeat`` rounds alternated."""
    py = sys.executable
    commands = {"plain": ([py, client], {}),
                "launcher, hook off": ([py, "-m", "ortmem", "run", "--", client], {"ORTMEM_HOOK": "0"}),
                "launcher, hooked": ([py, "-m", "ortmem", "run", "--", client], {})}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, (cmd, env) in commands.items():
            os.sync()
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env})
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("client", help="a Python program that creates ORT sessions (e.g. tests/hook_clients/*.py)")
    p.add_argument("--repeat", type=int, default=12)
    args = p.parse_args(argv)
    from ortmem.bytecode import ensure_bytecode

    print(ensure_bytecode(), file=sys.stderr)
    import onnxruntime

    times = measure(args.client, max(1, args.repeat))
    print(f"onnxruntime {onnxruntime.__version__}; {args.repeat} rounds, ms: fastest, first quartile, median")
    for name, values in times.items():
        values.sort()
        print(f"{name:20} {values[0] * 1e3:7.0f} {values[len(values) // 4] * 1e3:7.0f} "
              f"{statistics.median(values) * 1e3:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
