"""Run a Python program as ``python`` itself would, and optionally write the process's memory at exit.

Standard library only, and runnable as a file (``python /path/to/plain_run.py OUT.json -- script.py
args`` or ``... OUT.json -m module args``): ``ortmem run --compare`` measures its "hook off" side
this way, a truly plain process in which neither ortmem nor onnx is imported (running a file by path
imports no package). :func:`run_program` is also how ``python -m ortmem run`` runs the program.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from types import TracebackType


def run_program(module: Optional[str], program: list[str], before: Optional[Callable[[], Any]] = None) -> int:
    """Run ``script.py args`` or ``-m module args`` in this interpreter as ``python`` itself would: the
    script's ``__file__`` absolute, ``sys.argv`` as given, ``sys.path[0]`` the script's folder or, for
    a module, the current folder (:func:`program_path`); a script it cannot open ends in python's
    one line and status 2, a module it cannot find in python's line and 1; an exception the program
    raises is printed by ``sys.excepthook`` from the program's own frames (the launcher's and
    runpy's left out: a script's traceback reads as under python) and ends in 1. ``before`` is called
    once ``sys.path`` is the program's, before anything of the program is found or run."""
    try:
        if module is not None:
            sys.argv = [module, *program]
            program_path(os.getcwd())
            if before is not None:
                before()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(program[0])
            sys.argv = list(program)
            program_path(str(Path(script).resolve().parent))  # python resolves a linked script's folder
            if before is not None:
                before()
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - reported as python reports it, below
        frames = _program_frames(exc.__traceback__)
        if frames is not None:
            sys.excepthook(type(exc), exc.with_traceback(frames), frames)  # python prints the exception's own
            return 1
        if isinstance(exc, ImportError):
            print(f"{sys.executable}: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError) and module is None:
            print(f"{sys.executable}: can't open file {script!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
            return 2
        raise
    return 0


def program_path(folder: str) -> None:
    """Make ``sys.path[0]`` what python gives the program: ``folder`` in place of the entry python gave
    this process's own main (the launcher's folder, the console script's, or the current folder), so
    the program imports what it would under plain python, and nothing from beside the launcher
    (a package named like one of the program's, in the folder the launcher was started from). Under
    ``python -P`` (safe path) python adds no folder, and neither does this."""
    if getattr(sys.flags, "safe_path", False):
        return
    if sys.path:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)


def _program_frames(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """The traceback from the program's first frame on (after runpy's ``_run_code``, which executes
    its code), or None when the exception came from runpy finding or reading the program."""
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_run_code":
            return tb.tb_next
        tb = tb.tb_next
    return None


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
    out, rest = Path(argv[0]).absolute(), argv[1:]  # where it was given, whatever folder the program moves to
    atexit.register(write_plain_report, out, time.perf_counter())
    if rest[:1] == ["-m"]:
        return run_program(rest[1], rest[2:])
    return run_program(None, rest[1:] if rest[:1] == ["--"] else rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
