"""Run a Python program as ``python`` itself would, and optionally write the process's memory at exit.

Standard library only, and runnable as a file (``python /path/to/plain_run.py OUT.json -- script.py
args`` or ``... OUT.json -m module args``): ``ortmem run --compare`` measures its "hook off" side
this way, a truly plain process in which neither ortmem nor onnx is imported (running a file by path
imports no package). :func:`run_program` is also how ``python -m ortmem run`` runs the program.
"""
from __future__ import annotations

import atexit
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Optional


def run_program(module: Optional[str], program: list[str]) -> int:
    """Run ``script.py args`` or ``-m module args`` in this interpreter as ``python`` itself would."""
    try:
        if module is not None:
            sys.argv = [module, *program]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = program[0]
            sys.argv = list(program)
            sys.path.insert(0, str(Path(script).resolve().parent))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def process_memory() -> dict[str, float]:
    """This process's peak (VmHWM), private (RssAnon + RssShmem) and file-backed resident memory, MiB,
    read from ``/proc/self/status`` (zeros where it is unreadable)."""
    kib: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmHWM", "RssAnon", "RssShmem", "RssFile"):
                    kib[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return {"peak_mib": round(kib.get("VmHWM", 0) / 1024, 1),
            "rss_anon_mib": round((kib.get("RssAnon", 0) + kib.get("RssShmem", 0)) / 1024, 1),
            "rss_file_mib": round(kib.get("RssFile", 0) / 1024, 1)}


def write_plain_report(path: Path, started: float) -> None:
    """The report ``ortmem run --report`` writes, for a plain process: no sessions recorded (recording
    them would need the hook's machinery, which is what this run leaves out)."""
    import json

    ort = sys.modules.get("onnxruntime")
    data: dict[str, Any] = {
        "onnxruntime": getattr(ort, "__version__", "not imported"),
        "hook": False,
        "options": {},
        "process": {"wall_seconds": round(time.perf_counter() - started, 3), **process_memory()},
        "sessions": [],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str]) -> int:
    """``OUT.json -- script.py args`` or ``OUT.json -m module args``."""
    out, rest = Path(argv[0]), argv[1:]
    atexit.register(write_plain_report, out, time.perf_counter())
    if rest[:1] == ["-m"]:
        return run_program(rest[1], rest[2:])
    return run_program(None, rest[1:] if rest[:1] == ["--"] else rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
