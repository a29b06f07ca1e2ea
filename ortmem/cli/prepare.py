"""``ortmem prepare``: build ahead of time (a container image build) everything a warm start maps.

Parsing only; the work is :func:`ortmem.session.deploy.prepare_path`, whose exit status this returns.
"""
from __future__ import annotations

import argparse
from pathlib import Path

NAME = "prepare"
HELP = "build the cache entries warm starts map (ORT's finished model, converted first where ortmem converts), for a model or a folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx model, or a folder: every .onnx in it (genai folders through ortmem.session.genai)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="the cache folder the serving processes use (default: $ORTMEM_CACHE_DIR's, as a session's)")


def run(args: argparse.Namespace) -> int:
    from ortmem.session.deploy import prepare_path
    from ortmem.store.cache import Cache

    return prepare_path(Path(args.model), Cache(Path(args.cache)) if args.cache else None)
