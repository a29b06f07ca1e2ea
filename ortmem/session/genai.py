"""onnxruntime-genai model folders with ORT's pre-packed weights mapped from disk.

Why
---
onnxruntime-genai (``og``) creates plain ORT sessions over the ONNX files its ``genai_config.json``
names, so every process packs every MatMul/MatMulNBits weight into private heap memory again. ORT can
save those packed buffers beside the weights and map them on the next load
(:mod:`ortmem.store.finished`); genai then only needs its config to name the prepared files. Measured with
the folder ``tests/session/test_genai.py`` builds (384 MiB of fp32 MatMul weights; onnxruntime 1.32.0, genai
0.18.0; docs/genai.md): a process's private memory after a generation step fell from 409 to 45 MiB,
and 4 processes' total PSS from 1666 to 600 MiB (0.36x), with bit-identical tokens and logits.

What genai does with files (read from microsoft/onnxruntime-genai ``src/config.cpp``,
``src/models/model.cpp``, and checked against 0.18.0)
-----------------------------------------------------------------------------------------
* On Linux it loads the ``onnxruntime`` pip package's own ``libonnxruntime.so`` (``_dll_directory``
  sets ``ORT_LIB_PATH`` to it); that library is the same release and build as the Python module that
  writes the prepared files, so :func:`ortmem.store.finished.finished_key_parts` describes both.
  :func:`genai_ort_problem` checks this at run time from ``/proc/self/maps``.
* Every ``filename`` is opened as ``<folder>/<filename>`` (``Model::CreateSession``) and must be a
  relative path without ``..`` (``ValidateConfigPath``): prepared files are written beside their
  source, inside the folder.
* ``session_options`` keys genai does not know are passed to ORT as session config entries
  (``SessionOptions_Element``): the ones that change packing are handed to the preparing session.
* ``og.Config.overlay(json)`` merges a JSON fragment into the parsed config: a scalar ``filename``
  of an object (``model.decoder``, ``model.embedding``, ``model.vision``...) is replaced, but a
  ``pipeline`` fragment *appends* stages (read from the source, not exercised here). So :func:`genai_config` re-points every file that sits in
  an object, and leaves pipeline stages on the files the config names (:func:`rewrite_config`
  handles them too).
* genai verifies nothing it maps. ORT >= 1.32 re-packs each weight whose saved blob it would use and
  refuses the session when the bytes differ, but an ordinary weight of a prepared ``.data`` file (an
  embedding table, a norm) is used as read.

What ortmem checks, and when
----------------------------
:func:`genai_config` (each start): for every prepared file, :func:`ortmem.store.finished.finished_problem`
in full mode: owner, mode, no symbolic link, sizes and full digests of the prepared ``.onnx``/``.data``,
key parts equal to this ORT build and CPU, and the source file unchanged; plus the ORT library genai
has loaded. Anything failing: that file is loaded as given, one warning says why.
:func:`rewrite_config` makes the same check once, when it rewrites; afterwards every genai program
(any language) loads the prepared files with no check at all until :func:`genai_config` or
``rewrite_config`` runs again.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import onnxruntime as ort

from ortmem.base.records import record
from ortmem.base import logs
from ortmem.errors import OrtmemError
from ortmem.base.hygiene import allocator_hygiene
from ortmem.ort.settings import OrtSettings
from ortmem.ort.settings import packing_settings as ort_packing_settings
from ortmem.store.finished import FinishCheckError, FinishedReport, finish_model, finished_problem, read_manifest


GENAI_CONFIG = "genai_config.json"
#: What the backup of a rewritten ``genai_config.json`` is called (beside it; genai ignores it).
CONFIG_BACKUP = "genai_config.json.ortmem-backup"
#: Added to a source's stem: ``model.onnx`` -> ``model.ortmem-prepared.{onnx,data,json}``.
PREPARED_SUFFIX = ".ortmem-prepared"
#: ``session_options`` keys genai reads itself (``SessionOptions_Element``); every other string value
#: reaches ORT as a session config entry.
GENAI_OWN_OPTIONS = frozenset({
    "log_id", "enable_profiling", "intra_op_num_threads", "inter_op_num_threads", "log_severity_level",
    "log_verbosity_level", "enable_cpu_mem_arena", "enable_mem_pattern", "graph_optimization_level",
    "custom_ops_library", "provider_options",
})
#: Providers that run a model on the CPU execution provider (genai's ``provider_options`` names).
CPU_PROVIDERS = frozenset({"cpu"})
#: ORT's session config key that switches pre-packing off (a file genai runs so has nothing to map).
DISABLE_PREPACKING = "session.disable_prepacking"


class GenaiFolderError(OrtmemError):
    """A genai model folder ortmem cannot read (no or malformed ``genai_config.json``, no genai)."""


# ------------------------------------------------------------------------------ reading a folder
@record
class GenaiModelFile:
    """One ONNX file a genai config names.

    ``where``: the JSON path of the object holding ``filename`` (strings are keys, ints list
    positions). ``filename``: as the config names it now. ``source``: the file ortmem prepares from
    (the config's own file, or, in a rewritten config, the file the prepared one was made from).
    ``skip``: why it is not prepared (another execution provider, a path genai refuses); None: it is.
    """

    where: tuple[str | int, ...]
    filename: str
    source: str
    skip: Optional[str] = None

    @property
    def overlayable(self) -> bool:
        """``og.Config.overlay`` can replace this filename (no list on the way: lists append)."""
        return not any(isinstance(step, int) for step in self.where)

    @property
    def prepared_name(self) -> str:
        """The prepared file's name as the config would give it (relative to the folder)."""
        src = Path(self.source)
        return (src.parent / f"{src.stem}{PREPARED_SUFFIX}.onnx").as_posix()

    @property
    def stem(self) -> str:
        return f"{Path(self.source).stem}{PREPARED_SUFFIX}"


def read_config(folder: Path, name: str = GENAI_CONFIG) -> dict[str, Any]:
    """``folder/genai_config.json`` as a dict (:class:`GenaiFolderError` naming the file otherwise)."""
    path = Path(folder) / name
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise GenaiFolderError("not an onnxruntime-genai folder: no genai_config.json", file=path) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenaiFolderError(f"cannot read the genai config: {exc}", file=path) from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise GenaiFolderError("the genai config has no 'model' object", file=path)
    return data


def is_genai_folder(path: Path) -> bool:
    """``path`` is a folder with a ``genai_config.json`` (what ``ortmem prepare`` dispatches on)."""
    return Path(path).is_dir() and (Path(path) / GENAI_CONFIG).is_file()


def source_name(filename: str) -> str:
    """The source a (possibly prepared) filename stands for: a rewritten config names
    ``x.ortmem-prepared.onnx``, whose source is ``x.onnx``."""
    p = Path(filename)
    if p.suffix == ".onnx" and p.stem.endswith(PREPARED_SUFFIX):
        return (p.parent / f"{p.stem[:-len(PREPARED_SUFFIX)]}.onnx").as_posix()
    return filename


def _walk(node: Any, where: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], dict[str, Any]]]:
    """Every object under ``node`` with its JSON path, parents before children."""
    if isinstance(node, dict):
        yield where, node
        for key, value in node.items():
            yield from _walk(value, where + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, where + (i,))


def _providers(session_options: Any) -> set[str]:
    """Provider names of a genai ``session_options`` object (``provider_options: [{name: {...}}]``)."""
    names: set[str] = set()
    if isinstance(session_options, dict):
        for entry in session_options.get("provider_options") or []:
            if isinstance(entry, dict):
                names.update(str(k).lower() for k in entry)
    return names


def _effective_options(obj: dict[str, Any], decoder_options: dict[str, Any]) -> dict[str, Any]:
    """The session options genai gives the file ``obj`` names: its own, else the decoder's
    (``Model::GetSessionOptions``); an inheriting pipeline stage adds the decoder's providers."""
    own = obj.get("session_options")
    if not isinstance(own, dict):
        return decoder_options
    if obj.get("inherit_session_options"):
        merged = dict(decoder_options)
        merged.update(own)
        merged["provider_options"] = list(decoder_options.get("provider_options") or []) + list(
            own.get("provider_options") or [])
        return merged
    return own


def _path_problem(filename: str) -> Optional[str]:
    """Why genai would refuse ``filename`` (``ValidateConfigPath``: absolute or with ``..``)."""
    if filename.startswith(("/", "\\")) or (len(filename) > 1 and filename[1] == ":"):
        return "absolute path (genai refuses it)"
    if ".." in filename.replace("\\", "/").split("/"):
        return "path with '..' (genai refuses it)"
    return None


def model_files(config: dict[str, Any]) -> list[GenaiModelFile]:
    """Every ONNX file ``config`` names, with why it is skipped when it does not run on the CPU EP.

    Found by walking ``model`` for objects with a string ``filename`` ending in ``.onnx`` rather than
    by listing genai's sections (decoder, pipeline stages, embedding, vision, speech, encoder...):
    genai adds sections from release to release, and each one names its file the same way.
    """
    model = config["model"]
    decoder = model.get("decoder") if isinstance(model.get("decoder"), dict) else {}
    decoder_options = decoder.get("session_options") if isinstance(decoder.get("session_options"), dict) else {}
    found = []
    for where, obj in _walk(model, ("model",)):
        filename = obj.get("filename")
        if not isinstance(filename, str) or not filename.lower().endswith(".onnx"):
            continue
        skip = _path_problem(filename)
        options = _effective_options(obj, decoder_options)
        foreign = _providers(options) - CPU_PROVIDERS
        if skip is None and foreign and not obj.get("run_on_cpu"):
            skip = f"runs on {', '.join(sorted(foreign))}"
        if skip is None and str(options.get(DISABLE_PREPACKING, "")) == "1":
            skip = f"{DISABLE_PREPACKING}=1: ORT packs nothing"
        found.append(GenaiModelFile(where, filename, source_name(filename), skip))
    return found


def packing_settings(config: dict[str, Any], item: GenaiModelFile) -> tuple[OrtSettings, int]:
    """What ``item`` is finished at: the ``graph_optimization_level`` genai gives it, and of the keys genai
    passes to ORT as session config entries (every one it does not read itself) those this ORT build
    defines (:func:`ortmem.ort.settings.packing_settings`, the same choice as for an
    ``ortmem.InferenceSession``), with ``intra_op_num_threads``."""
    obj: Any = config
    for step in item.where:
        obj = obj[step]
    decoder = config["model"].get("decoder") or {}
    options = _effective_options(obj, decoder.get("session_options") or {})
    so = ort.SessionOptions()
    for key, value in options.items():
        if key not in GENAI_OWN_OPTIONS and isinstance(value, str):
            so.add_session_config_entry(str(key), value)
    threads = options.get("intra_op_num_threads")
    if isinstance(threads, int) and threads > 0:
        so.intra_op_num_threads = threads
    entries, threads = ort_packing_settings(so)
    return OrtSettings(_level(options.get("graph_optimization_level")), entries), threads


#: What a finished file's session options say in a rewritten config (genai 0.18 reads the level from a
#: model's ``session_options``): ORT uses the finished model as it was saved.
FINISHED_LEVEL = "ORT_DISABLE_ALL"


def _level(name: Any) -> int:
    """ORT's number for a ``graph_optimization_level`` genai reads (``"ORT_ENABLE_ALL"``...; ORT's default
    when absent or not one of ORT's names)."""
    member = ort.GraphOptimizationLevel.__members__.get(str(name)) if name is not None else None
    return int(member) if member is not None else 99


def _object_at(config: Any, where: tuple[str | int, ...]) -> Any:
    """The object at the JSON path ``where`` of ``config``, or None."""
    obj = config
    for step in where:
        try:
            obj = obj[step]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _finished_options(config: dict[str, Any], item: GenaiModelFile) -> dict[str, Any]:
    """The session options of ``item``'s object once it names its finished file: what genai gave it
    (:func:`_effective_options`, the decoder's when it has none of its own) with the level off."""
    obj: Any = config
    for step in item.where:
        obj = obj[step]
    decoder = config["model"].get("decoder") or {}
    options = dict(_effective_options(obj, decoder.get("session_options") or {}))
    options["graph_optimization_level"] = FINISHED_LEVEL
    return options


# -------------------------------------------------------------------------------- preparing
@record
class GenaiPrepareReport:
    """What :func:`prepare_genai_folder` did: per config filename, the prepared file's report, why it
    was skipped, or why its check could not run (``failed``: nothing was written for it)."""

    folder: Path
    seconds: float
    prepared: dict[str, FinishedReport]
    skipped: dict[str, str]
    failed: dict[str, str]

    def lines(self) -> list[str]:
        """One line per file, for ``ortmem prepare``'s output."""
        out = [f"{name}: {r.prepacked} pre-packed weights, {r.data_bytes / 2**20:.1f} MiB, {r.seconds:.1f} s"
               if r.useful else f"{name}: nothing prepared ({r.refusal or 'onnxruntime packs nothing'}): "
               "genai loads the source" for name, r in self.prepared.items()]
        out += [f"{name}: skipped ({why})" for name, why in self.skipped.items()]
        out += [f"{name}: not prepared: {why}" for name, why in self.failed.items()]
        return out

    def __str__(self) -> str:
        return "; ".join(self.lines()) or f"no ONNX file in {GENAI_CONFIG}"


def prepare_genai_folder(folder: Path) -> GenaiPrepareReport:
    """Write ``<source stem>.ortmem-prepared.{onnx,data,json}`` beside every ONNX file of a genai
    folder that runs on the CPU EP (:func:`ortmem.store.finished.finish_model`), inside the folder because
    genai refuses paths outside it. ``genai_config.json`` is left as it is (:func:`genai_config` or
    :func:`rewrite_config` make genai use the files). Run it where the folder will be served, as the
    user that serves it: the prepared files record the source's identity, the ORT build and the CPU.
    A file whose check cannot run (:class:`ortmem.store.finished.FinishCheckError`) gets nothing
    written and is listed in ``failed``; the other files are prepared all the same.
    """
    folder = Path(folder)
    config = read_config(folder)
    prepared: dict[str, FinishedReport] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    start = time.perf_counter()
    done: set[str] = set()
    for item in model_files(config):
        if item.skip:
            skipped[item.filename] = item.skip
            continue
        if item.source in done:  # a file two sections name is prepared once
            continue
        done.add(item.source)
        source = folder / item.source
        if not source.is_file():
            raise GenaiFolderError(f"{GENAI_CONFIG} names an ONNX file that does not exist", file=source)
        settings, threads = packing_settings(config, item)
        try:
            result = finish_model(source, source.parent, stem=item.stem, settings=settings, threads=threads)
        except FinishCheckError as exc:
            failed[item.filename] = str(exc)
            continue
        if not result.useful:  # keep the manifest only: genai loads the source, with no warning
            for suffix in (".onnx", ".data"):
                (source.parent / f"{item.stem}{suffix}").unlink(missing_ok=True)
        prepared[item.filename] = result
    return GenaiPrepareReport(folder, time.perf_counter() - start, prepared, skipped, failed)


# -------------------------------------------------------------------------------- choosing files
def genai_ort_problem() -> Optional[str]:
    """Why the ORT library onnxruntime-genai runs may not be the one that wrote the prepared files
    (the ``onnxruntime`` package's); None when it is. Call after importing ``onnxruntime_genai``.

    Linux: every ``libonnxruntime.so*`` mapped in this process must lie in ``onnxruntime/capi``.
    Elsewhere: genai's ``ORT_LIB_PATH`` when set (macOS), else the check cannot be made and passes
    (Windows genai loads ``onnxruntime.dll`` from the same package folder).
    """
    capi = Path(ort.__file__).resolve().parent / "capi"
    if sys.platform.startswith("linux"):
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
        libs = {line.split(None, 5)[5] for line in maps.splitlines()
                if len(line.split(None, 5)) == 6 and "/libonnxruntime.so" in line}
    else:
        libs = {os.environ["ORT_LIB_PATH"]} if os.environ.get("ORT_LIB_PATH") else set()
    foreign = sorted(p for p in libs if Path(p).resolve().parent != capi)
    if foreign:
        return f"onnxruntime-genai runs {foreign[0]}, not onnxruntime {ort.__version__}'s library in {capi}"
    return None


def _prepared_problem(folder: Path, item: GenaiModelFile, mode: str) -> tuple[Optional[str], Optional[str]]:
    """``(prepared filename, None)`` when the prepared file may be used, else ``(None, why not)``;
    ``(None, None)`` when the source is loaded by design (skipped, or nothing ORT packs)."""
    if item.skip:
        return None, None
    source = folder / item.source
    target = source.parent
    manifest, model = target / f"{item.stem}.json", target / f"{item.stem}.onnx"
    if not manifest.exists():
        return None, f"{item.source} is not prepared (run `ortmem prepare {folder}`)"
    if not model.exists() and not model.is_symlink():
        _, problem = read_manifest(target, item.stem)  # a manifest of another format decided by other rules
        if problem:
            return None, f"{item.source} is not prepared for this ortmem ({problem}): run `ortmem prepare {folder}`"
        return None, None  # prepared, and ORT packs nothing in it (prepare_genai_folder kept no files)
    problem = finished_problem(target, item.stem, source=source, mode=mode)
    if problem:
        return None, f"{item.prepared_name} not used: {problem}"
    return item.prepared_name, None


def choose_files(folder: Path, *, mode: str = "full",
                 ort_problem: Optional[str] = None) -> tuple[list[tuple[GenaiModelFile, str]], list[str]]:
    """For each ONNX file of the folder's config, the filename genai should load (prepared where
    valid, else the source), and why each source was kept. ``ort_problem``: keep every source."""
    folder = Path(folder)
    chosen, reasons = [], []
    for item in model_files(read_config(folder)):
        name, why = (None, ort_problem) if ort_problem else _prepared_problem(folder, item, mode)
        if why and why not in reasons and not item.skip:
            reasons.append(why)
        chosen.append((item, name or item.source))
    return chosen, reasons


def _fragment(where: tuple[str | int, ...], filename: str) -> dict[str, Any]:
    """``{"model": {"decoder": {"filename": filename}}}`` for ``where = ("model", "decoder")``."""
    fragment: dict[str, Any] = {"filename": filename}
    for step in reversed(where):
        fragment = {step: fragment}
    return fragment


def import_genai(folder: Path) -> Any:
    """The ``onnxruntime_genai`` module (an optional dependency: the ``genai`` extra)."""
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        raise GenaiFolderError(f"onnxruntime-genai is not installed (pip install 'ortmem[genai]'): {exc}",
                               file=folder) from None
    return og


def genai_config(folder: Path, *, mode: str = "full") -> Any:
    """An ``onnxruntime_genai.Config`` for ``folder`` whose files are the prepared ones wherever they
    are valid for the installed ORT and CPU and their sources are unchanged (full digests by
    default: ``mode="sampled"`` checks sampled pages only), the files as given otherwise, with one
    warning saying why. Use it as ``og.Model(genai_config(folder))``.

    Works on a rewritten folder too (:func:`rewrite_config`): a prepared file that no longer passes is
    then replaced by its source. A pipeline stage cannot be re-pointed by ``og.Config.overlay`` (it
    appends stages): it keeps the file the config names, and if that is a prepared file that fails its
    check, :class:`GenaiFolderError` is raised (restore the config with :func:`restore_config`).
    """
    og = import_genai(folder)
    folder = Path(folder)
    with allocator_hygiene():  # the checks' read buffers go back to the OS, not to a glibc arena
        chosen, reasons = choose_files(folder, mode=mode, ort_problem=genai_ort_problem())
    config = og.Config(str(folder))
    kept = []
    for item, filename in chosen:
        if filename == item.filename:
            continue
        if item.overlayable:
            fragment = _fragment(item.where, filename)
            if filename != item.source:  # the finished file: genai creates its session with optimizations off
                leaf = fragment
                for step in item.where:
                    leaf = leaf[step]
                leaf["session_options"] = {"graph_optimization_level": FINISHED_LEVEL}
            config.overlay(json.dumps(fragment))
        elif filename == item.source:
            raise GenaiFolderError(f"{item.filename} failed its check ({'; '.join(reasons)}) and is a "
                                   "pipeline stage og.Config cannot re-point: restore the config "
                                   "(ortmem.session.genai.restore_config)", file=folder / GENAI_CONFIG)
        else:
            kept.append(item.filename)
    if kept:
        reasons.append(f"pipeline stages keep their files ({', '.join(kept)}): og.Config.overlay cannot "
                       "re-point them; ortmem.session.genai.rewrite_config can")
    if reasons:
        logs.warning(__name__, "ortmem: genai folder %s: %s; those files load as given", folder, "; ".join(reasons))
    return config


def genai_model(folder: Path, *, mode: str = "full") -> Any:
    """``og.Model(genai_config(folder))`` created inside :func:`ortmem.base.hygiene.allocator_hygiene`: ORT
    >= 1.32 packs every weight once more to compare it with the mapped blob, and without hygiene glibc
    keeps those transient buffers (measured on the 384 MiB test folder: 12 MiB private per process
    after creation, 3 with it)."""
    og = import_genai(folder)
    with allocator_hygiene():
        return og.Model(genai_config(folder, mode=mode))


# -------------------------------------------------------------------------------- rewriting
def _write_atomic(path: Path, text: str, mode: int) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new file, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rewrite_config(folder: Path, *, backup: bool = True) -> list[str]:
    """Point ``folder/genai_config.json`` itself at the prepared files that pass the full check now,
    so genai programs in any language (C, C#, Java...) load them; returns the filenames switched.

    genai verifies nothing it maps: after this, no check runs on any start (a prepared ``.data``
    damaged later is used as read; ORT >= 1.32 refuses only damaged *pre-packed* blobs). Files
    that fail now are pointed back at their sources. ``backup``: the config as it was is kept in
    ``genai_config.json.ortmem-backup`` (once: a later rewrite keeps the first backup). A folder
    where either cannot be written raises :class:`GenaiFolderError` naming the file.
    """
    folder = Path(folder)
    path = folder / GENAI_CONFIG
    original = path.read_text()
    config = read_config(folder)
    try:  # the config as the user wrote it (before any rewrite): a file pointed back gets its options back
        first = json.loads((folder / CONFIG_BACKUP).read_text()) if (folder / CONFIG_BACKUP).exists() else {}
    except (OSError, ValueError):
        first = {}
    chosen, reasons = choose_files(folder, mode="full", ort_problem=None)
    switched = []
    for item, filename in chosen:
        if filename == item.filename:
            continue
        obj: Any = config
        for step in item.where:
            obj = obj[step]
        finished = _finished_options(config, item) if filename != item.source else None
        obj["filename"] = filename
        if finished is not None:
            obj["session_options"] = finished
            obj.pop("inherit_session_options", None)
            switched.append(item.filename)
        elif isinstance(obj.get("session_options"), dict) and obj["session_options"].get(
                "graph_optimization_level") == FINISHED_LEVEL:  # back to its source: the options it was given
            given = _object_at(first, item.where)
            if isinstance(given, dict) and "session_options" in given:
                obj["session_options"] = given["session_options"]
            else:
                obj.pop("session_options")
    if reasons:
        logs.warning(__name__, "ortmem: genai folder %s: %s; those files stay as given", folder, "; ".join(reasons))
    if backup and not (folder / CONFIG_BACKUP).exists():
        _write_config(folder / CONFIG_BACKUP, original, path.stat().st_mode & 0o777)
    _write_config(path, json.dumps(config, indent=4) + "\n", path.stat().st_mode & 0o777)
    return switched


def _write_config(path: Path, text: str, mode: int) -> None:
    """:func:`_write_atomic` for :func:`rewrite_config`: a folder it cannot write (read-only, full)
    is a :class:`GenaiFolderError` naming the file, the config left as it was."""
    try:
        _write_atomic(path, text, mode)
    except OSError as exc:
        raise GenaiFolderError(f"cannot rewrite the config in this folder: {exc.strerror or exc}", file=path) from exc


def restore_config(folder: Path) -> bool:
    """Put back the ``genai_config.json`` :func:`rewrite_config` saved; False when there is no backup."""
    folder = Path(folder)
    backup = folder / CONFIG_BACKUP
    if not backup.exists():
        return False
    os.replace(backup, folder / GENAI_CONFIG)
    return True
