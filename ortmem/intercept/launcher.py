"""``python -m ortmem run``: run an unmodified Python program with :func:`ortmem.hook` installed as it imports onnxruntime.

``python -m ortmem run [options] -- script.py args...`` or ``python -m ortmem run [options] -m pkg.mod
args...``: the program runs as ``python script.py`` / ``python -m pkg.mod`` would run it (``sys.argv``,
``__main__``, exit status), and the hook is installed as its ``import onnxruntime`` completes, before
any module can bind ORT's class. A program that never imports onnxruntime imports neither it nor
the hook.

Child interpreters (``multiprocessing`` spawn, a process manager starting workers, ``subprocess``
running Python) get the hook too: the launcher puts ``$ORTMEM_HOOK=1``, the options in
``$ORTMEM_HOOK_OPTIONS`` and the folder of :mod:`ortmem.intercept.site`'s ``sitecustomize.py`` on
``$PYTHONPATH``, and that file installs the hook in every interpreter that starts with them (and then
runs the ``sitecustomize`` it shadows). ``$ORTMEM_HOOK=0`` makes the launcher run the program plain.

``--report out.json`` writes, at exit, every session created (see ``ortmem.hook.sessions``) and the
process's memory (a relative path is taken from the folder the launcher started in, wherever the
program moves to); ``--compare`` runs the program twice in fresh processes, truly plain (no ortmem, no
onnx imported: :mod:`ortmem.intercept.plain_run`) then hooked, and prints the difference in peak, private memory
and wall time.

The program imports what plain python would give it (:mod:`ortmem.intercept.own_package`): a program
whose folder holds its own ``ortmem`` gets that one, and the hook keeps using this one. Where this
process's ``ortmem`` is not this installed package (a folder named ``ortmem`` in the current folder
shadows it), the hook is not installed: the program runs with plain onnxruntime sessions and one
line on stderr that names the folder.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ortmem.intercept import plain_run
from ortmem.base.child_env import ENV_OPTIONS, ENV_SWITCH, SITE_DIR, helper_environment
from ortmem.intercept.hook_options import HookOptions
from ortmem.intercept.site.sitecustomize import after_onnxruntime
from ortmem.intercept.own_package import OWN_MODULES, leave_to_program, problem
from ortmem.intercept.plain_run import process_memory, run_program

if TYPE_CHECKING:  # the parser is built only where options are given (ortmem.cli.main)
    import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    import argparse

    p.description = ("Run an unmodified Python program with every ONNX Runtime session it creates going "
                     "through ortmem: ortmem run [options] -- script.py args, or ortmem run [options] -m module args.")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a library module as a script (as python -m)")
    p.add_argument("--no-convert", action="store_true", help="do not rewrite DQ+MatMul into MatMulNBits")
    p.add_argument("--no-cache", action="store_true", help="convert in memory; write nothing to the cache")
    p.add_argument("--cache-dir", default=None, help="cache folder (default $ORTMEM_CACHE_DIR or the user cache)")
    p.add_argument("--no-trim", action="store_true", help="leave glibc's allocator settings alone")
    p.add_argument("--no-prepacked", action="store_true", help="do not save or load pre-packed weights")
    p.add_argument("--strict", action="store_true",
                   help="let ortmem's own errors propagate instead of falling back to plain onnxruntime")
    p.add_argument("--no-children", action="store_true", help="do not hook child Python processes")
    p.add_argument("--report", metavar="OUT.json", default=None,
                   help="write every session created (model, providers, what ortmem did, time, memory) at exit")
    p.add_argument("--compare", action="store_true",
                   help="run the program in fresh processes, truly plain then hooked, and print the difference")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="--compare: run each side N times, interleaved, and print medians")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- script.py args... (or the module's args after -m)")


def options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`ortmem.hook` keyword arguments the command line asks for (JSON-serialisable)."""
    cache: Any = False if args.no_cache else (args.cache_dir or True)
    return {"convert": not args.no_convert, "cache": cache, "trim": not args.no_trim,
            "prepacked": not args.no_prepacked, "strict": args.strict}


def default_options() -> dict[str, Any]:
    """What :func:`options_from` gives for a command line without options: :class:`HookOptions`' defaults."""
    return {name: value for name, value in HookOptions()._asdict().items() if name != "observe_only"}


def bare_program(argv: Sequence[str]) -> Optional[list[str]]:
    """The program of ``ortmem run -- script.py args`` or ``ortmem run script.py args``: ``argv`` after
    ``run`` when it gives no option, so argparse would parse every option's default and take the rest
    as the program; ``None`` when it starts with an option (``-m`` included).

    Why: this is how a hooked program is started, and argparse's import, parser and message-catalogue
    probes cost 5-6 ms of a start whose cost over a plain run is held to 20 ms (docs/hook.md)."""
    if not argv or (argv[0].startswith("-") and argv[0] != "--"):
        return None
    return list(argv[1:] if argv[0] == "--" else argv)


def main(args: argparse.Namespace) -> int:
    """``ortmem run`` with its options parsed."""
    program = list(args.program)
    if args.module is None and program[:1] == ["--"]:
        program = program[1:]
    if args.compare and not _no_program(args.module, program):
        return compare(args, program)
    return start(args.module, program, options_from(args), children=not args.no_children, report=args.report)


def start(module: Optional[str], program: list[str], options: Optional[dict[str, Any]] = None,
          children: bool = True, report: Optional[str] = None) -> int:
    """Install the hook with ``options`` (:class:`HookOptions`' defaults if none), in child interpreters
    too unless ``children`` is false, then run ``-m module program`` or ``program`` (a script and its
    arguments); at exit write ``report`` if given."""
    if _no_program(module, program):
        return 2
    if options is None:
        options = default_options()
    hooked = os.environ.get(ENV_SWITCH, "1") != "0"
    if hooked or report:  # hook off with a report: plain ORT sessions, recorded for it
        after_onnxruntime(lambda: _install_hook(options if hooked else {"observe_only": True}))
    if hooked and children:
        _export_to_children(options)
    if report:  # relative to where the user gave it: the program may change folder before exit
        atexit.register(write_report, Path(report).absolute(), hooked, options, time.perf_counter())
    return run_program(module, program, before=leave_to_program)


def _install_hook(options: dict[str, Any]) -> Optional[str]:
    """Called as the program's ``import onnxruntime`` completes (:func:`after_onnxruntime`): the hook
    and onnxruntime are imported with the program's first use of ORT, so a program that never uses
    it (a server's master process, a script that starts workers) pays for neither, as in a plain run.
    Returns why the hook was not installed (this process's ``ortmem`` is not this package), if so."""
    with OWN_MODULES:
        why = problem()
        if why is not None:
            return why
        from ortmem.intercept.session_hook import hook

        hook(**options, rebind=False)  # onnxruntime was imported just now: no module holds its class yet
    return None


def _no_program(module: Optional[str], program: list[str]) -> bool:
    """True, with the usage printed, when there is nothing to run."""
    if module is None and not program:
        print("ortmem run: give a program: ortmem run [options] -- script.py args, or -m module args", file=sys.stderr)
        return True
    return False


def _export_to_children(options: dict[str, Any]) -> None:
    """Hook child interpreters with these options. Only options that differ from the defaults are
    written (as JSON), so a default run, and each of its children, never imports json for them."""
    os.environ[ENV_SWITCH] = "1"
    defaults = HookOptions()
    changed = {name: value for name, value in options.items() if getattr(defaults, name) != value}
    if changed:
        import json

        os.environ[ENV_OPTIONS] = json.dumps(changed)
    else:
        os.environ.pop(ENV_OPTIONS, None)  # one a parent set must not reach these children
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SITE_DIR) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *paths])


def write_report(path: Path, hooked: bool, options: dict[str, Any], started: float) -> None:
    """The sessions this process created and its memory, as JSON (called at exit). No session where
    the hook was never installed (the program never imported onnxruntime, or this process's
    ``ortmem`` is not this package: ``hook`` is false then, and ``hook_problem`` says why)."""
    import json

    ort = sys.modules.get("onnxruntime")
    sessions: list[dict[str, Any]] = []
    with OWN_MODULES:
        why = problem()
        recorder = sys.modules.get("ortmem.intercept.session_hook")  # imported by the hook's installation
        if recorder is not None:
            sessions = recorder.report()
    data = {
        "onnxruntime": getattr(ort, "__version__", "not imported"),
        "hook": hooked and why is None,
        "hook_problem": why,
        "options": options,
        "process": {"wall_seconds": round(time.perf_counter() - started, 3), **process_memory()},
        "sessions": sessions,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def compare(args: argparse.Namespace, program: list[str]) -> int:
    """Run the program plain, then hooked, each in a fresh process (``--repeat`` times, interleaved,
    each after ``sync``); print the medians side by side.

    The plain side is a truly plain process: ``python plain_run.py`` runs the program with nothing of
    ortmem or onnx imported (the file is run by path, the standard library only), in the environment
    of ortmem's helpers (no hook exported to it), and writes its memory at exit. Run under the launcher
    with the hook off instead, it would carry ortmem's imports and so understate what the hook costs
    against a plain run. Its sessions are not recorded: recording them takes the hook's machinery."""
    import json  # --compare's own modules: a hooked run imports none of them
    import subprocess
    import tempfile

    from ortmem.base.bytecode import ensure_bytecode

    print(f"ortmem run --compare: {ensure_bytecode()}", file=sys.stderr)  # as an installed ortmem has it
    on_cmd = [sys.executable, "-m", "ortmem", "run", *_option_flags(args)]
    off_cmd = [sys.executable, plain_run.__file__]
    target = ["-m", args.module, *program] if args.module else ["--", *program]
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="ortmem-compare-") as tmp:
        for i in range(max(1, args.repeat)):
            for label in ("off", "on"):
                out = Path(tmp) / f"{label}-{i}.json"
                cmd = [*off_cmd, str(out), *target] if label == "off" else [*on_cmd, "--report", str(out), *target]
                env = helper_environment() if label == "off" else {**os.environ, ENV_SWITCH: "1"}
                os.sync()  # each side starts with nothing the other wrote still to flush
                start = time.perf_counter()
                code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode
                wall = time.perf_counter() - start
                if code != 0 or not out.exists():
                    print(f"ortmem run --compare: the program exited with {code} with the hook {label}", file=sys.stderr)
                    return code or 1
                result = json.loads(out.read_text())
                result["process"]["wall_seconds"] = round(wall, 3)  # interpreter start included
                runs[label].append(result)
    off, on = _median_run(runs["off"]), _median_run(runs["on"])
    print(render_comparison(off, on, len(runs["on"])))
    if args.report:
        Path(args.report).write_text(json.dumps(runs, indent=2) + "\n")
    return 0


def _median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's sessions with every process figure and creation time replaced by the median."""
    import copy
    import statistics

    merged = copy.deepcopy(results[0])
    merged["spread"] = {}
    for key in merged["process"]:
        values = [r["process"][key] for r in results]
        merged["process"][key] = statistics.median(values)
        merged["spread"][key] = [min(values), max(values)]
    for i, s in enumerate(merged["sessions"]):
        s["create_seconds"] = statistics.median(r["sessions"][i]["create_seconds"] for r in results
                                                if i < len(r["sessions"]))
    return merged


def _option_flags(args: argparse.Namespace) -> list[str]:
    flags = [f"--{name.replace('_', '-')}" for name in ("no_convert", "no_cache", "no_trim", "no_prepacked", "strict")
             if getattr(args, name)]
    return flags + (["--cache-dir", args.cache_dir] if args.cache_dir else [])


def render_comparison(off: dict[str, Any], on: dict[str, Any], repeats: int = 1) -> str:
    """A small table: the program's process without and with the hook, and the ratio. The "sessions
    created" rows are read right after the program's last session was created (before it ran much),
    the "exit" rows when it ended."""
    def at_last_session(run: dict[str, Any], key: str) -> float:
        return run["sessions"][-1][key] if run["sessions"] else float("nan")

    rows = [
        ("peak RSS (VmHWM) at exit, MiB", off["process"]["peak_mib"], on["process"]["peak_mib"]),
        ("private (RssAnon) at exit, MiB", off["process"]["rss_anon_mib"], on["process"]["rss_anon_mib"]),
        ("file-backed (RssFile) at exit, MiB", off["process"]["rss_file_mib"], on["process"]["rss_file_mib"]),
        ("peak RSS when sessions created, MiB", at_last_session(off, "peak_mib"), at_last_session(on, "peak_mib")),
        ("private when sessions created, MiB", at_last_session(off, "rss_anon_mib"), at_last_session(on, "rss_anon_mib")),
        ("session creation (sum), s", sum(s["create_seconds"] for s in off["sessions"]),
         sum(s["create_seconds"] for s in on["sessions"])),
        ("wall time, s", off["process"]["wall_seconds"], on["process"]["wall_seconds"]),
    ]
    if repeats > 1:  # the fastest too: one run's wall is noisy, and the noise only ever adds
        rows.append(("wall time, fastest, s", off["spread"]["wall_seconds"][0], on["spread"]["wall_seconds"][0]))
    lines = [f"onnxruntime {on['onnxruntime']}; {len(on['sessions'])} session(s); "
             f"median of {repeats} fresh process(es) each",
             f"{'':38} {'hook off':>10} {'hook on':>10} {'on/off':>7}"]
    for label, a, b in rows:
        lines.append(f"{label:38} {a:10.3f} {b:10.3f} {b / a if a else float('nan'):7.2f}")
    if repeats > 1:
        lines.append("spread (min-max) at exit: " + "; ".join(
            f"{key} off {off['spread'][key][0]}-{off['spread'][key][1]}, on {on['spread'][key][0]}-{on['spread'][key][1]}"
            for key in ("peak_mib", "rss_anon_mib")))
    for i, s in enumerate(on["sessions"]):
        before = off["sessions"][i]["create_seconds"] if i < len(off["sessions"]) else float("nan")
        lines.append(f"  {s['action']:10} {before:7.3f} -> {s['create_seconds']:7.3f} s  {s['model']}")
    return "\n".join(lines)
