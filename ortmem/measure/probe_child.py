"""Entry point of the measured process: ``python -m ortmem.measure.probe_child < spec.json``.

Runs exactly one strategy (or one preparation step) and writes a JSON result to
``spec["result_path"]`` (a file, not stdout, because strategies may print). Events are stamped
with ``time.monotonic()`` so the parent's sampler can align its samples with them.

Order inside the process, and why:
1. imports (numpy, onnxruntime, the ``ortmem`` package alone, the strategy's own module, memray if
   asked): the baseline, reported separately because it is the same for every strategy. Nothing of
   ortmem's session path is imported here: ``import ortmem`` loads only its exception types and
   ``ortmem.InferenceSession`` imports the session path (and onnx only for a start that loads or
   converts the model) on first use, so an ortmem strategy pays it inside its creation, as a user's first call does
   (``create_imports`` names what creation imported). The bench's own modules needed before the clock
   (``procfs``, ``strategies``) import only the standard library;
2. ``VmHWM`` reset, so the creation peak excludes the imports;
3. creation (optionally under ``memray.Tracker``), then RSS/VmHWM read at once;
4. feeds built, ``VmHWM`` reset again, first run, RSS/VmHWM read: the run's own peak;
5. output hash, memray report (after every measurement, so its parsing costs nothing measured).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _children_maxrss() -> int:
    """Largest peak RSS of any helper this process has waited for (bytes; Linux reports kB).

    It catches a helper too short-lived for the 10 ms sampler; it cannot be reset, but nothing
    has been spawned before creation starts.
    """
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def _mem(status: dict[str, int] | None) -> dict[str, int]:
    status = status or {}
    return {
        "rss": status.get("VmRSS", 0),
        "anon": status.get("RssAnon", 0) + status.get("RssShmem", 0),
        "file": status.get("RssFile", 0),
        "hwm": status.get("VmHWM", 0),
    }


def _frame(frame: tuple[str, str, int]) -> str:
    func, filename, line = frame
    if not filename or filename == "<unknown>":
        return str(func)
    return f"{func} ({os.path.basename(filename)}:{line})"


def _readable_stack(stack: list[tuple[str, str, int]], depth: int) -> list[str]:
    """Allocation site first; CPython's own C frames dropped, unresolved native frames collapsed.

    ORT's shared library is stripped, so most of its frames come back as ``<unknown>``; what is
    left to read is the allocator call at the top and the Python frames that led into ORT.
    """
    out: list[str] = []
    unknown = 0
    for i, (func, filename, line) in enumerate(stack):
        if func == "<unknown>" or not func:
            unknown += 1
            continue
        if i > 0 and filename.endswith((".c", ".h")):
            continue  # the interpreter's own machinery (ceval.c, call.c, ...) above the site
        if unknown:
            out.append(f"[{unknown} unresolved native frame{'s' if unknown > 1 else ''}]")
            unknown = 0
        out.append(_frame((func, filename, line)))
    if unknown:
        out.append(f"[{unknown} unresolved native frame{'s' if unknown > 1 else ''}]")
    return out[:depth]


def memray_report(path: str, top: int = 10, depth: int = 16) -> dict[str, Any]:
    """Heap high-water mark and its largest allocation sites, via memray's own FileReader."""
    import memray

    reader = memray.FileReader(path)
    try:
        records = sorted(
            reader.get_high_watermark_allocation_records(merge_threads=True),
            key=lambda r: r.size,
            reverse=True,
        )
        sites = []
        for rec in records[:top]:
            try:
                stack = rec.hybrid_stack_trace()
            except NotImplementedError:  # no native traces recorded
                stack = rec.stack_trace()
            sites.append(
                {
                    "bytes": int(rec.size),
                    "count": int(rec.n_allocations),
                    "allocator": memray.AllocatorType(rec.allocator).name,
                    "stack": _readable_stack(stack, depth),
                }
            )
        # Allocations still alive when tracking stopped (right after creation): memory in use.
        # Direct mmap calls are kept apart: memray counts a mapped file at its full length whether
        # or not its pages are resident, so only the heap part is comparable with RssAnon.
        in_use_heap = in_use_mmap = 0
        for rec in reader.get_leaked_allocation_records(merge_threads=True):
            if memray.AllocatorType(rec.allocator).name == "MMAP":
                in_use_mmap += int(rec.size)
            else:
                in_use_heap += int(rec.size)
        meta = reader.metadata
        return {
            "in_use_heap_bytes": in_use_heap,
            "in_use_mmap_bytes": in_use_mmap,
            "peak_bytes": int(meta.peak_memory),
            "total_allocations": int(meta.total_allocations),
            "native_traces": bool(meta.has_native_traces),
            "top": sites,
        }
    finally:
        reader.close()


def run_probe(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy  # noqa: F401  (part of the baseline on purpose)
    import onnxruntime  # noqa: F401

    import ortmem  # noqa: F401  (what every program imports; its session path is imported by the first call)
    from ortmem.base import procfs
    from ortmem.measure.strategies import resolve

    create = resolve(spec["create"])
    options = spec.get("options") or {}
    memray_path = spec.get("memray_path")
    if memray_path:
        import memray

    events: dict[str, float] = {}
    modules_before = set(sys.modules)  # before the baseline: this set is then part of it
    baseline = _mem(procfs.read_status("self"))
    hwm_reset = procfs.reset_hwm()
    events["imports_done"] = time.monotonic()

    cpu0, ccpu0 = time.process_time(), _children_cpu()
    events["create_start"] = t0 = time.monotonic()
    if memray_path:
        with memray.Tracker(memray_path, native_traces=True):
            session = create(spec["model"], options)
    else:
        session = create(spec["model"], options)
    events["create_end"] = t1 = time.monotonic()
    create_imports = imported_packages(set(sys.modules) - modules_before)
    create_cpu = (time.process_time() - cpu0) + (_children_cpu() - ccpu0)
    after_create = _mem(procfs.read_status("self"))
    after_create["children_maxrss"] = _children_maxrss()
    from ortmem.ort.feeds import describe_outputs, hash_outputs, make_inputs

    result: dict[str, Any] = {
        "pid": os.getpid(),
        "hwm_reset": hwm_reset,
        "baseline": baseline,
        "after_create": after_create,
        "create_wall_s": t1 - t0,
        "create_cpu_s": create_cpu,
        "create_imports": create_imports,
        # what an ortmem session gave ORT ("finished", "cache-hit", "as-is", ...): a warm strategy's
        # start that missed its entry shows here instead of passing for a warm one
        "ortmem_action": getattr(session, "ortmem_action", None),
    }
    if spec.get("run", True):
        feeds = make_inputs(session, options)
        names = [o.name for o in session.get_outputs()]
        procfs.reset_hwm()
        cpu0, ccpu0 = time.process_time(), _children_cpu()
        events["run_start"] = t2 = time.monotonic()
        outputs = session.run(None, feeds)
        events["run_end"] = t3 = time.monotonic()
        result["run_cpu_s"] = (time.process_time() - cpu0) + (_children_cpu() - ccpu0)
        result["run_wall_s"] = t3 - t2
        result["after_run"] = _mem(procfs.read_status("self"))
        result["after_run"]["children_maxrss"] = _children_maxrss()
        result["output_hash"] = hash_outputs(names, outputs)
        result["outputs"] = describe_outputs(names, outputs)
    result["events"] = events
    if memray_path:
        result["memray"] = memray_report(memray_path, top=int(spec.get("memray_top", 10)))
    _wait_for_background(result)
    return result


def imported_packages(names: set[str]) -> list[str]:
    """Module names grouped to what a reader recognises: ``ortmem.<folder>`` for ortmem's own (which of
    its layers a strategy loaded), the top-level package for everything else (``onnx``, ``google``)."""
    out = {".".join(n.split(".")[:2]) if n.startswith("ortmem.") else n.split(".")[0] for n in names}
    return sorted(out)


def _wait_for_background(result: dict[str, Any]) -> None:
    """A cold start packs ORT's weights in a background process after its first run
    (``ortmem.store.finisher``): wait for it here, after every measured phase, so it neither runs into
    the next probe nor goes unreported (its time from the end of the run; the parent's sampler
    sees its memory)."""
    later = sys.modules.get("ortmem.store.finisher")
    pids = later.started_finishers() if later is not None else []
    if not pids:
        return
    later.wait_background()
    result["background_pids"] = pids
    result["background_wall_s"] = time.monotonic() - result["events"].get("run_end", result["events"]["create_end"])


def run_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    from ortmem.measure.strategies import resolve

    prepare = resolve(spec["prepare"])
    t0 = time.monotonic()
    prepared = prepare(spec["model"], spec.get("options") or {}, spec["workdir"])
    return {"prepared_model": os.fspath(prepared), "wall_s": time.monotonic() - t0}


def main() -> int:
    spec = json.loads(sys.stdin.read())
    # Shift the heap layout by a chosen amount before anything else allocates (see
    # ``probe(heap_jitter=...)``): kept alive for the whole process, so it is part of the baseline.
    heap_pad = bytearray(int(spec.get("heap_jitter", 0)))  # noqa: F841
    # The parent's extra import paths (user strategies, test folders) go *after* the child's own, so a
    # package that rewrote the parent's path (Ray prepends its vendored psutil) cannot change what the
    # measured process imports.
    for p in spec.get("sys_path") or []:
        if p not in sys.path:
            sys.path.append(p)
    try:
        result = run_prepare(spec) if spec.get("mode") == "prepare" else run_probe(spec)
    except BaseException:  # report everything, including SystemExit from a strategy
        import traceback

        traceback.print_exc()
        return 1
    tmp = spec["result_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["result_path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
