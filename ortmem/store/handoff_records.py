"""Handoff records: what the walk of a model file found, kept so that a program started again skips it.

Why: a model that needs nothing of the session path (no DequantizeLinear to convert, no external data
to check) is handed to ORT from its bytes (:mod:`ortmem.onnxfile.scan`): as it is, or as a skeleton
beside a hard link, so that ORT maps its embedded weights instead of copying them. Deciding that
takes a walk of the file's structure in pure Python, about 4.5 us per protobuf message: rapidocr's
three models (1552 messages in the recognition model alone) cost a hooked process 22 ms of walks
and two skeletons written on every start (onnxruntime 1.32.0, 2 cores,
``python -m bench.hook_stages tests/hook_clients/rapidocr_client.py``), more than the hook may
cost a program whose models ORT gets unconverted (20 ms). A record makes every later
start of the same file a few ``stat`` calls and one small read.

What a record is: a folder ``<store>/.handover/<key>/``, the key a hash of the file's path, device,
inode, size and mtime, this record format and ortmem's version. It holds ``facts`` (the
:class:`~ortmem.onnxfile.scan.FileFacts` fields, the identity, the ctime after the record was made and
the skeleton's digest) and, for a file whose embedded weights ORT maps, the skeleton and a hard link
to the file: the pair :func:`ortmem.onnxfile.scan.link_skeleton` would write into a temporary folder.
Every walk is recorded, that of a model the session path takes too (its external data, its
DequantizeLinear): its warm start, or a start the store settled as converting nothing, reads only the
store's entry or the file's record, and would otherwise walk the file again.

A file modified within :data:`~ortmem.files.trust.RACY_SECONDS` gets no record: on a file system
with coarse timestamps a second write in the same tick would leave mtime and ctime as recorded.
When a record is used, all of: the folder and its files are this user's and nobody else may write
them (:mod:`ortmem.files.trust`, the rule of every cache file), the file's ctime is the one recorded
(any write to it moves its ctime, which no writer can set back, and a replacement is another inode,
hence another key), the link is still the file's inode, and the skeleton's digest matches (a flipped
offset would point ORT at other bytes). Otherwise the walk runs as without records, and its record
replaces the old one, unless that one is under a minute old (:data:`IN_USE_SECONDS`: its maker's ORT
may be reading its skeleton; the start then hands the skeleton over from a temporary folder, as
without records). A link made to the file by anyone else (a cache entry's, another cache's record)
also moves its ctime: the next start walks once more and, finding exactly what the record says,
rewrites the record's ctime in place, linking nothing (a new record's link would move the ctime
again). Workers starting together: one that walked while another recorded takes the other's record.

Two marks may sit beside a record's ``facts``, each a file that only ever sends a start elsewhere, and
carried over when the record is replaced for the same file: ``prepared`` (``ortmem prepare`` made a store
entry for the file: starts ask the store, :func:`mark_prepared`) and ``as-given-<onnxruntime version>``
(the store settled that ORT's finished model of the file gains nothing on that release at ORT's
defaults: starts with those defaults hand the file over from its bytes without asking the store,
:func:`mark_as_given`). A mark read wrongly costs at most the store's lookup or a finished entry not
built, never a different model: ORT always gets the user's own file.

What removes them: ``ortmem cache clear`` (the folder is inside the store's), and every new record:
before it is made, records whose file no longer has the identity in their key (deleted, replaced,
edited) are removed, so a record's hard link never keeps a deleted model's bytes on disk for long.
Everything here is best effort: a read-only, full or untrusted folder gets no record, costs the walk
as before and logs nothing (nothing the user asked for failed).
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Optional

import onnxruntime

from ortmem import __version__
from ortmem.errors import OrtmemError
from ortmem.onnxfile.scan import FileFacts, needs_session_path, read_facts, skeleton_name
from ortmem.base.hashing import short_hash
from ortmem.files.trust import (RACY_SECONDS, TMP_PREFIX, cache_file_problem, make_private_dir, parent_untrusted_reason, read_nofollow, remove_aside, untrusted_reason, write_new)

#: The records' folder inside the store's (a "." name: the store's listing and pruning skip it).
FOLDER = ".handover"
#: Bumped whenever the walk's facts or the skeleton for the same file would differ.
RECORD_FORMAT = 3
#: A record's description of itself.
FACTS_FILE = "facts"
#: Present in a record when ``ortmem prepare`` made a store entry for its file (:func:`mark_prepared`).
PREPARED_FILE = "prepared"
#: Followed by an onnxruntime version: present in a record when the store settled, for that release at
#: ORT's defaults, that its finished model of the file gains nothing (:func:`mark_as_given`).
AS_GIVEN_PREFIX = "as-given-"
#: A folder left by a writer that died, removed by the next record made after this long.
STALE_SECONDS = 86400.0
#: A record made this recently is never replaced (its maker's ORT may be reading its skeleton): a
#: start that finds it unusable hands its skeleton over from a temporary folder instead.
IN_USE_SECONDS = 60.0
#: The identity a record's key is made of, and what it keeps of it.
_IDENTITY = ("dev", "ino", "size", "mtime_ns")
_FLAGS = ("needs_loader", "convertible", "recompute", "main_graph_only", "has_graph", "stopped")


def records_folder(store: Path) -> Optional[Path]:
    """``<store>/.handover``, created private if needed; None when it cannot be made or trusted
    (the store's folder or the records' is another user's, or others may write it)."""
    folder = store / FOLDER
    try:
        if not folder.is_dir():
            if store.is_dir() and (untrusted_reason(store) or parent_untrusted_reason(store)):
                return None
            make_private_dir(folder, parents=True)
    except OSError:
        return None
    if untrusted_reason(folder) or untrusted_reason(store) or parent_untrusted_reason(store):
        return None
    return folder


def facts_of(path: Path, folder: Optional[Path], *, stop_outside_main_graph: bool = False) -> FileFacts:
    """:func:`ortmem.onnxfile.scan.read_facts` of ``path``, from its record in ``folder`` when there is
    a usable one, else walked and recorded there (no record with ``folder`` None). Raises what the
    walk raises (:class:`ortmem.errors.CorruptModelError`)."""
    if folder is None:
        return read_facts(path, stop_outside_main_graph=stop_outside_main_graph)
    before = os.stat(path)
    recorded = recorded_facts(folder, path, before, stop_outside_main_graph=stop_outside_main_graph)
    if recorded is not None:
        return recorded
    facts = read_facts(path, stop_outside_main_graph=stop_outside_main_graph)
    facts = record(folder, path, before, facts, stop_outside_main_graph=stop_outside_main_graph)
    return _with_marks(facts, folder / _key(path, before))


def recorded_facts(folder: Path, path: Path, st: os.stat_result, *,
                   stop_outside_main_graph: bool = False) -> Optional[FileFacts]:
    """The facts recorded for ``path`` as ``st`` describes it, or None when there is no usable record
    (see the module docstring). A record of a walk that stopped at a weight outside the main graph
    answers only a caller that would stop there too."""
    where = folder / _key(path, st)
    fields = _read_facts_file(where)
    if fields is None or fields.get("ctime_ns") != str(st.st_ctime_ns):
        return None
    if any(fields.get(k) != str(getattr(st, f"st_{k}")) for k in _IDENTITY):
        return None
    flags = {k: fields.get(k) == "1" for k in _FLAGS}
    if flags["stopped"] and not stop_outside_main_graph:
        return None
    skeleton_file = None
    if fields.get("skeleton", "-") != "-":
        skeleton_file = where / skeleton_name(path)
        if not _is_file_pair(where / path.name, st) or not _skeleton_matches(skeleton_file, fields["skeleton"]):
            return None
    try:
        embedded = int(fields.get("embedded_bytes", ""))
        external = int(fields.get("external_bytes", ""))
        ends = _ends_from(fields.get("external_ends", ""))
    except ValueError:
        return None
    return _with_marks(FileFacts(skeleton=None, embedded_bytes=embedded, skeleton_file=skeleton_file,
                                 external_bytes=external, external_ends=ends, **flags), where)


def as_given_facts(store: Path, path: Path) -> Optional[FileFacts]:
    """The recorded facts of ``path`` where its record in ``store``'s records folder carries
    :func:`mark_as_given`'s mark for the installed onnxruntime; None otherwise (no record, no mark, an
    untrusted folder). Walks nothing: a file large enough for a finished entry is walked, if at all, by
    the session path once the store has been asked."""
    if not (store / FOLDER).is_dir():
        return None
    folder = records_folder(store)
    if folder is None:
        return None
    try:
        facts = recorded_facts(folder, path, os.stat(path))
    except OSError:
        return None
    return facts if facts is not None and facts.as_given else None


def _ends_text(ends: tuple[tuple[str, int], ...]) -> str:
    """``FileFacts.external_ends`` on one line: each location's UTF-8 bytes in hex, a colon, its end
    (a location may hold any character a line could not)."""
    return ",".join(f"{location.encode().hex()}:{end}" for location, end in ends) or "-"


def _ends_from(text: str) -> tuple[tuple[str, int], ...]:
    """:func:`_ends_text` read back; ValueError for a damaged field."""
    if text == "-":
        return ()
    ends = []
    for item in text.split(","):
        location, end = item.split(":")
        ends.append((bytes.fromhex(location).decode(), int(end)))
    return tuple(ends)


def _marks(where: Path) -> tuple[str, ...]:
    """The marks the record folder ``where`` (named by the file's identity: path, inode, size, mtime)
    holds (:func:`mark_prepared`'s, :func:`mark_as_given`'s). Kept apart from the record's validity: a
    link to the file or a chmod moves its ctime and sends the next start to the walk, while a mark only
    decides whether the store is asked, and the store checks the source itself."""
    try:
        if untrusted_reason(where) is not None:
            return ()
        return tuple(n for n in os.listdir(where) if n == PREPARED_FILE or n.startswith(AS_GIVEN_PREFIX))
    except OSError:
        return ()


def _as_given_mark() -> str:
    """:func:`mark_as_given`'s mark for the installed onnxruntime."""
    return AS_GIVEN_PREFIX + onnxruntime.__version__


def _with_marks(facts: FileFacts, where: Path) -> FileFacts:
    """``facts`` with the marks of the record folder ``where`` (:func:`_marks`) for the installed onnxruntime."""
    marks = _marks(where)
    return facts._replace(prepared=facts.prepared or PREPARED_FILE in marks,
                          as_given=facts.as_given or _as_given_mark() in marks)


def mark_prepared(folder: Optional[Path], path: Path) -> bool:
    """Record that ``ortmem prepare`` made a store entry for ``path``, so that starts ask the store for
    it instead of handing the file to ORT from its bytes (the records serve files below the finished
    threshold, which no start otherwise looks up). The record is made first if there is none. True
    when starts will ask the store: marked now or before, or a file the session path takes anyway;
    False when nothing could be recorded (no usable folder, a file written within
    :data:`~ortmem.files.trust.RACY_SECONDS`, a read-only or full disk)."""
    if folder is None:
        return False
    try:
        facts = facts_of(path, folder)
        if needs_session_path(path, facts, converting=True):
            return True  # marked before, or the session path takes it anyway
        where = folder / _key(path, os.stat(path))
        if not (where / FACTS_FILE).is_file():
            return False
        write_new(where / PREPARED_FILE, b"")
        return True
    except FileExistsError:
        return True
    except OSError:
        return False


def mark_as_given(folder: Optional[Path], path: Path) -> bool:
    """Record that the store settled, for the installed onnxruntime at ORT's defaults, that ORT's
    finished model of ``path`` gains nothing (its entry is a marker: ORT keeps as much of the finished
    model as of the file): starts at those defaults then hand the file to ORT from its bytes without
    importing the store or asking it (:func:`ortmem.onnxfile.scan.for_call`). The record is made first if
    there is none. True when marked, now or before; False when nothing could be recorded, or the file
    needs the session path whatever the store says (its loader checks it)."""
    if folder is None:
        return False
    try:
        facts = facts_of(path, folder)
        if facts.as_given:
            return True
        if needs_session_path(path, facts._replace(prepared=False), converting=True):
            return False
        where = folder / _key(path, os.stat(path))
        if not (where / FACTS_FILE).is_file():
            return False
        write_new(where / _as_given_mark(), b"")
        return True
    except FileExistsError:
        return True
    except (OSError, OrtmemError):  # a file gone or changed since the start walked it: nothing marked
        return False


def record(folder: Path, path: Path, before: os.stat_result, facts: FileFacts, *,
           stop_outside_main_graph: bool = False) -> FileFacts:
    """Record ``facts``, walked from ``path`` as ``before`` describes it; returns the facts to hand
    over with: with ``skeleton_file`` in a record when one holds the skeleton and its link (this
    one, or one another process made meanwhile), else ``facts`` as given (nothing recorded, or
    nothing to map)."""
    key = _key(path, before)
    target = folder / key
    pair = facts.skeleton is not None and facts.main_graph_only
    recorded = _usable(folder, path, stop_outside_main_graph)
    if recorded is not None:
        return recorded  # another process recorded it while this one walked (workers starting together)
    if time.time_ns() - before.st_mtime_ns < RACY_SECONDS * 1e9:
        return facts  # just written: a second write within the same timestamp tick would go unseen
    refreshed = _refreshed(target, path, before, facts, pair)
    if refreshed is not None:
        return refreshed  # the record describes the file as walked: only its ctime moved (a link elsewhere)
    # Old records go first: removing one whose link is this same inode moves the file's ctime.
    _remove_stale(folder, keep=key)
    carried = _marks(target)  # a replaced record of the same identity passes its marks on
    if _age(target) > IN_USE_SECONDS:  # a younger one may be its maker's session's model right now
        remove_aside(target)
    building = folder / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        make_private_dir(building)
        if pair:
            os.link(path, building / path.name)
            write_new(building / skeleton_name(path), facts.skeleton)
        after = os.stat(path)  # after the link, which moved its ctime
        if any(getattr(after, f"st_{k}") != getattr(before, f"st_{k}") for k in _IDENTITY):
            raise OSError("the file changed while it was walked")
        write_new(building / FACTS_FILE, _facts_text(_facts_fields(path, after, facts, pair)))
        for mark in carried:
            write_new(building / mark, b"")
        os.rename(building, target)
    except OSError:  # no room, read-only, a link across file systems, or another writer was first
        remove_aside(building)
        return _usable(folder, path, stop_outside_main_graph) or facts
    if not pair:
        return facts
    return facts._replace(skeleton=None, skeleton_file=target / skeleton_name(path))


def _facts_fields(path: Path, st: os.stat_result, facts: FileFacts, pair: bool) -> dict[str, str]:
    """A record's ``facts`` fields for ``facts`` walked from ``path`` as ``st`` describes it."""
    return {"format": str(RECORD_FORMAT), "path": os.path.abspath(path),
            **{k: str(getattr(st, f"st_{k}")) for k in _IDENTITY}, "ctime_ns": str(st.st_ctime_ns),
            "embedded_bytes": str(facts.embedded_bytes), "external_bytes": str(facts.external_bytes),
            "external_ends": _ends_text(facts.external_ends),
            **{k: "1" if getattr(facts, k) else "0" for k in _FLAGS},
            "skeleton": short_hash(facts.skeleton) if pair else "-"}


def _facts_text(fields: dict[str, str]) -> bytes:
    return "".join(f"{k} {v}\n" for k, v in fields.items()).encode()


def _refreshed(target: Path, path: Path, before: os.stat_result, facts: FileFacts, pair: bool) -> Optional[FileFacts]:
    """The record ``target`` made usable again when the walk just made of ``path`` finds exactly what it
    recorded and only the file's ctime moved since (a hard link made or removed elsewhere: another
    cache's record or entry, a temporary skeleton's): its ``facts`` file is rewritten with the new
    ctime, and nothing is linked or unlinked. Replacing the record instead would link the file again,
    and each start that found it unusable within :data:`IN_USE_SECONDS` would move the ctime once
    more with its temporary skeleton, so that no record of it was ever usable while starts kept
    coming. None where the record differs in anything else (the caller replaces it)."""
    fields = _read_facts_file(target)
    if fields is None or any(fields.get(k) != str(getattr(before, f"st_{k}")) for k in _IDENTITY):
        return None
    if pair and not (_is_file_pair(target / path.name, before)
                     and _skeleton_matches(target / skeleton_name(path), fields.get("skeleton", ""))):
        return None
    walked = _facts_fields(path, before, facts, pair)
    if {**fields, "ctime_ns": ""} != {**walked, "ctime_ns": ""}:
        return None
    try:
        after = os.stat(path)
        if any(getattr(after, f"st_{k}") != getattr(before, f"st_{k}") for k in _IDENTITY):
            return None
        tmp = target / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        write_new(tmp, _facts_text({**walked, "ctime_ns": str(after.st_ctime_ns)}))
    except OSError:
        return None
    try:
        os.replace(tmp, target / FACTS_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    facts = _with_marks(facts, target)
    if not pair:
        return facts
    return facts._replace(skeleton=None, skeleton_file=target / skeleton_name(path))


def _usable(folder: Path, path: Path, stop_outside_main_graph: bool) -> Optional[FileFacts]:
    """The record of ``path`` as it is now, if one is usable."""
    try:
        return recorded_facts(folder, path, os.stat(path), stop_outside_main_graph=stop_outside_main_graph)
    except OSError:
        return None


def _key(path: Path, st: os.stat_result) -> str:
    parts = [str(RECORD_FORMAT), __version__, os.path.abspath(path), *(str(getattr(st, f"st_{k}")) for k in _IDENTITY)]
    return short_hash("\0".join(parts).encode())


def _read_facts_file(where: Path) -> Optional[dict[str, str]]:
    """A record's fields, or None: no record, one that fails the cache's file check
    (:func:`ortmem.files.trust.cache_file_problem`: not this user's, writable by others, a link),
    or a damaged one."""
    facts = where / FACTS_FILE
    try:
        if untrusted_reason(where) or cache_file_problem(facts):
            return None
        text = read_nofollow(facts).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    return fields if fields.get("format") == str(RECORD_FORMAT) else None


def _is_file_pair(link: Path, st: os.stat_result) -> bool:
    """Whether the record's hard link is still the file ``st`` describes."""
    try:
        lst = os.lstat(link)
    except OSError:
        return False
    return stat.S_ISREG(lst.st_mode) and (lst.st_dev, lst.st_ino) == (st.st_dev, st.st_ino)


def _skeleton_matches(skeleton: Path, recorded: str) -> bool:
    """Whether a record's skeleton passes the cache's file check and has the recorded digest."""
    try:
        return cache_file_problem(skeleton) is None and short_hash(read_nofollow(skeleton)) == recorded
    except OSError:
        return False


def _remove_stale(folder: Path, *, keep: str) -> None:
    """Remove every record (but ``keep``) whose file no longer has the identity in its key, and
    writers' folders older than :data:`STALE_SECONDS`. One ``stat`` and one small read per record,
    paid only when a new record is made."""
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        where = folder / name
        if name.startswith("."):
            try:
                if now - os.lstat(where).st_mtime > STALE_SECONDS:
                    remove_aside(where)
            except OSError:
                pass
        elif name != keep:
            fields = _read_facts_file(where)
            if fields is None or not _still_names_its_file(name, fields):
                remove_aside(where)


def _age(where: Path) -> float:
    """Seconds since ``where`` was made (-1 when it is not there)."""
    try:
        return time.time() - os.lstat(where).st_mtime
    except OSError:
        return -1.0


def _still_names_its_file(name: str, fields: dict[str, str]) -> bool:
    try:
        return _key(Path(fields["path"]), os.stat(fields["path"])) == name
    except (OSError, KeyError, ValueError):
        return False
