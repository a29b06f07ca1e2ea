"""Installs ``ortmem.hook()`` in every Python interpreter started with ``$ORTMEM_HOOK=1`` and this folder
on ``$PYTHONPATH`` (``python -m ortmem run`` sets both for the programs it runs, so child processes a
program or its process manager starts get the hook too).

The hook is installed when the interpreter first imports ``onnxruntime`` (a finder on
``sys.meta_path`` waits for it), so a child that never uses ORT pays nothing, not even ortmem's
import. Python imports one ``sitecustomize``: the one this file shadows (a distribution's, a virtual
environment's) is run afterwards.
"""
import importlib.abc
import os
import runpy
import sys


def _install() -> None:
    try:
        from ortmem.reach.session_hook import hook_from_environment

        hook_from_environment()
    except Exception as exc:  # noqa: BLE001 - a broken hook must never stop the program
        print(f"ortmem: hook not installed in this process ({type(exc).__name__}: {exc})", file=sys.stderr)


class _AfterOnnxruntime(importlib.abc.MetaPathFinder):
    """Lets ``onnxruntime`` import as usual, then installs the hook right after it and leaves."""

    def find_spec(self, name, path=None, target=None):
        if name != "onnxruntime":
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            sys.modules[name] = module  # ortmem imports onnxruntime: give it this one
            _install()

        spec.loader.exec_module = exec_then_hook
        return spec


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


# ortmem.helper_env.ENV_SWITCH, spelled out: this file runs in every child and imports ortmem only once
# the child imports onnxruntime. ortmem's own helper processes are started without it (helper_environment).
if os.environ.get("ORTMEM_HOOK") == "1":
    if "onnxruntime" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _AfterOnnxruntime())
_run_shadowed()
