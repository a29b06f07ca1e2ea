"""Installs ``ortmem.hook()`` in every Python interpreter started with ``$ORTMEM_HOOK=1`` and this folder
on ``$PYTHONPATH`` (``python -m ortmem run`` sets both for the programs it runs, so child processes a
program or its process manager starts get the hook too).

The hook is installed when the interpreter first imports ``onnxruntime`` (a finder on
``sys.meta_path`` waits for it), so a child that never uses ORT pays nothing, not even ortmem's
import. Python imports one ``sitecustomize``: the one this file shadows (a distribution's, a virtual
environment's) is run afterwards.

The launcher's own process waits the same way: ``ortmem.intercept.launcher`` imports this file by its
package name (``ortmem.intercept.site.sitecustomize``, where the start-up code below does not run)
for :func:`after_onnxruntime`.
"""
import os
import runpy
import sys


def after_onnxruntime(install):
    """Call ``install()`` (which installs the hook) once this interpreter has imported onnxruntime: now
    if it has, else right after it does, before the importer gets the module (so no name is bound to
    ORT's class yet). ``install`` returns None, or why it installed nothing (printed in one line); an
    exception from it is printed in one line too, never raised into the program's ``import
    onnxruntime``: either way the program's sessions are plain onnxruntime's."""
    if "onnxruntime" in sys.modules:
        _install(install)
    else:
        sys.meta_path.insert(0, _AfterOnnxruntime(install))


def _install(install) -> None:
    try:
        why = install()
    except Exception as exc:  # noqa: BLE001 - a broken hook must never stop the program
        why = f"hook not installed in this process ({type(exc).__name__}: {exc})"
    if why:
        print(f"ortmem: {why}; sessions run as plain onnxruntime", file=sys.stderr)


def _hook_from_environment():
    """The hook of a child interpreter; why not, where its ``ortmem`` is not this package."""
    from ortmem.intercept.own_package import problem

    why = problem()
    if why is not None:
        return why
    from ortmem.intercept.session_hook import hook_from_environment

    hook_from_environment()
    return None


class _AfterOnnxruntime:
    """Lets ``onnxruntime`` import as usual, then calls ``install`` right after it and leaves.

    A meta path finder by its ``find_spec`` alone: deriving from ``importlib.abc.MetaPathFinder``
    would import ``importlib.abc`` (with importlib.resources, tempfile, shutil, bz2 and lzma), 9 ms of
    every hooked interpreter's start, ORT or not."""

    def __init__(self, install):
        self.install = install

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
            _install(self.install)

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


# ortmem.base.child_env.ENV_SWITCH, spelled out: this file runs in every child and imports ortmem only once
# the child imports onnxruntime. ortmem's own helper processes are started without it (helper_environment).
if __name__ == "sitecustomize":  # imported by Python at start-up, not by the launcher
    if os.environ.get("ORTMEM_HOOK") == "1":
        after_onnxruntime(_hook_from_environment)
    _run_shadowed()
