"""What a model file needs from ortmem, decided from its bytes alone (no onnx, no passes, no loader).

Why a module of its own: importing onnx, ortmem's passes and the loader, and the session path
itself, costs a process private memory and time (``python -m bench.estimator.fixed_costs``;
docs/estimator.md), more than ortmem saves on a model it leaves to ORT. So the hook asks this module first and imports the session path only for a model that
needs it, and the session path asks it before it loads a model (:mod:`ortmem.session.decide`). Everything here
uses the standard library and :mod:`ortmem.onnxfile.protowire` (a wire-format reader that needs no onnx,
imported by the first walk):

- conversion candidates: a ``DequantizeLinear`` op_type is a plain string in the file's non-weight
  bytes (a byte search: a name containing it is a false positive, which only sends the model the
  heavy way, where the passes decide exactly);
- a model written by ``ortmem recompute`` carries ``ortmem.recompute.*`` metadata keys (same search);
- embedded ``raw_data`` above :data:`INLINE_MAX_BYTES`: protowire's walk finds it and writes the
  skeleton bytes that point back into the file, and :func:`link_skeleton` hands that skeleton to ORT
  beside a hard link to the file, exactly as :mod:`ortmem.session` does for a loaded model.

It sits at the bottom of the package beside :mod:`ortmem.onnxfile.protowire`: the loader, the handoff, the
session and the store read their constants here (the inline limit, the folder key, the recompute
metadata prefix, the finished-entry threshold), so each of them points down to it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ortmem.base.records import record
from ortmem.onnxfile import DEQUANTIZE
from ortmem.errors import CorruptModelError
from ortmem.base.logs import warning


#: Tensors up to one page stay inline in the skeleton: ORT maps every external tensor separately,
#: and a mapping costs at least a whole resident page plus kernel bookkeeping, more than ORT's
#: copy of a small tensor (measured: 3000 1 KiB biases cost ORT +34 MiB as external data and
#: +27 MiB embedded). onnx's own external-data threshold (1 KiB) is tuned for file size, not memory.
INLINE_MAX_BYTES = 4096
#: The session config key naming where a bytes-loaded model's external files are.
FOLDER_KEY = "session.model_external_initializers_file_folder_path"

#: Metadata prefix of a model rewritten by ``ortmem recompute`` (the planner's ``META_PREFIX`` is this one).
RECOMPUTE_METADATA = "ortmem.recompute."
#: The key of a tensor's ``external_data`` entry naming its file (StringStringEntryProto field 1,
#: 8 bytes, "location"): every tensor with external data has one.
EXTERNAL_LOCATION = b"\x0a\x08location"
#: Bytes read per ``pread`` by the search: the search never holds more of the file than this.
SEARCH_CHUNK = 1 << 20
#: The largest file whose walk :func:`read_facts` stops at the first weight outside the main graph
#: (then searching the whole file, whose cost grows with the file's size: below this size a stopped
#: walk plus the search is quicker than the whole walk, above it slower).
STOPPED_SEARCH_MAX_BYTES = 4 << 20

#: Initializer bytes below which a model gets no finished entry and no background process (overridden
#: by :data:`MIN_BYTES_ENV`). What a process saves is about the bytes ORT packs (for fp32 MatMul, its
#: weight bytes); what finishing costs once is the helper process (a second of CPU and tens of MiB
#: just to start Python, onnxruntime and onnx) and a second copy of the weights on disk. From 16 MiB
#: a single worker's lifelong saving is of the order of the helper's one-time transient.
MIN_FINISHED_BYTES = 16 * 1024 * 1024
#: Environment variable overriding :data:`MIN_FINISHED_BYTES` (bytes; "0": every model).
MIN_BYTES_ENV = "ORTMEM_PREPARE_MIN_BYTES"


#: A cold start converts in a helper process (:mod:`ortmem.session.cold_start_child`) when the
#: model's files (:func:`model_files_bytes`) reach this size. The helper keeps onnx's import and the
#: conversion's heap out of the session's process (15-17 MiB of its peak, 1.016x -> 1.002x the twin's
#: on the 0.6 GB synthetic Llama) but starts an interpreter with numpy, onnxruntime and onnx (0.30 s
#: against 0.13 s for the same imports in the session's process): below this size that start would be
#: a large share of the whole cold start, and the model's own memory a small one.
MIN_HELPER_BYTES = 256 * 1024 * 1024
#: Environment variable overriding :data:`MIN_HELPER_BYTES` (bytes; "0": every model it converts).
HELPER_MIN_BYTES_ENV = "ORTMEM_CONVERT_HELPER_MIN_BYTES"


def min_finished_bytes() -> int:
    """``$ORTMEM_PREPARE_MIN_BYTES`` (an unreadable value is logged and ignored), else the default."""
    return _size_setting(MIN_BYTES_ENV, MIN_FINISHED_BYTES)


def min_helper_bytes() -> int:
    """``$ORTMEM_CONVERT_HELPER_MIN_BYTES`` (an unreadable value is logged and ignored), else the default."""
    return _size_setting(HELPER_MIN_BYTES_ENV, MIN_HELPER_BYTES)


def _size_setting(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    from ortmem.base.units import parse_bytes

    try:
        return int(parse_bytes(text))
    except (ValueError, TypeError):
        warning(__name__, "ortmem: %s=%r is not a size; using %d bytes", name, text, default)
        return default


def model_files_bytes(path: Path) -> int:
    """The size of a model file and of the files beside it named after it (``model.onnx.data``,
    ``model.onnx_data``, ``model.data``: where onnx, Optimum and onnxruntime-genai's builder put
    external data), read from the folder without parsing the model: what a start weighs before it
    decides how to convert. Other files of the folder are not counted."""
    stem = path.name.split(".")[0]
    total = 0
    try:
        for entry in os.scandir(path.parent):
            if entry.name.startswith(stem) and entry.is_file():
                total += entry.stat().st_size
    except OSError:
        return 0
    return total


@record
class FileFacts:
    """What the walk and the search found in one model file (a named tuple, not a dataclass: the
    hook imports this module into every hooked process, where dataclasses cost start time)."""

    #: The rewritten ModelProto with every embedded raw_data above INLINE_MAX_BYTES made external
    #: (pointing back into the file), or None when there was none.
    skeleton: Optional[bytes]
    embedded_bytes: int
    #: External references the walk could not confirm, or inline tensors its screen could not: the
    #: loader checks those (and names the tensor at fault), so such a model goes the loader's way.
    #: Confirmed references (:mod:`ortmem.onnxfile.references`) leave only :attr:`external_ends`
    #: to check at each start.
    needs_loader: bool
    #: A DequantizeLinear ortmem may convert (:func:`ortmem.onnxfile.convertible.may_convert`; False is certain).
    convertible: bool
    recompute: bool
    #: Every tensor the skeleton made external sits in the main graph (initializers, Constant
    #: values): ORT's checker refuses external data in a subgraph read from a hard-linked file.
    #: False also when the walk stopped at the first one outside it (``read_facts``'s
    #: ``stop_outside_main_graph``): then ``skeleton`` is None and ``embedded_bytes`` partial.
    main_graph_only: bool
    #: The file has a graph at all (an empty file or a ModelProto without one goes the loader's way,
    #: which names the fault: ``CorruptModelError``).
    has_graph: bool = True
    #: The walk stopped at the first embedded weight outside the main graph (``stop_outside_main_graph``).
    stopped: bool = False
    #: The skeleton already written beside a hard link to the file, in a handoff record
    #: (:mod:`ortmem.store.handoff_records`): facts read from a record carry this instead of
    #: ``skeleton``'s bytes, and ORT is given it as it is.
    skeleton_file: Optional[Path] = None
    #: ``ortmem prepare`` made a store entry for this file (a handoff record says so,
    #: :func:`ortmem.store.handoff_records.mark_prepared`): the session path serves it from the store.
    prepared: bool = False
    #: Bytes of the confirmed external references (weights ORT maps from other files).
    external_bytes: int = 0
    #: (location, end of the furthest span) of each data file the confirmed references read.
    external_ends: tuple[tuple[str, int], ...] = ()
    #: The store settled, for the installed onnxruntime at ORT's defaults, that ORT's finished model of
    #: this file gains nothing (a handoff record says so, :func:`ortmem.store.handoff_records.mark_as_given`);
    #: it holds only for a start at those defaults (:func:`for_call`).
    as_given: bool = False

    @property
    def weight_bytes(self) -> int:
        """The weights ORT maps: embedded above the inline limit, and external."""
        return self.embedded_bytes + self.external_bytes


@record
class PlainHandoff:
    """What ORT is given for a model file that needs nothing of the session path (:func:`plain_handoff`)."""

    model: Path
    #: "as-is" (the file itself) or "mapped" (a skeleton whose weights point into the file).
    action: str
    #: The private folder the caller removes once ORT has mapped what it needs (None: nothing to remove).
    workdir: Optional[Path] = None


def read_facts(path: Path, *, stop_outside_main_graph: bool = False) -> FileFacts:
    """Walk ``path``'s non-weight bytes once (raises :class:`ortmem.errors.CorruptModelError` on a
    malformed file) and search them for the op types and metadata that need ortmem's session path.

    ``stop_outside_main_graph``: the walk stops at the first embedded weight outside the main graph
    (``main_graph_only`` False, no skeleton), for a caller that gives ORT such a model as it is
    whatever else the walk would find, unless the file needs the session path. That is then decided
    from a search of the whole file: a tensor with external data names its ``location``; what the
    walk's screen of inline tensors would have sent to the loader is not known, and ORT, given the
    model as it is, judges those tensors itself, as without ortmem. Only in a file of at most
    :data:`STOPPED_SEARCH_MAX_BYTES`: the walk reads a file's structure and skips its weights, the
    search reads every byte, and in a larger file it could cost more than the walk it saves.

    protowire (with :mod:`ortmem.base.dtypes`) is imported here, by the first walk: a hooked process whose
    models' facts come from handoff records (:mod:`ortmem.store.handoff_records`) never walks, and
    the two modules cost it 1.7 ms of a start held to 20 ms over a plain run (docs/hook.md)."""
    from ortmem.onnxfile.convertible import may_convert
    from ortmem.onnxfile.protowire import LEN, MODEL_GRAPH, FileBytes, WireReader, externalize_embedded
    from ortmem.onnxfile.references import ExternalReferences

    references = ExternalReferences(str(path))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        stop = stop_outside_main_graph and size <= STOPPED_SEARCH_MAX_BYTES
        result = externalize_embedded(FileBytes(f.fileno(), size), file=str(path), location=path.name,
                                      inline_max_bytes=INLINE_MAX_BYTES, stop_outside_main=stop,
                                      references=references)
        needles = (DEQUANTIZE, RECOMPUTE_METADATA.encode()) + ((EXTERNAL_LOCATION,) if result.stopped else ())
        found = _found_in(result.skeleton, needles) if result.changed else _found_in_file(f.fileno(), size, needles)
        top = result.skeleton if result.changed else FileBytes(f.fileno(), size)
        has_graph = any(t.number == MODEL_GRAPH and t.wire_type == LEN  # top-level fields only: payloads skipped
                        for t in WireReader(top, str(path)).fields(0, len(top)))
        convertible = DEQUANTIZE in found and may_convert(top, str(path))
    screen = result.screen
    confirmed = references.confirmed and not result.stopped
    return FileFacts(
        skeleton=result.skeleton,
        embedded_bytes=sum(s.length for s in result.spans),
        needs_loader=EXTERNAL_LOCATION in found or bool(screen.unconfirmed) or (screen.external > 0 and not confirmed),
        convertible=convertible,
        recompute=RECOMPUTE_METADATA.encode() in found,
        main_graph_only=result.outside_main == 0,
        has_graph=has_graph,
        stopped=result.stopped,
        external_bytes=references.bytes if confirmed else 0,
        external_ends=tuple(sorted(references.ends.items())) if confirmed else (),
    )


def needs_session_path(path: Path, facts: FileFacts, converting: bool) -> bool:
    """Whether the model file ``path`` needs ortmem's loader or conversion: DequantizeLinear to convert,
    recompute metadata, references (or inline tensors) the loader must check, data files that do not
    hold what the references read (the loader names the fault), no graph at all (the loader names
    that fault too), or an entry ``ortmem prepare`` made for it (the store serves it). A model that
    needs none of it is handed to ORT by :func:`plain_handoff`, with no onnx import."""
    if (facts.needs_loader or facts.recompute or (facts.convertible and converting) or not facts.has_graph
            or facts.prepared):
        return True
    if not facts.external_ends:
        return False
    from ortmem.onnxfile.external_data import references_present  # the walk's module (protowire) is not needed

    return not references_present(path, facts.external_ends)


def for_call(facts: FileFacts, at_defaults: bool) -> FileFacts:
    """``facts`` as a start reads them: where the store settled the file as given
    (:attr:`FileFacts.as_given`) and the start is at ORT's defaults
    (:func:`ortmem.base.options.at_defaults`), nothing sends it to the store (``prepared`` dropped, and
    :func:`finished_entry_possible` says no); at other settings the store decides, as without the mark."""
    if not facts.as_given:
        return facts
    return facts._replace(prepared=False) if at_defaults else facts._replace(as_given=False)


def finished_entry_possible(facts: FileFacts, finishable: bool) -> bool:
    """Whether the store may hold, or build after the first run, a finished entry of the file worth
    asking for: weights ORT maps of at least :func:`min_finished_bytes`, where a cache and pre-packing
    allow one (``finishable``), unless the store settled the file as given (:func:`for_call`)."""
    return finishable and not facts.as_given and facts.weight_bytes >= min_finished_bytes()


def plain_handoff(path: Path, facts: FileFacts) -> Optional[PlainHandoff]:
    """What ORT is given for a model file that needs nothing of the session path (see
    :func:`needs_session_path`): the file itself when nothing is embedded above
    :data:`INLINE_MAX_BYTES`; when every embedded weight sits in the main graph, its skeleton beside a
    hard link (a handoff record's, else one written into a private folder the caller removes); None
    when the session path must decide: weights inside subgraphs, or no hard link possible."""
    if not facts.main_graph_only:  # first: a walk that stopped there made no skeleton
        return None
    if facts.embedded_bytes and facts.external_ends:
        return None  # a skeleton beside a link to this file alone would lose the other data files
    if facts.skeleton_file is not None:
        return PlainHandoff(facts.skeleton_file, "mapped")
    if not facts.embedded_bytes:
        return PlainHandoff(path, "as-is")
    if facts.skeleton is None:
        return None  # facts without their skeleton's bytes (a record that kept none): the session path decides
    linked = link_skeleton(path, facts.skeleton)
    return None if linked is None else PlainHandoff(linked[0], "mapped", linked[1])


def dequantize_facts(path: Path) -> Optional[FileFacts]:
    """The walk's facts of a file that may mention DequantizeLinear (:func:`read_facts`: whether one of
    them may convert is :attr:`FileFacts.convertible`); None for a file whose bytes do not mention it
    (:func:`may_mention`: nothing in it converts)."""
    return read_facts(path) if may_mention(path, DEQUANTIZE) else None


def convertible_file(path: Path) -> bool:
    """Whether a model file may hold a DequantizeLinear ortmem converts (False is certain): the walk's
    answer (:attr:`FileFacts.convertible`) where :func:`may_mention` finds the op's name. A file the
    walk finds malformed may hold one: the loader names its fault."""
    try:
        facts = dequantize_facts(path)
    except CorruptModelError:
        return True
    return facts is not None and facts.convertible


def may_mention(path: Path, needle: bytes) -> bool:
    """:func:`file_mentions` in a file of at most :data:`STOPPED_SEARCH_MAX_BYTES` (a search at C
    speed); True, unsearched, in a larger one, whose walk skips the weight bytes a search would read
    (a 1 GB embedded fp32 model is about 0.2 s of reads): the caller walks it."""
    return path.stat().st_size > STOPPED_SEARCH_MAX_BYTES or file_mentions(path, needle)


def file_mentions(path: Path, needle: bytes) -> bool:
    """Whether ``path``'s bytes contain ``needle`` (read in :data:`SEARCH_CHUNK` pieces, at C speed):
    False is certain; True may be a name that contains it, so the caller looks closer. Cheaper than
    :func:`read_facts`'s walk on a small file with many tensors (a skeleton whose weights are
    external), so a start asks it first: for the recompute metadata prefix (a warm start's entry) or
    :data:`DEQUANTIZE` (a model to convert)."""
    with open(path, "rb") as f:
        return bool(_found_in_file(f.fileno(), os.fstat(f.fileno()).st_size, (needle,)))


def _found_in(data: bytes, needles: tuple[bytes, ...]) -> set[bytes]:
    return {n for n in needles if n in data}


def _found_in_file(fd: int, size: int, needles: tuple[bytes, ...]) -> set[bytes]:
    """The needles present in the file, read in :data:`SEARCH_CHUNK` pieces that overlap by the
    longest needle (so none is missed across a boundary)."""
    overlap = max(len(n) for n in needles) - 1
    found: set[bytes] = set()
    pos = 0
    while pos < size and len(found) < len(needles):
        chunk = os.pread(fd, SEARCH_CHUNK + overlap, pos)
        found |= _found_in(chunk, needles)
        pos += SEARCH_CHUNK
    return found


def link_skeleton(path: Path, skeleton: bytes, root: Optional[Path] = None) -> Optional[tuple[Path, Path]]:
    """(skeleton path, private folder): ``skeleton`` written into a new private folder (under ``root``,
    else the system temp folder) beside a hard link to ``path``, whose bytes its tensors point into;
    None when no link can be made there. Symbolic links would not do: ORT resolves them and refuses
    data outside the model's folder. The caller removes the folder once ORT has mapped what it needs."""
    import shutil  # here, not at the top: the hook imports this module in every hooked process
    import tempfile

    if root is not None and not root.is_dir():
        return None
    workdir = Path(tempfile.mkdtemp(prefix=".tmp-link-" if root else "ortmem-", dir=root))
    try:
        os.link(path, workdir / path.name)
        target = workdir / skeleton_name(path)
        target.write_bytes(skeleton)
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
        return None
    return target, workdir


def skeleton_name(path: Path) -> str:
    """The skeleton's file name beside the hard link to ``path`` (never the link's own name)."""
    return "ortmem-skeleton.onnx" if path.name != "ortmem-skeleton.onnx" else "ortmem-skeleton1.onnx"
