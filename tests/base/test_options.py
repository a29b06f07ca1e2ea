"""ortmem never changes the caller's ``SessionOptions``.

Why: a conversion done in memory (``cache=False``, a cache that cannot be used, any bytes model)
registers its buffers on an options object. Were that the caller's, a plain-ORT session of another
model whose data file has the same name (``model.onnx.data``) reusing it would silently return the
*first* model's outputs, and a second ortmem session on the same options would raise ORT's "An entry
for this name has already been added". Each test below reuses one options object across ortmem and plain ORT sessions
of two different models with same-named data files, through one conversion path, and compares every
output with plain ORT on fresh options. Tolerance: bit-identical (same accuracy level, same ORT).
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.base.options import get_config
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.compare import assert_same_outputs
from tests.support.reference import run_plain

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
#: Every session config key ortmem has ever set on options it was given: none may be left behind.
ORTMEM_KEYS = ("session.use_external_initializer_file_buffers_directly",
               "session.model_external_initializers_file_folder_path")


def _two_models(tmp_path: Path) -> tuple[Path, Path]:
    """Two QDQ models with different weights, each beside a data file named ``model.onnx.data``."""
    paths = []
    for seed in (1, 2):
        path = tmp_path / f"m{seed}" / "model.onnx"
        path.parent.mkdir(parents=True)
        paths.append(write_model(SynthConfig.tiny(storage="external", seed=seed), path))
    assert (paths[0].parent / "model.onnx.data").is_file() and (paths[1].parent / "model.onnx.data").is_file()
    return paths[0], paths[1]


#: How each conversion path receives the model: (model argument, extra keyword arguments).
PATHS: dict[str, Callable[[Path], tuple[Any, dict[str, Any]]]] = {
    "path, cache=False": lambda p: (str(p), {"cache": False}),
    "bytes": lambda p: (onnx.load(str(p)).SerializeToString(), {}),
    "ModelProto": lambda p: (onnx.load(str(p)), {}),
    "ortmem.Model, cache=False": lambda p: (ortmem.load(p), {"cache": False}),
}


@pytest.mark.parametrize("how", sorted(PATHS))
def test_reused_options_give_every_model_its_own_outputs(tmp_path, how):
    first, second = _two_models(tmp_path)
    expected_first, expected_second = run_plain(first, FEEDS), run_plain(second, FEEDS)
    assert not np.array_equal(expected_first[0], expected_second[0])  # the models really differ
    options = ort.SessionOptions()
    model, kwargs = PATHS[how](first)
    converted = ortmem.InferenceSession(model, options, providers=["CPUExecutionProvider"], **kwargs)
    assert converted.ortmem_report is not None and converted.ortmem_report.converted > 0, converted.ortmem_action
    assert_same_outputs(converted.run(None, FEEDS), expected_first)
    for key in ORTMEM_KEYS:
        assert get_config(options, key) is None, f"{key} left on the caller's options"

    plain_second = ort.InferenceSession(str(second), options, providers=["CPUExecutionProvider"])
    assert_same_outputs(plain_second.run(None, FEEDS), expected_second)
    model, kwargs = PATHS[how](second)
    converted_second = ortmem.InferenceSession(model, options, providers=["CPUExecutionProvider"], **kwargs)
    assert_same_outputs(converted_second.run(None, FEEDS), expected_second)

    del converted, model
    gc.collect()  # whatever the first session held is gone: the options must not point into it
    again = ort.InferenceSession(str(second), options, providers=["CPUExecutionProvider"])
    assert_same_outputs(again.run(None, FEEDS), expected_second)
    assert_same_outputs(converted_second.run(None, FEEDS), expected_second)


def test_unusable_cache_with_caller_options_converts_without_touching_them(tmp_path, monkeypatch, caplog):
    """The cache folder cannot be made (its parent is a file): one warning, a conversion that
    leaves nothing on the options and nothing in the system temp folder."""
    first, second = _two_models(tmp_path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"")
    monkeypatch.setenv("ORTMEM_CACHE_DIR", str(blocker / "cache"))
    options = ort.SessionOptions()
    sess = ortmem.InferenceSession(str(first), options, providers=["CPUExecutionProvider"])
    assert sess.ortmem_action == "converted-temporary" and sess.ortmem_report.converted > 0
    assert_same_outputs(sess.run(None, FEEDS), run_plain(first, FEEDS))
    assert_same_outputs(ort.InferenceSession(str(second), options, providers=["CPUExecutionProvider"]).run(None, FEEDS),
                        run_plain(second, FEEDS))
    assert not Path(sess.ortmem_handoff.model).parent.exists()  # the private folder went after creation
    assert [r.levelname for r in caplog.records if r.name.startswith("ortmem")].count("WARNING") == 1


@pytest.mark.usefixtures("no_temp_folder")
def test_without_caller_options_the_conversion_stays_in_memory(tmp_path):
    """Options ortmem made itself may carry the in-memory files: the fast path is kept there."""
    first, _ = _two_models(tmp_path)
    sess = ortmem.InferenceSession(str(first), providers=["CPUExecutionProvider"], cache=False)
    assert sess.ortmem_action == "in-memory"
    assert_same_outputs(sess.run(None, FEEDS), run_plain(first, FEEDS))


def test_hooked_program_with_unusable_cache_keeps_its_options_clean(tmp_path):
    """An unmodified program under ``python -m ortmem run`` whose cache cannot be used (the case the
    audit hit with a full disk) and which reuses one options object for two models."""
    first, second = _two_models(tmp_path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"")
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent(f"""
        import numpy as np, onnxruntime as ort
        feeds = {{"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}}
        options = ort.SessionOptions()
        a = ort.InferenceSession({str(first)!r}, options, providers=["CPUExecutionProvider"])
        b = ort.InferenceSession({str(second)!r}, options, providers=["CPUExecutionProvider"])
        np.save({str(tmp_path / "a.npy")!r}, a.run(None, feeds)[0])
        np.save({str(tmp_path / "b.npy")!r}, b.run(None, feeds)[0])
    """))
    env = dict(os.environ, ORTMEM_CACHE_DIR=str(blocker / "cache"))
    done = subprocess.run([sys.executable, "-m", "ortmem", "run", str(program)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_same_outputs([np.load(tmp_path / "a.npy")], run_plain(first, FEEDS)[:1])
    assert_same_outputs([np.load(tmp_path / "b.npy")], run_plain(second, FEEDS)[:1])


@pytest.mark.usefixtures("no_temp_folder")
def test_in_memory_release_frees_the_pages_and_forbids_a_second_creation(tmp_path):
    """The released pages are really gone (they read back as zeros: MADV_REMOVE punched them out of
    the shared mapping; MADV_DONTNEED had left the memory allocated), so re-creating the session from
    that buffer (``set_providers``) must raise instead of letting ORT read zeros as weights."""
    first, _ = _two_models(tmp_path)
    sess = ortmem.InferenceSession(str(first), providers=["CPUExecutionProvider"], cache=False)
    memory = sess.ortmem_handoff.memory
    assert memory.released and memory.releasable
    buf = np.frombuffer(memory.buffer, np.uint8)
    assert all(not buf[offset:offset + length].any() for offset, length in memory.releasable)
    del buf
    assert_same_outputs(sess.run(None, FEEDS), run_plain(first, FEEDS))
    with pytest.raises(ortmem.OrtmemError, match="given back"):
        sess.set_providers(["CPUExecutionProvider"])
