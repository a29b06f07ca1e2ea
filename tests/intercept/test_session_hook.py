"""ortmem.hook(): which ways of creating an ORT session it reaches (and which not), silence, safety,
and the launcher (python -m ortmem run) on unmodified scripts. Real ORT sessions throughout; every
hooked output is compared with ORT's own on the same model."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import onnxruntime as ort
import pytest

import ortmem
from ortmem.onnxfile.scan import FOLDER_KEY
from ortmem.intercept.session_hook import MIN_BYTES, ORIGINAL, sessions, unhook
from tests.support import builders as mb
from tests.support.compare import assert_close_outputs
from tests.support.reference import run_plain

ORT_CLASS = ORIGINAL


@pytest.fixture
def model(tmp_path, rng):
    """An embedded model (weights inside the .onnx: ortmem maps them instead of letting ORT copy)."""
    path = mb.save(mb.matmul_chain(rng, [64, 128, 16]), tmp_path / "m.onnx")
    x = rng.standard_normal((1, 64), dtype=np.float32)
    return path, {"x": x}, run_plain(path, {"x": x})[0]


@pytest.fixture(autouse=True)
def _always_unhook():
    yield
    unhook()


@pytest.fixture
def session_path(monkeypatch):
    """Every model takes ortmem's session path, the light route off (a prepared entry is worth
    considering from 0 bytes): for tests of what that path does (its fallback, its class in children)."""
    monkeypatch.setenv("ORTMEM_PREPARE_MIN_BYTES", "0")


def _is_ortmem(session) -> bool:
    """ortmem made the session, or the hook's light route did (ORT's own object for a model that needs
    nothing of ortmem's session path, tagged with what it did: ortmem.onnxfile.scan)."""
    return isinstance(session, ortmem.InferenceSession) or getattr(session, "ortmem_action", None) in ("as-is", "mapped")


def _check(session, model) -> None:
    _, feeds, expected = model
    np.testing.assert_array_equal(session.run(None, feeds)[0], expected)


def test_reached_creation_paths(model):
    path = model[0]
    import onnxruntime.capi.onnxruntime_inference_collection as collection

    with ortmem.hook():
        from onnxruntime import InferenceSession  # a name imported after the hook

        made = {
            "onnxruntime.InferenceSession": ort.InferenceSession(str(path)),
            "from onnxruntime import (after)": InferenceSession(str(path), providers=["CPUExecutionProvider"]),
            "collection.InferenceSession": collection.InferenceSession(str(path)),
            "keyword path_or_bytes": ort.InferenceSession(path_or_bytes=str(path)),
            "pathlib.Path": ort.InferenceSession(path),
        }
        in_thread = []
        t = threading.Thread(target=lambda: in_thread.append(ort.InferenceSession(str(path))))
        t.start()
        t.join()
        made["a thread"] = in_thread[0]
        for how, session in made.items():
            assert _is_ortmem(session), how
            assert isinstance(session, ort.InferenceSession), how  # isinstance keeps working
            _check(session, model)
        assert isinstance(ORT_CLASS(str(path)), ort.InferenceSession)  # a plain session too
        assert {r.action for r in sessions()[-len(made):]} == {"mapped"}
    assert ort.InferenceSession is ORT_CLASS and collection.InferenceSession is ORT_CLASS
    assert not _is_ortmem(ort.InferenceSession(str(path)))


def test_module_global_bound_before_the_hook_is_rebound_and_restored(model):
    module = types.ModuleType("third_party_like")
    exec("from onnxruntime import InferenceSession\ndef make(p):\n    return InferenceSession(p)\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        ortmem.hook()
        session = module.make(str(model[0]))
        assert _is_ortmem(session)
        _check(session, model)
        unhook()
        assert module.InferenceSession is ORT_CLASS
        assert not _is_ortmem(module.make(str(model[0])))
    finally:
        del sys.modules[module.__name__]


def test_not_reached_closure_and_rebind_off(model):
    """Limits, as documented: a reference kept outside a module global before the hook, and a module
    global when rebinding is turned off, still create plain ORT sessions (which work)."""
    def factory(cls=ort.InferenceSession):  # bound now, before the hook
        return lambda p: cls(p)

    make = factory()
    module = types.ModuleType("bound_early")
    module.InferenceSession = ort.InferenceSession
    sys.modules[module.__name__] = module
    try:
        with ortmem.hook(rebind=False):
            closure_session = make(str(model[0]))
            global_session = module.InferenceSession(str(model[0]))
        for s in (closure_session, global_session):
            assert type(s) is ORT_CLASS
            _check(s, model)
    finally:
        del sys.modules[module.__name__]


def test_class_derived_after_the_hook_gets_plain_ort(model):
    with ortmem.hook():
        class Wrapped(ort.InferenceSession):
            def __init__(self, path):
                super().__init__(path, providers=["CPUExecutionProvider"])
                self.extra = True

        s = Wrapped(str(model[0]))
    assert type(s) is Wrapped and s.extra and not _is_ortmem(s)
    _check(s, model)


def test_callers_options_stay_as_given_and_ort_prints_no_warning(model, capfd):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.disable_prepacking", "1")
    capfd.readouterr()
    with ortmem.hook():
        first = ort.InferenceSession(str(model[0]), so)
        second = ort.InferenceSession(str(model[0]), sess_options=so)  # the same object again
    out, err = capfd.readouterr()
    assert "already exists" not in err and "W:onnxruntime" not in err and "ortmem" not in err, err
    _, feeds, _ = model
    expected = run_plain(model[0], feeds, so)[0]  # ORT with the same options
    for s in (first, second):
        assert _is_ortmem(s)
        np.testing.assert_array_equal(s.run(None, feeds)[0], expected)
        assert s.get_session_options().intra_op_num_threads == 1
    assert so.get_session_config_entry("session.disable_prepacking") == "1"
    with pytest.raises(Exception):  # never added: ORT raises for an absent key
        so.get_session_config_entry(FOLDER_KEY)


@pytest.mark.filterwarnings("ignore:Specified provider 'OpenVINOExecutionProvider'")
def test_models_ortmem_cannot_help_go_to_ort_untouched(model, rng, tmp_path):
    small = mb.matmul_chain(rng, [8, 8]).SerializeToString()
    assert len(small) < MIN_BYTES
    with ortmem.hook():
        s = ort.InferenceSession(small)
        other = ort.InferenceSession(str(model[0]), providers=["OpenVINOExecutionProvider", "CPUExecutionProvider"])
    assert type(s) is ORT_CLASS and type(other) is ORT_CLASS
    assert sessions()[-2].action.startswith("untouched: bytes model under")
    assert sessions()[-1].action.startswith("untouched: provider OpenVINOExecutionProvider")
    _check(other, model)
    so = ort.SessionOptions()
    with ortmem.hook(cache=False):
        # with the caller's options too: nothing to convert, its weights mapped (a conversion would go
        # into a private temporary folder); nothing (no in-memory file) is registered on `so`
        theirs = ort.InferenceSession(str(model[0]), so)
        own = ort.InferenceSession(str(model[0]))
    assert _is_ortmem(theirs) and sessions()[-2].action == "mapped"
    assert _is_ortmem(own)
    for s in (theirs, own):
        _check(s, model)
    assert ort.InferenceSession(str(model[0]), so, providers=["CPUExecutionProvider"]).run(None, model[1])  # `so` still plain


def test_big_bytes_model_is_mapped(rng):
    m = mb.matmul_chain(rng, [512, 1024])
    data = m.SerializeToString()
    assert len(data) > MIN_BYTES
    x = rng.standard_normal((1, 512), dtype=np.float32)
    with ortmem.hook():
        s = ort.InferenceSession(data)
    assert _is_ortmem(s) and sessions()[-1].action == "mapped"
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], run_plain(data, {"x": x})[0])


def test_ortmem_failure_falls_back_with_one_line_unless_strict(model, monkeypatch, caplog, session_path):
    import ortmem.session.inference

    def broken(*a, **k):
        raise RuntimeError("injected failure\nsecond line")

    monkeypatch.setattr(ortmem.session.inference, "prepare", broken)
    with caplog.at_level(logging.WARNING, logger="ortmem"), ortmem.hook():
        s = ort.InferenceSession(str(model[0]))
    assert type(s) is ORT_CLASS
    _check(s, model)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ortmem")]
    assert len(lines) == 1 and "injected failure" in lines[0] and "second line" not in lines[0]
    assert sessions()[-1].action.startswith("fallback: RuntimeError: injected failure")
    with ortmem.hook(strict=True), pytest.raises(RuntimeError, match="injected failure"):
        ort.InferenceSession(str(model[0]))


def test_a_fallback_prints_no_ep_error_banner_and_logs_once(model, monkeypatch, capfd, caplog, session_path):
    """ORT's __init__ answers a RuntimeError or ValueError from session creation with its "EP Error"
    banner on stdout and a retry on the CPU EP: ortmem's attempt must not trigger it (ORT's EP
    fallback is off while ortmem tries), so a failing attempt shows the application one warning only."""
    import ortmem.session.handoff

    def refuse(*a, **k):
        raise RuntimeError("injected failure inside session creation")

    monkeypatch.setattr(ortmem.session.handoff, "scoped_config", refuse)  # reached from ORT's own __init__
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="ortmem"), ortmem.hook():
        s = ort.InferenceSession(str(model[0]))
    out, err = capfd.readouterr()
    assert "EP Error" not in out + err, out + err
    assert type(s) is ORT_CLASS and s._enable_fallback  # ORT's own session, its EP fallback as ORT sets it
    _check(s, model)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ortmem")]
    assert len(lines) == 1 and "injected failure inside session creation" in lines[0], lines


def test_a_successful_session_keeps_ort_ep_fallback(model):
    """ortmem tries with ORT's EP fallback off; the session it returns has it as the caller asked."""
    with ortmem.hook():
        default = ort.InferenceSession(str(model[0]))
        off = ort.InferenceSession(str(model[0]), enable_fallback=0)
    assert _is_ortmem(default) and _is_ortmem(off)
    assert default._enable_fallback and not off._enable_fallback
    assert ORT_CLASS(str(model[0]))._enable_fallback and not ORT_CLASS(str(model[0]), enable_fallback=0)._enable_fallback


def test_a_model_ort_refuses_raises_what_ort_raises(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model at all" * 10)
    with pytest.raises(Exception) as plain:
        ORT_CLASS(str(bad))
    with ortmem.hook(), pytest.raises(Exception) as hooked:
        ort.InferenceSession(str(bad))
    assert type(hooked.value) is type(plain.value)


def test_qdq_model_is_converted_then_finished_without_recursing(tmp_path, rng):
    """ortmem's own sessions (ORT's finishing of the entry, here run in this hooked process) are made
    while the hook is on: they must go to ORT; the next start loads the finished model."""
    from ortmem.ort.release import capabilities
    from ortmem.store import finisher

    path = mb.save(mb.int4_model(rng), tmp_path / "q.onnx")
    x = rng.standard_normal((1, 256), dtype=np.float32)
    expected = run_plain(path, {"x": x})[0]
    with ortmem.hook():
        cold = ort.InferenceSession(str(path))
        start = cold.ortmem_handoff.start
        if capabilities().prepacked_save:
            before = len(sessions())
            finisher.run(finisher.FinishLater(str(start.cache.root), start.entry.key))
            assert len(sessions()) == before  # the finishing's sessions are ORT's own
        warm = ort.InferenceSession(str(path))
    warm_start = "finished" if capabilities().prepacked_save else "cache-hit"  # 1.25 saves none
    assert [r.action for r in sessions()[-2:]] == ["converted", warm_start]
    for s in (cold, warm):
        assert_close_outputs(s.run(None, {"x": x})[:1], [expected], rtol=1e-5, atol=1e-5)


SCRIPT = """
import json, sys
from onnxruntime import InferenceSession, SessionOptions
import numpy as np


def main():
    so = SessionOptions()
    s = InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
    x = np.ones((1, 64), dtype=np.float32)
    print(json.dumps({"cls": type(s).__module__, "argv": sys.argv[2:], "y": s.run(None, {"x": x})[0].tolist()}))
    if len(sys.argv) > 2 and sys.argv[2] == "--child":
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(1) as pool:
            print(json.dumps({"child": pool.apply(__import__("hooked_child").kind, (sys.argv[1],))}))


if __name__ == "__main__":
    main()
"""

CHILD = """
def kind(path):
    from onnxruntime import InferenceSession  # bound as onnxruntime finishes importing: the hook is in by then
    return type(InferenceSession(path)).__module__
"""


def _ortmem_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ortmem", *args]


def test_launcher_runs_an_unmodified_script_and_its_spawned_children(model, tmp_path, session_path):
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    (tmp_path / "hooked_child.py").write_text(CHILD)
    plain = subprocess.run([sys.executable, str(script), str(model[0])], capture_output=True, text=True, check=True)
    report = tmp_path / "report.json"
    hooked = subprocess.run(_ortmem_cmd("run", "--report", str(report), "--", str(script), str(model[0]), "--child"),
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert hooked.returncode == 0, hooked.stderr
    first, child = (json.loads(line) for line in hooked.stdout.splitlines())
    assert first["y"] == json.loads(plain.stdout)["y"] and first["argv"] == ["--child"]
    assert first["cls"] == "ortmem.session.inference" and child["child"] == "ortmem.session.inference"
    assert "W:onnxruntime" not in hooked.stderr and "Traceback" not in hooked.stderr, hooked.stderr
    data = json.loads(report.read_text())
    assert data["hook"] is True and data["onnxruntime"] == ort.__version__
    assert [s["action"] for s in data["sessions"]] == ["mapped"]  # the parent's own session
    assert data["process"]["peak_mib"] > 0 and data["sessions"][0]["create_seconds"] > 0


def test_launcher_module_form_exit_status_and_switch_off(model, tmp_path, session_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tool.py").write_text(SCRIPT.replace("    main()", "    main()\n    sys.exit(3)"))
    env_off = {**__import__("os").environ, "ORTMEM_HOOK": "0", "PYTHONPATH": str(tmp_path)}
    on = subprocess.run(_ortmem_cmd("run", "-m", "pkg.tool", str(model[0]), "-x"), capture_output=True, text=True,
                        cwd=tmp_path, env={**env_off, "ORTMEM_HOOK": "1"})
    off = subprocess.run(_ortmem_cmd("run", "-m", "pkg.tool", str(model[0]), "-x"), capture_output=True, text=True,
                         cwd=tmp_path, env=env_off)
    assert on.returncode == 3 and off.returncode == 3, on.stderr + off.stderr
    a, b = json.loads(on.stdout), json.loads(off.stdout)
    assert a["cls"] == "ortmem.session.inference" and b["cls"] == "onnxruntime.capi.onnxruntime_inference_collection"
    assert a["y"] == b["y"] and a["argv"] == ["-x"]


def test_children_get_only_the_options_that_differ_from_the_defaults(tmp_path, monkeypatch):
    """The launcher exports the hook's options to child interpreters as JSON only where they differ
    from the defaults (a default run imports no json for them), and clears a value a parent set."""
    script = tmp_path / "env.py"
    script.write_text("import os\nprint(os.environ.get('ORTMEM_HOOK'), os.environ.get('ORTMEM_HOOK_OPTIONS'))\n")
    monkeypatch.setenv("ORTMEM_HOOK_OPTIONS", '{"convert": false}')  # left by an outer hooked run

    def exported(*flags: str) -> str:
        done = subprocess.run(_ortmem_cmd("run", *flags, "--", str(script)), capture_output=True, text=True, check=True)
        return done.stdout.strip()

    assert exported() == "1 None"
    switch, options = exported("--no-trim", "--no-convert").split(" ", 1)
    assert switch == "1" and json.loads(options) == {"convert": False, "trim": False}


def test_launcher_compare_prints_both_runs(model, tmp_path):
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    out = subprocess.run(_ortmem_cmd("run", "--compare", "--repeat", "2", "--", str(script), str(model[0])),
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "hook off" in text and "hook on" in text and f"onnxruntime {ort.__version__}" in text
    assert "peak RSS (VmHWM) at exit, MiB" in text and "private (RssAnon) at exit, MiB" in text and "mapped" in text
    assert "median of 2 fresh process(es)" in text and "wall time, fastest, s" in text


def test_python_dash_m_ortmem_serves_every_subcommand(tmp_path):
    from ortmem.cli import COMMANDS

    helptext = subprocess.run(_ortmem_cmd("--help"), capture_output=True, text=True, check=True).stdout
    for name in COMMANDS:
        assert name in helptext
    listed = subprocess.run(_ortmem_cmd("cache", "list"), capture_output=True, text=True, check=True).stdout
    assert "entr" in listed
    missing = subprocess.run(_ortmem_cmd("run"), capture_output=True, text=True)
    assert missing.returncode == 2 and "give a program" in missing.stderr


@pytest.mark.parametrize("argv", [["--", "x.py", "--strict", "-m", "y"], ["x.py", "--no-trim"], ["--", "--help"], ["--"]])
def test_a_run_without_options_is_started_as_argparse_would_parse_it(argv):
    """``ortmem run -- script.py args`` skips argparse (ortmem.cli.main): the program and options it
    takes are exactly what the parser gives for the same command line."""
    from ortmem.cli.parser import build_parser
    from ortmem.intercept.launcher import bare_program, default_options, options_from

    args = build_parser("run").parse_args(["run", *argv])
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    assert bare_program(argv) == program and args.module is None
    assert options_from(args) == default_options()
    assert not (args.no_children or args.compare or args.report)


@pytest.mark.parametrize("argv", [[], ["-m", "pkg"], ["--strict", "--", "x.py"], ["--help"], ["--report", "r.json", "x.py"]])
def test_a_run_with_options_goes_through_the_parser(argv):
    from ortmem.intercept.launcher import bare_program

    assert bare_program(argv) is None


def test_a_run_without_options_imports_no_argparse(model, tmp_path):
    """The fresh process ``ortmem run -- script.py`` starts: the script's session is ortmem's (the hook
    was installed as its ``from onnxruntime import InferenceSession`` ran), and neither argparse nor
    its message catalogues (gettext) were imported to start it."""
    script = tmp_path / "script.py"
    script.write_text("import sys\n"
                      "from onnxruntime import InferenceSession\n"  # bound as onnxruntime is imported
                      "from ortmem.intercept.session_hook import report\n"
                      "s = InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
                      "print(report()[0]['action'], sorted(m for m in ('argparse', 'gettext') if m in sys.modules))\n")
    plain = subprocess.run([sys.executable, "-c", "import sys, onnxruntime, ortmem.intercept.session_hook; "
                            "print(sorted(m for m in ('argparse', 'gettext') if m in sys.modules))"],
                           capture_output=True, text=True, check=True)  # what this environment loads anyway
    done = subprocess.run(_ortmem_cmd("run", "--", str(script), str(model[0])), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mapped", *plain.stdout.split()]


def test_a_program_that_never_imports_onnxruntime_pays_for_neither_it_nor_the_hook(tmp_path):
    """``ortmem run`` on a program without ORT (a server's master process): the modules it loads that a
    plain run does not are the launcher's alone: no onnxruntime, no hook, and none of what
    ``importlib.abc`` would bring (tempfile). Its report says so."""
    script = tmp_path / "script.py"
    watched = ("onnxruntime", "numpy", "ortmem.intercept.session_hook", "importlib.abc", "tempfile")
    script.write_text(f"import sys\nprint(sorted(m for m in {watched!r} if m in sys.modules))\n")
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    report = tmp_path / "report.json"
    hooked = subprocess.run(_ortmem_cmd("run", "--report", str(report), "--", str(script)), capture_output=True,
                            text=True, timeout=120)
    assert hooked.returncode == 0 and hooked.stderr == "", hooked.stderr
    assert hooked.stdout == plain.stdout
    written = json.loads(report.read_text())
    assert written["onnxruntime"] == "not imported" and written["sessions"] == [] and written["hook"] is True


@pytest.mark.parametrize("target", [["missing.py"], ["-m", "no_such_module"], ["-m", "no_such_package.sub"],
                                    ["-m", "pkg"], ["raises_import.py"], ["raises_oserror.py"]])
def test_a_program_that_cannot_start_or_fails_ends_as_under_python(tmp_path, target):
    """What ``python`` prints and returns for a script it cannot open (2), a module it cannot find or
    run (1), and an ImportError or OSError the program raises itself (its traceback, 1), ``ortmem run``
    prints and returns too, byte for byte: no frame of the launcher's or runpy's in the traceback."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "raises_import.py").write_text("import no_such_module_here\n")
    (tmp_path / "raises_oserror.py").write_text("open('/nonexistent-ortmem-test/x')\n")
    args = target if target[0] == "-m" else ["--", *target]
    plain = subprocess.run([sys.executable, *target], capture_output=True, text=True, cwd=tmp_path)
    hooked = subprocess.run(_ortmem_cmd("run", *args), capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert hooked.returncode == plain.returncode != 0
    assert hooked.stderr == plain.stderr


def test_where_no_hard_link_can_be_made(rng, capfd):
    """A model on another file system than the temp folder and the cache (here /dev/shm, a tmpfs):
    ortmem's own options carry the folder entry instead; the caller's are left alone, so the path
    goes to ORT untouched."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from ortmem.store.cache import cache_root

    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    if os.stat(shm).st_dev in {os.stat(tempfile.gettempdir()).st_dev, os.stat(cache_root()).st_dev}:
        pytest.skip("/dev/shm shares a file system with the temp folder or the cache")
    folder = Path(tempfile.mkdtemp(dir=shm, prefix="ortmem-test-"))
    try:
        path = mb.save(mb.matmul_chain(rng, [64, 128, 16]), folder / "m.onnx")
        x = rng.standard_normal((1, 64), dtype=np.float32)
        expected = run_plain(path, {"x": x})[0]
        so = ort.SessionOptions()
        capfd.readouterr()
        with ortmem.hook():
            own = ort.InferenceSession(str(path))
            theirs = ort.InferenceSession(str(path), so)
        assert "W:onnxruntime" not in capfd.readouterr().err
        assert [r.action for r in sessions()[-2:]] == [
            "mapped", "untouched: no hard link possible beside the caller's SessionOptions"]
        assert _is_ortmem(own) and _is_ortmem(theirs)
        for s in (own, theirs):
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], expected)
        with pytest.raises(Exception):
            so.get_session_config_entry(FOLDER_KEY)
        assert sorted(p.name for p in folder.iterdir()) == ["m.onnx"]  # nothing written beside the model
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_launcher_sitecustomize_runs_the_one_it_shadows_and_waits_for_onnxruntime(tmp_path):
    from ortmem.intercept.launcher import SITE_DIR

    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIR_SITECUSTOMIZE_RAN = True\n")
    env = {**__import__("os").environ, "ORTMEM_HOOK": "1", "PYTHONPATH": f"{SITE_DIR}:{theirs}"}
    probe = ("import builtins, sys; print(getattr(builtins, 'THEIR_SITECUSTOMIZE_RAN', False),"
             "[m for m in ('ortmem', 'importlib.abc', 'tempfile') if m in sys.modules]);"
             "import onnxruntime; print(onnxruntime.InferenceSession.__name__)")
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    before_ort = plain.stdout.split()[1]  # what this environment loads anyway: the hook must add nothing to it
    assert "ortmem" not in before_ort and plain.stdout.split()[2] == "InferenceSession"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", before_ort, "HookedInferenceSession"], out.stderr


def test_cache_false_converts_with_the_callers_options_and_leaves_them_plain(tmp_path):
    """``hook(cache=False)`` and the caller's own ``SessionOptions``: a QDQ model is converted into a
    private temporary folder (ORT borrows no memory through the caller's object, so nothing is
    registered on it), outputs equal plain ORT's on the QDQ model, the folder is gone, and the same
    options object then creates a plain session of another model with that model's own outputs."""
    from ortmem.measure.synth import SynthConfig, write_model

    (tmp_path / "q").mkdir()
    (tmp_path / "o").mkdir()
    qdq = write_model(SynthConfig.tiny(storage="external"), tmp_path / "q" / "model.onnx")
    other = write_model(SynthConfig.tiny(storage="external", seed=5), tmp_path / "o" / "model.onnx")
    feeds = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}
    so = ort.SessionOptions()
    with ortmem.hook(cache=False):
        s = ort.InferenceSession(str(qdq), so, providers=["CPUExecutionProvider"])
    assert isinstance(s, ortmem.InferenceSession) and sessions()[-1].action == "converted-temporary"
    expected = ORIGINAL(str(qdq), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert_close_outputs(s.run(None, feeds), expected, atol=0, rtol=0)
    plain_other = ORIGINAL(str(other), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert_close_outputs(plain_other, ORIGINAL(str(other), providers=["CPUExecutionProvider"]).run(None, feeds), atol=0, rtol=0)
