"""ortmem's own helper processes (the release probe, the background finisher, measurement children) never
run hooked and never write the user's cache except where their job is that cache.

Why: a program under ``python -m ortmem run`` exports ``ORTMEM_HOOK=1`` to every child interpreter. A
helper that inherited it would put its own ORT sessions through ortmem: the release probe then filled the
user's cache with one entry per question (145 for deleted temporary files) and compared ortmem's rewrite
with itself instead of with ORT's run of the original pattern. Real processes throughout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortmem.store.cache import Cache
from ortmem.base.child_env import ENV_OPTIONS, ENV_SWITCH, SITE_DIR, helper_environment
from ortmem.ort import release as rel
from tests.support import builders as mb

PROGRAM = """
import sys
import numpy as np
import onnxruntime
s = onnxruntime.InferenceSession(sys.argv[1])
print(type(s).__module__, float(s.run(None, {"x": np.ones((1, 256), np.float32)})[0].sum()))
"""


@pytest.mark.slow
def test_release_probe_under_a_hooked_program_runs_plain_and_leaves_no_cache_entries(tmp_path, rng):
    """A first hooked session on a fresh probe folder runs the probe: the cache then holds the program's
    own entry only, and the probe's answers are those of a probe started from an unhooked process."""
    model = mb.save(mb.int4_model(rng), tmp_path / "q.onnx")
    script = tmp_path / "app.py"
    script.write_text(PROGRAM)
    cache, probes = tmp_path / "cache", tmp_path / "probes"
    env = {**os.environ, "ORTMEM_CACHE_DIR": str(cache), "ORTMEM_PROBE_DIR": str(probes)}
    out = subprocess.run([sys.executable, "-m", "ortmem", "run", "--no-prepacked", "--", str(script), str(model)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ortmem.session.inference "), out.stdout  # the program itself was hooked
    entries = list(Cache(cache / "converted").entries())
    assert [Path(e.manifest()["source"]).resolve() for e in entries] == [model.resolve()], [e.path for e in entries]
    (answers_file,) = [f for f in probes.iterdir() if f.name == f"{rel.installed().key()}.json"]
    hooked_answers = json.loads(answers_file.read_text())
    plain_answers = rel.run_probe()  # this test process has no hook in its environment
    # What the answers decide, not their wording: ORT's messages name temporary paths, and on 1.25 a
    # 2048 block's fused kernel reads garbage (its answer is "equal" or "differs" from run to run, past
    # the bound where ortmem already stopped converting). A hooked probe compared ortmem's rewrite with
    # itself and so called everything convertible.
    assert _decisions(hooked_answers) == _decisions(plain_answers)


CHILD = ("import json, os, sys, onnxruntime;"
         "print(json.dumps([onnxruntime.InferenceSession.__module__, 'ortmem' in sys.modules,"
         " os.environ.get('ORTMEM_CACHE_DIR'), os.environ.get('PYTHONPATH', '')]))")


def test_helper_environment_starts_an_unhooked_interpreter_from_a_hooked_one(tmp_path, monkeypatch):
    """The launcher's exports (switch, options, sitecustomize folder) do not reach a helper; the helper
    imports this very ortmem; a private cache folder replaces the user's where asked."""
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv(ENV_OPTIONS, json.dumps({"cache": False}))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITE_DIR), str(tmp_path)]))
    hooked = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                            cwd=tmp_path)
    assert json.loads(hooked.stdout)[:2] == ["ortmem.intercept.session_hook", True]  # what a helper would get without it
    for private in (None, str(tmp_path / "own-cache")):
        env = helper_environment(cache_dir=private)
        assert ENV_SWITCH not in env and ENV_OPTIONS not in env
        module, loaded, cache_dir, pythonpath = json.loads(subprocess.run(
            [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, env=env, cwd=tmp_path).stdout)
        assert (module, loaded) == ("onnxruntime.capi.onnxruntime_inference_collection", False)
        assert cache_dir == (private or os.environ["ORTMEM_CACHE_DIR"])
        parts = pythonpath.split(os.pathsep)
        assert str(SITE_DIR) not in parts and str(tmp_path) in parts
        assert parts[0] == str(Path(rel.__file__).resolve().parents[2])  # the package's own parent first


def _decisions(answers: dict) -> dict:
    """Every verdict and release fact :func:`ortmem.ort.release.from_probe` draws from ``answers``."""
    caps = rel.from_probe(rel.installed(), answers).as_dict()
    return {k: ({key: v["ok"] for key, v in value.items()} if k in ("matmul", "gather") else value)
            for k, value in caps.items() if k not in ("notes", "import_baseline_bytes")}  # RSS: varies by a few KiB


@pytest.mark.parametrize("env", [
    {},  # $HOME/.cache
    {"XDG_CACHE_HOME": "/srv/cache"},
    {"HOME": "/home/someone"},
    {"XDG_CACHE_HOME": "relative/cache"},  # not absolute: platformdirs decides
    {"XDG_CACHE_HOME": "   "},
], ids=["home", "xdg", "other-home", "relative-xdg", "blank-xdg"])
def test_the_cache_folder_is_platformdirs_without_importing_it(env: dict[str, str]) -> None:
    """Fresh processes: the folder is the one platformdirs names, and where the XDG rule decides it,
    platformdirs is not imported (5-13 ms of imports in every hooked process)."""
    code = ("import sys; from ortmem.base.child_env import cache_folder; mine = str(cache_folder()); "
            "imported = 'platformdirs' in sys.modules; import platformdirs; "
            "print(mine == platformdirs.user_cache_dir('ortmem'), imported)")
    base = {k: v for k, v in os.environ.items() if k not in ("ORTMEM_CACHE_DIR", "XDG_CACHE_HOME")}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    same, imported = done.stdout.split()
    assert same == "True"
    fast = sys.platform == "linux" and os.path.isabs(env.get("XDG_CACHE_HOME") or env.get("HOME", base.get("HOME", "")))
    assert imported == str(not fast)
