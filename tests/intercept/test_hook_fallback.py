"""Where ortmem itself cannot work in a process, the program still runs as under plain python and plain
ORT: a folder named ``ortmem`` that shadows the installed package, ortmem's session path failing to
import, a program with an ``ortmem`` package of its own, a program that changes folder before its
report is written, a genai folder that cannot be written. Real programs in fresh processes, outputs
compared with plain ORT's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ortmem.intercept import plain_run
from tests.support import builders as mb
from tests.support.paths import REPO
from tests.support.reference import run_plain

#: A program that creates two sessions of one model and prints the first's output and class.
PROGRAM = textwrap.dedent("""\
    import json, os, sys
    import numpy as np
    {before}
    import onnxruntime as ort
    sessions = [ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"]) for _ in range(2)]
    y = sessions[0].run(None, {{"x": np.load(sys.argv[2])}})[0]
    {after}
    print(json.dumps({{"y": y.tolist(), "cls": type(sessions[0]).__module__, **extra}}))
    """)


def _program(folder: Path, before: str = "", after: str = "extra = {}") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "app.py"
    script.write_text(PROGRAM.format(before=before, after=after))
    return script


@pytest.fixture
def model(tmp_path, rng):
    """An embedded model, its input saved for the program, and plain ORT's output."""
    path = mb.save(mb.matmul_chain(rng, [64, 128, 16]), tmp_path / "models" / "m.onnx")
    x = rng.standard_normal((1, 64), dtype=np.float32)
    np.save(tmp_path / "models" / "x.npy", x)
    return path, tmp_path / "models" / "x.npy", run_plain(path, {"x": x})[0]


def _env() -> dict[str, str]:
    """This environment (the test's cache folder) with ortmem's session path taken for every model (a
    prepared entry considered from 0 bytes: the hook's light route off)."""
    return {**os.environ, "ORTMEM_PREPARE_MIN_BYTES": "0"}


def _ortmem(*args: str) -> list[str]:
    return [sys.executable, "-m", "ortmem", *args]


def _output(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def shadowed(tmp_path) -> Path:
    """A folder holding a folder named ``ortmem`` without ``__init__.py`` (a clone seen from its parent)
    that hides the installed package from ``python -m ortmem`` started there."""
    start = tmp_path / "start"
    (start / "ortmem").mkdir(parents=True)
    found = subprocess.run([sys.executable, "-c", "import ortmem; print(ortmem.__file__)"], cwd=start,
                           capture_output=True, text=True, check=True).stdout.strip()
    if found != "None":  # a regular install is found before a namespace folder: nothing is shadowed
        pytest.skip(f"a folder without __init__.py does not shadow this install of ortmem ({found})")
    return start


def test_a_folder_shadowing_the_package_leaves_the_programs_sessions_to_plain_ort(model, shadowed):
    path, x, expected = model
    _program(shadowed)
    done = subprocess.run(_ortmem("run", "--", "app.py", str(path), str(x)), cwd=shadowed, env=_env(),
                          capture_output=True, text=True, timeout=120)
    out = _output(done)
    np.testing.assert_array_equal(np.array(out["y"], dtype=np.float32), expected)
    assert out["cls"] == "onnxruntime.capi.onnxruntime_inference_collection"
    lines = done.stderr.splitlines()  # two sessions, one line: the cause, naming the folder
    assert len(lines) == 1, done.stderr
    assert "shadows the installed package" in lines[0] and os.path.realpath(shadowed / "ortmem") in lines[0]


def test_commands_run_where_a_folder_shadows_the_package_name_it_and_fail(model, shadowed, tmp_path):
    for args in (["--version"], ["convert", str(model[0]), str(tmp_path / "out")]):
        done = subprocess.run(_ortmem(*args), cwd=shadowed, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ortmem: error: "), done.stderr
        assert os.path.realpath(shadowed / "ortmem") in lines[0] and "shadows" in lines[0]


def test_a_session_path_that_cannot_be_imported_falls_back_once_for_the_process(model, tmp_path):
    """ortmem.hook() in a process where ortmem's session path cannot be imported (here: Python's own
    way of making a module unimportable): both sessions are plain ORT's, one warning names the error."""
    path, x, expected = model
    script = _program(tmp_path / "prog",
                      before="sys.modules['ortmem.session.decide'] = None\nimport ortmem\nortmem.hook()",
                      after="from ortmem.intercept.session_hook import report\n"
                            "extra = {'actions': [r['action'] for r in report()]}")
    done = subprocess.run([sys.executable, str(script), str(path), str(x)], env=_env(), capture_output=True,
                          text=True, timeout=120)
    out = _output(done)
    np.testing.assert_array_equal(np.array(out["y"], dtype=np.float32), expected)
    assert out["cls"] == "onnxruntime.capi.onnxruntime_inference_collection"
    assert len(out["actions"]) == 2 and all(a.startswith("fallback: ortmem cannot be imported") for a in out["actions"])
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "ortmem.session.decide" in lines[0] and "plain onnxruntime" in lines[0], done.stderr


def test_a_program_with_its_own_ortmem_package_imports_its_own_under_the_launcher(model, tmp_path):
    """The program's folder holds a package named ``ortmem``: plain python gives the program that one,
    and so does ``python -m ortmem run``, whose hook still makes the program's sessions with ortmem."""
    path, x, expected = model
    own = tmp_path / "proj" / "ortmem"
    own.mkdir(parents=True)
    (own / "__init__.py").write_text("WHO = 'the program'\n")
    after = "import ortmem as again\nextra = {'who': [getattr(m, 'WHO', m.__name__) for m in (ortmem, again)]}"
    script = _program(tmp_path / "proj", before="import ortmem", after=after)
    args = [str(script), str(path), str(x)]
    plain = _output(subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120))
    assert plain["who"] == ["the program", "the program"]
    hooked = _output(subprocess.run(_ortmem("run", "--", *args), capture_output=True, text=True, cwd=tmp_path,
                                    env=_env(), timeout=120))
    assert hooked["who"] == ["the program", "the program"]  # its own, before and after the hook's work
    assert hooked["cls"] == "ortmem.session.inference"
    np.testing.assert_array_equal(np.array(hooked["y"], dtype=np.float32), expected)


def test_a_relative_report_path_is_where_the_user_gave_it(model, tmp_path):
    """The program moves into its model's folder before it exits: ``--report r.json`` is still written
    in the folder the command was started from, by the launcher and by the plain runner alike."""
    path, x, _ = model
    script = _program(tmp_path / "prog", after="os.chdir(os.path.dirname(sys.argv[1]))\nextra = {}")
    start = tmp_path / "start"
    start.mkdir()
    for cmd in (_ortmem("run", "--report", "r.json", "--"), [sys.executable, plain_run.__file__, "plain.json", "--"]):
        _output(subprocess.run([*cmd, str(script), str(path), str(x)], capture_output=True, text=True, cwd=start,
                               timeout=120))
    assert len(json.loads((start / "r.json").read_text())["sessions"]) == 2
    assert json.loads((start / "plain.json").read_text())["onnxruntime"] != "not imported"
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.onnx", "x.npy"]  # nothing written beside the model


REWRITE = textwrap.dedent("""\
    import json, os, sys
    from pathlib import Path
    from ortmem.errors import OrtmemError
    from ortmem.session import genai
    from tests.support.genai_folder import build_genai_folder
    folder = build_genai_folder(Path(sys.argv[1]) / "tiny")
    genai.prepare_genai_folder(folder)
    config = (folder / genai.GENAI_CONFIG).read_bytes()
    os.chmod(folder, 0o555)
    try:
        genai.rewrite_config(folder)
    except OrtmemError as exc:
        print(json.dumps({"error": str(exc), "file": exc.file,
                          "unchanged": (folder / genai.GENAI_CONFIG).read_bytes() == config,
                          "left": sorted(p.name for p in folder.iterdir())}))
    """)


def _without_dac_override() -> None:
    """In the child, before it runs: root loses the capability that lets it write through permissions
    (dropped from the bounding set, so the program it executes never has it)."""
    import ctypes

    pr_capbset_drop, cap_dac_override = 24, 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_capbset_drop, cap_dac_override, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) refused")


def test_rewrite_config_on_a_read_only_folder_is_an_ortmem_error_naming_the_file(tmp_path):
    """A prepared genai folder its user cannot write (made 0555; root runs without CAP_DAC_OVERRIDE, with
    which it would write through permissions): rewrite_config raises OrtmemError naming the file and
    leaves the folder as it was."""
    as_root = _without_dac_override if os.geteuid() == 0 else None
    try:
        done = subprocess.run([sys.executable, "-c", REWRITE, str(tmp_path)], cwd=REPO, capture_output=True,
                              text=True, preexec_fn=as_root, timeout=120)
    except subprocess.SubprocessError as exc:  # a container that lets root keep every capability
        pytest.skip(f"root cannot give up CAP_DAC_OVERRIDE here ({exc})")
    finally:
        if (tmp_path / "tiny").exists():
            os.chmod(tmp_path / "tiny", 0o755)  # for pytest's clean-up
    assert done.returncode == 0, done.stderr
    assert done.stdout, f"rewrite_config raised no OrtmemError: {done.stderr}"
    out = json.loads(done.stdout)
    assert out["file"] == str(tmp_path / "tiny" / "genai_config.json.ortmem-backup") and out["file"] in out["error"]
    assert out["unchanged"] and not any(name.endswith(".tmp") for name in out["left"]), out
