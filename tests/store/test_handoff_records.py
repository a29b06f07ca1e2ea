"""Handoff records (:mod:`ortmem.store.handoff_records`): a model file walked once, its facts and
skeleton kept in the store's folder, every later start reading the record instead. On real files
saved by onnx and real ORT sessions, compared with ORT's run of the file as it is: a record is used
only while it is exactly the file's (an edit with its mtime set back, a replacement, a damaged
skeleton, a folder others may write all send the start back to the walk)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortmem.base.child_env import store_folder
from ortmem.onnxfile.scan import plain_handoff
from ortmem.store import handoff_records
from ortmem.store.cache import Cache
from ortmem.store.handoff_records import facts_of, records_folder
from tests.support.builders import int4_model, matmul_chain, save, subgraph_model

FEED = {"x": np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)}


def _settled(path: Path) -> Path:
    """``path`` with its mtime an hour back, as an installed model's: a file written within
    ``RACY_SECONDS`` gets no record."""
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    return path


def _ort(path: Path) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, FEED)[0]


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every walk the records module asks of :func:`ortmem.onnxfile.scan.read_facts`."""
    seen: list[Path] = []
    real = handoff_records.read_facts

    def counted(path: Path, **kwargs):
        seen.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(handoff_records, "read_facts", counted)
    return seen


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    made = records_folder(tmp_path / "store")
    assert made is not None and made.is_dir() and (made.stat().st_mode & 0o077) == 0
    return made


@pytest.fixture
def embedded(tmp_path: Path) -> Path:
    """fp32 MatMuls whose weights (64 KiB and 256 KiB) are embedded above the inline limit."""
    return _settled(save(matmul_chain(np.random.default_rng(3), [64, 256, 256, 8]), tmp_path / "models" / "chain.onnx"))


def _mapped_output(path: Path, facts) -> np.ndarray:
    plain = plain_handoff(path, facts)
    assert plain is not None and plain.action == "mapped"
    return _ort(plain.model)


def test_a_second_start_reads_the_record_and_ort_maps_its_skeleton(embedded: Path, folder: Path, walks: list[Path]):
    first = facts_of(embedded, folder)
    second = facts_of(embedded, folder)
    assert walks == [embedded]  # the second start walked nothing
    assert second.skeleton is None and second.skeleton_file is not None
    assert second.skeleton_file.parent.parent == folder
    assert second.embedded_bytes == first.embedded_bytes > 0 and second.main_graph_only
    # The record's skeleton, beside its hard link to the file, gives ORT's outputs on the file, bit for bit
    assert np.array_equal(_mapped_output(embedded, second), _ort(embedded))
    assert plain_handoff(embedded, second).workdir is None  # nothing written for this start


def test_an_edit_with_the_mtime_set_back_is_walked_again(embedded: Path, folder: Path, walks: list[Path]):
    """Same size, same mtime, other weights: only the ctime tells, and the record is not used."""
    facts_of(embedded, folder)
    old_output = _ort(embedded)
    before = embedded.stat()
    other = save(matmul_chain(np.random.default_rng(4), [64, 256, 256, 8]), embedded.parent / "other.onnx")
    assert other.stat().st_size == before.st_size
    with open(embedded, "r+b") as f:  # in place: same inode
        f.write(other.read_bytes())
    os.utime(embedded, ns=(before.st_atime_ns, before.st_mtime_ns))
    facts = facts_of(embedded, folder)
    assert walks == [embedded, embedded]
    assert not np.array_equal(_ort(embedded), old_output)  # the edit changed what the model computes
    assert np.array_equal(_mapped_output(embedded, facts), _ort(embedded))


def test_a_link_made_elsewhere_costs_one_walk_and_moves_nothing(embedded: Path, folder: Path, walks: list[Path]):
    """Another hard link to the file (another cache's record, a copy made with ``ln``) moves its ctime: the
    next start walks once, finds what the record says and updates the record in place, linking and
    unlinking nothing (each link would move the ctime again, and starts coming within a minute of the
    record would then walk every time); later starts walk nothing and ORT maps from the record."""
    first = facts_of(embedded, folder)
    os.link(embedded, embedded.parent / "elsewhere.onnx")
    moved = embedded.stat()
    again = facts_of(embedded, folder)
    assert walks == [embedded, embedded] and again.skeleton_file == first.skeleton_file is not None
    now = embedded.stat()
    assert (now.st_ctime_ns, now.st_nlink) == (moved.st_ctime_ns, moved.st_nlink)
    for _ in range(3):
        assert facts_of(embedded, folder).skeleton_file == first.skeleton_file
    assert walks == [embedded, embedded]
    assert embedded.stat().st_ctime_ns == moved.st_ctime_ns
    assert np.array_equal(_mapped_output(embedded, again), _ort(embedded))


def test_a_replaced_file_gets_a_new_record_and_the_old_one_goes(embedded: Path, folder: Path, walks: list[Path]):
    facts_of(embedded, folder)
    (old,) = os.listdir(folder)
    replacement = save(matmul_chain(np.random.default_rng(5), [64, 256, 256, 8]), embedded.parent / "new.onnx")
    os.replace(_settled(replacement), embedded)  # another inode under the same name, as pip installs files
    facts = facts_of(embedded, folder)
    assert len(walks) == 2
    assert old not in os.listdir(folder) and len(os.listdir(folder)) == 1  # its link no longer holds the old bytes
    assert np.array_equal(_mapped_output(embedded, facts), _ort(embedded))


def test_a_damaged_skeleton_is_not_used(embedded: Path, folder: Path, walks: list[Path]):
    skeleton = facts_of(embedded, folder).skeleton_file
    data = bytearray(skeleton.read_bytes())
    data[len(data) // 2] ^= 0x01
    skeleton.write_bytes(bytes(data))
    facts = facts_of(embedded, folder)
    assert len(walks) == 2
    assert np.array_equal(_mapped_output(embedded, facts), _ort(embedded))


def test_a_file_written_just_now_gets_no_record(tmp_path: Path, folder: Path, walks: list[Path]):
    """Within RACY_SECONDS of its last write a second write could keep the same mtime and ctime on a
    file system with coarse timestamps: such a file is walked on every start until it is older."""
    path = save(matmul_chain(np.random.default_rng(6), [64, 256, 256, 8]), tmp_path / "fresh" / "m.onnx")
    facts = facts_of(path, folder)
    facts_of(path, folder)
    assert len(walks) == 2 and os.listdir(folder) == []
    assert np.array_equal(_mapped_output(path, facts), _ort(path))
    _settled(path)
    facts_of(path, folder)
    facts_of(path, folder)
    assert len(walks) == 3 and len(os.listdir(folder)) == 1


def test_a_record_others_may_write_is_not_used(embedded: Path, folder: Path, walks: list[Path]):
    facts_of(embedded, folder)
    (name,) = os.listdir(folder)
    os.chmod(folder / name, 0o770)
    assert handoff_records.recorded_facts(folder, embedded, embedded.stat()) is None
    facts_of(embedded, folder)
    assert len(walks) == 2


def test_a_read_only_records_folder_costs_only_the_walk(embedded: Path, folder: Path, walks: list[Path],
                                                       monkeypatch: pytest.MonkeyPatch):
    """A folder nothing can be created in (a read-only mount, a cache deployed read-only; the check
    is made by the kernel, which root passes, hence the refusal made here): the walk's facts, no
    record, and the skeleton in a temporary folder as without records."""
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(handoff_records, "make_private_dir", read_only)
    facts = facts_of(embedded, folder)
    assert os.listdir(folder) == [] and facts.skeleton is not None
    plain = plain_handoff(embedded, facts)
    assert plain.workdir is not None
    assert np.array_equal(_ort(plain.model), _ort(embedded))


def test_a_folder_where_no_record_can_be_made_costs_only_the_walk(embedded: Path, folder: Path, walks: list[Path],
                                                                   monkeypatch: pytest.MonkeyPatch):
    """A link refused (another file system, a full disk): nothing recorded, nothing left behind."""
    def refused(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(handoff_records.os, "link", refused)
    facts = facts_of(embedded, folder)
    assert os.listdir(folder) == [] and facts.skeleton is not None and facts.skeleton_file is None


def test_a_stopped_walk_answers_only_callers_that_stop(tmp_path: Path, folder: Path, walks: list[Path]):
    """A walk that stopped at a weight in a subgraph (the hook with the caller's options) knows too
    little for a caller that walks the whole file: that caller walks, and its record serves both."""
    path = _settled(save(subgraph_model(np.random.default_rng(0)), tmp_path / "sub" / "model.onnx"))
    stopped = facts_of(path, folder, stop_outside_main_graph=True)
    assert stopped.stopped and not stopped.main_graph_only
    assert facts_of(path, folder, stop_outside_main_graph=True) == stopped and len(walks) == 1
    whole = facts_of(path, folder)
    assert not whole.stopped and len(walks) == 2
    # Within its first minute the stopped record stays (its maker may be loading it): walked again
    assert facts_of(path, folder) == whole and len(walks) == 3
    (name,) = os.listdir(folder)
    hour_ago = time.time() - 3600
    os.utime(folder / name, (hour_ago, hour_ago))
    assert facts_of(path, folder) == whole and len(walks) == 4  # now it is replaced
    assert facts_of(path, folder, stop_outside_main_graph=True) == facts_of(path, folder) and len(walks) == 4
    assert whole.skeleton_file is None and plain_handoff(path, whole) is None  # the session path decides
    assert len(os.listdir(folder)) == 1


def test_a_model_with_something_to_convert_is_recorded_as_such(tmp_path: Path, folder: Path, walks: list[Path]):
    """Its record keeps it on the session path (a start the store settled as converting nothing reads
    the record instead of walking it again)."""
    path = _settled(save(int4_model(np.random.default_rng(0)), tmp_path / "q" / "model.onnx"))
    assert facts_of(path, folder).convertible
    again = facts_of(path, folder)
    assert again.convertible and walks == [path]


def test_a_model_with_external_data_is_walked_once(tmp_path: Path, folder: Path, walks: list[Path]):
    """The walk checks its references and keeps what each start checks again (the data files and how
    far into each): recorded, not repeated."""
    path = _settled(save(matmul_chain(np.random.default_rng(4), [64, 256, 8]), tmp_path / "x" / "model.onnx",
                         external=True))
    first = facts_of(path, folder)
    again = facts_of(path, folder)
    assert not first.needs_loader and again == first and again.skeleton_file is None
    assert again.external_ends == (("model.onnx.data", (path.parent / "model.onnx.data").stat().st_size),)
    assert again.external_bytes == (64 * 256 + 256 * 8) * 4
    assert walks == [path]
    assert [name for name in os.listdir(folder) if not name.startswith(".")]


def test_records_live_in_the_store_folder_and_go_with_it(tmp_path: Path, embedded: Path,
                                                        monkeypatch: pytest.MonkeyPatch):
    """The hook finds the store's folder from its ``cache=`` option as the session path does, and
    ``ortmem cache clear`` removes the records with the entries."""
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(tmp_path / "cache"))
    cache = Cache()
    assert store_folder(True) == cache.root and store_folder(str(tmp_path / "x")) == tmp_path / "x"
    folder = records_folder(cache.root)
    facts_of(embedded, folder)
    assert embedded.stat().st_nlink == 2
    cache.clear()
    assert not folder.exists() and embedded.stat().st_nlink == 1


def test_an_untrusted_store_folder_gets_no_records(tmp_path: Path):
    store = tmp_path / "shared"
    store.mkdir()
    os.chmod(store, 0o777)
    assert records_folder(store) is None
    assert not (store / handoff_records.FOLDER).exists()


HOOKED = """
import json, sys
import numpy as np
import onnxruntime as ort
import ortmem
ortmem.hook()
from ortmem.store import handoff_records
walked = []
real = handoff_records.read_facts
handoff_records.read_facts = lambda p, **k: walked.append(str(p)) or real(p, **k)
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
out = s.run(None, {"x": np.linspace(-1, 1, 256, dtype=np.float32).reshape(4, 64)})[0]
actions = [r["action"] for r in __import__("ortmem.intercept.session_hook").intercept.session_hook.report()]
print(json.dumps({"walked": walked, "actions": actions, "out": out.tolist(),
                  "imported": sorted(m for m in ("shutil", "tempfile", "onnx", "ortmem.onnxfile.protowire") if m in sys.modules)}))
"""


def test_a_hooked_program_started_again_maps_from_the_record(embedded: Path, tmp_path: Path):
    """Fresh processes, as a program is started again: the first walks and records, the second
    reads the record, writes nothing and imports neither shutil, tempfile nor the walk's reader
    (``ortmem.onnxfile.protowire``); both give ORT's outputs."""
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", HOOKED, str(embedded)], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        runs.append(json.loads(done.stdout))
    assert [r["walked"] for r in runs] == [[str(embedded)], []]
    assert [r["actions"] for r in runs] == [["mapped"], ["mapped"]]
    assert runs[1]["imported"] == []
    expected = _ort(embedded).tolist()
    assert runs[0]["out"] == expected and runs[1]["out"] == expected


def test_workers_starting_together_all_get_orts_outputs(embedded: Path, tmp_path: Path):
    """Four hooked processes started at once on an empty store, as a server's workers are: each
    walks or reads a record, none removes a record another may be loading (a record is never
    replaced in its first minute), none warns, and all give ORT's outputs."""
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", HOOKED, str(embedded)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    expected = _ort(embedded).tolist()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and err == "", err
        run = json.loads(out)
        assert run["actions"] == ["mapped"] and run["out"] == expected
    records = records_folder(tmp_path / "cache" / "converted")
    assert [name for name in os.listdir(records) if not name.startswith(".")]  # one of them recorded it


def test_the_session_path_hands_a_small_model_over_from_its_record(embedded: Path):
    import ortmem

    first = ortmem.InferenceSession(str(embedded), providers=["CPUExecutionProvider"])
    second = ortmem.InferenceSession(str(embedded), providers=["CPUExecutionProvider"])
    assert first.ortmem_action == second.ortmem_action == "mapped"
    records = records_folder(store_folder(True))
    assert len(os.listdir(records)) == 1
    for s in (first, second):
        assert np.array_equal(s.run(None, FEED)[0], _ort(embedded))



def test_a_small_model_ortmem_prepare_finished_starts_from_its_finished_entry(tmp_path: Path):
    """Below the finished threshold no start asks the store, except for a file ``ortmem prepare``
    finished: its record says so. Pruned or cleared, the entry is missed once per start and the file is
    handed over from its bytes again; outputs are ORT's own throughout."""
    import shutil

    import ortmem
    from ortmem.session.deploy import prepare_path

    rng = np.random.default_rng(5)
    model = _settled(save(matmul_chain(rng, [64, 512, 512, 512, 8]), tmp_path / "models" / "chain.onnx"))
    lines: list[str] = []
    assert prepare_path(model, say=lines.append) == 0, lines
    records = records_folder(store_folder(True))
    assert records is not None
    recorded = facts_of(model, records)
    finished = "finished entry" in lines[-1]
    assert recorded.prepared == finished, lines
    session = ortmem.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert session.ortmem_action == ("finished" if finished else "mapped"), lines
    assert np.array_equal(session.run(None, FEED)[0], _ort(model))
    if not finished:
        pytest.skip(f"this onnxruntime finishes nothing worth mapping here: {lines[-1]}")
    os.link(model, tmp_path / "another-name.onnx")  # moves the file's ctime: its record is walked again
    relinked = ortmem.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert relinked.ortmem_action == "finished"  # the mark outlives the record it was made in
    del relinked
    del session
    for d in (store_folder(True)).iterdir():
        if not d.name.startswith("."):
            shutil.rmtree(d)  # every entry gone, the records kept
    again = ortmem.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert again.ortmem_action == "mapped"
    assert np.array_equal(again.run(None, FEED)[0], _ort(model))


def test_a_start_of_a_file_with_a_record_searches_none_of_its_bytes(tmp_path: Path, walks: list[Path],
                                                                     monkeypatch: pytest.MonkeyPatch):
    """The record says whether the file holds DequantizeLinear, so a start of a file seen before neither
    searches its bytes nor walks it, whether ORT gets the file (or its skeleton) or ``ortmem prepare``'s
    finished entry; outputs are ORT's own."""
    import ortmem
    from ortmem.session import decide
    from ortmem.session.deploy import prepare_path

    rng = np.random.default_rng(7)
    plain = _settled(save(matmul_chain(rng, [64, 256, 8]), tmp_path / "models" / "plain.onnx"))
    prepared = _settled(save(matmul_chain(rng, [64, 512, 512, 512, 8]), tmp_path / "models" / "prepared.onnx"))
    assert prepare_path(prepared, say=lambda line: None) == 0
    first = {p: ortmem.InferenceSession(str(p), providers=["CPUExecutionProvider"]).ortmem_action
             for p in (plain, prepared)}
    searched: list[Path] = []
    real_search = decide.may_mention

    def counted(path: Path, needle: bytes) -> bool:
        searched.append(Path(path))
        return real_search(path, needle)

    monkeypatch.setattr(decide, "may_mention", counted)
    walks.clear()
    for path in (plain, prepared):
        session = ortmem.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert session.ortmem_action == first[path]
        assert np.array_equal(session.run(None, FEED)[0], _ort(path))
    assert not [p for p in searched if p in (plain, prepared)] and not walks
