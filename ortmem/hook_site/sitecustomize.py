"""Installs ``ortmem.hook()`` in every Python interpreter started with ``$ORTMEM_HOOK=1`` and this folder
on ``$PYTHONPATH`` (``python -m ortmem run`` sets both for the programs it runs, so child processes a
program or its process manager starts get the hook too). Python imports one ``sitecustomize``: the one
this file shadows (a distribution's, a virtual environment's) is run afterwards.
"""
import os
import runpy
import sys


def _install() -> None:
    if os.environ.get("ORTMEM_HOOK") != "1":
        return
    try:
        from ortmem.hook import hook_from_environment

        hook_from_environment()
    except Exception as exc:  # noqa: BLE001 - a broken hook must never stop the interpreter
        print(f"ortmem: hook not installed in this process ({type(exc).__name__}: {exc})", file=sys.stderr)


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


_install()
_run_shadowed()
