"""The environment of ortmem's own helper processes: the release probe, the background finisher, measurement
children. One function, so every helper is started the same way.

Why: ``python -m ortmem run`` exports the hook to every Python child of the program it runs (the switch
below, its options and :data:`SITE_DIR` on ``$PYTHONPATH``). A helper that inherited them would put its
own ORT sessions through ortmem: the release probe then wrote one cache entry per question into the
user's cache and compared ortmem's rewrite with itself instead of with ORT's run of the original
pattern. A helper therefore starts unhooked, imports this very ortmem (not whichever one the program's
path would find), and, where its job is not the user's cache, gets a private cache folder instead.

This module imports nothing from ortmem: it sits at the bottom of the package with ``errors`` so that
``ortmodel`` may use it without climbing a layer.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Union

#: Read by ``python -m ortmem run`` and by the hook's sitecustomize in child interpreters: "1" installs the
#: hook, "0" runs the program plain.
ENV_SWITCH = "ORTMEM_HOOK"
#: JSON of ``session_hook.HookOptions`` fields, passed by the launcher to child interpreters.
ENV_OPTIONS = "ORTMEM_HOOK_OPTIONS"
#: The folder whose ``sitecustomize.py`` installs the hook in child interpreters.
SITE_DIR = Path(__file__).resolve().parent.parent / "intercept" / "site"
#: The folder holding this ``ortmem`` package: first on a helper's ``$PYTHONPATH``.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
#: Where :func:`cache_folder` looks for the cache folder.
CACHE_DIR_ENV = "ORTMEM_CACHE_DIR"


def cache_folder() -> Path:
    """Where ortmem's cache folder is: ``$ORTMEM_CACHE_DIR``, else the platform's user cache folder.

    Not created here: :func:`ortmem.store.cache.cache_root` creates it private for the store, and
    :mod:`ortmem.ort.release` keeps its probe answers under it (one definition of the place, so
    the release model needs nothing of the store).

    The platform's folder is ``platformdirs.user_cache_dir("ortmem")``, whose Linux rule (the XDG
    Base Directory spec: an absolute ``$XDG_CACHE_HOME``, else ``$HOME/.cache``) is applied here
    without importing it where the environment leaves no doubt: importing platformdirs imports
    tempfile, shutil, bz2 and lzma, milliseconds that the hook (which looks for handoff records in
    the store on every model it hands to ORT) would add to every hooked process.
    ``tests/base/test_child_env.py`` checks the two agree; anything else (a relative or blank variable,
    Android, another platform) asks platformdirs."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root)
    xdg, home = os.environ.get("XDG_CACHE_HOME", ""), os.environ.get("HOME", "")
    if (sys.platform == "linux" and "ANDROID_DATA" not in os.environ
            and (os.path.isabs(xdg) if xdg else os.path.isabs(home))):
        return Path(xdg or os.path.join(home, ".cache")) / "ortmem"
    import platformdirs

    return Path(platformdirs.user_cache_dir("ortmem"))


#: The store's folder under the cache folder (:class:`ortmem.store.cache.Cache`'s default root).
STORE_FOLDER = "converted"


def store_folder(cache: Union[bool, str, os.PathLike]) -> Path:
    """The store's folder for a ``cache=`` option other than False: the default one under
    :func:`cache_folder` for True, else the folder given (not created here)."""
    return cache_folder() / STORE_FOLDER if cache is True else Path(cache)


def helper_environment(*, cache_dir: Optional[str] = None, **extra: str) -> dict[str, str]:
    """``os.environ`` for a helper process: without the hook's switch, options and sitecustomize folder,
    with this ortmem's parent folder first on ``$PYTHONPATH``; ``cache_dir`` replaces the cache folder
    (a helper that must not write the user's cache passes a private one); ``extra`` is added as given."""
    env = dict(os.environ)
    env.pop(ENV_SWITCH, None)
    env.pop(ENV_OPTIONS, None)
    site = os.path.normpath(SITE_DIR)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.normpath(p) != site]
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_PARENT), *(p for p in paths if p != str(PACKAGE_PARENT))])
    if cache_dir is not None:
        env[CACHE_DIR_ENV] = cache_dir
    env.update(extra)
    return env
