"""sha256 of every file the conversion writes, for a fixed set of models: a refactor of the passes
must leave them byte-identical.

Run before and after a change to ``ortmem/passes`` and compare (``diff``)::

    python -m bench.converted_digests > before.txt   # on the old tree
    python -m bench.converted_digests > after.txt    # on the new tree
    diff before.txt after.txt

Three ways out of the same plan are covered, for every model:

* ``convert``: ``ortmem convert``'s folder (``model.onnx``, ``weights.bin``; ``conversion.json``
  holds a timing and is left out),
* ``cache``: a cache entry (``model.onnx``, ``weights.bin``, the hard-linked sources; the manifest
  holds times and paths, so only its ``digests`` and ``spans`` fields are printed),
* ``memory``: ``cache=False``'s anonymous buffer and skeleton (the buffer's random name replaced).

Models: synthetic tiny decoders (int4/uint4/int8/uint8/int2/uint2, with and without zero points, fp16
scales, a quantized embedding feeding Gather, external data, block 16) and the hand-built graphs of the
tests (every DQ+Gather matcher form; fp16 neighbourhoods where the fused node runs in fp32).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import onnx

import ortmem
from ortmem.store.cache import Cache
from ortmem.session.convert import convert_cached, convert_to
from ortmem.ort.settings import session_settings
from ortmem.session.inmemory import convert_in_memory
from ortmem.passes.engine import plan_conversion
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.dq_graphs import fp16_graphs, hand_gather_models

SYNTH = {
    "int4": {},
    "int4+zp": {"zero_points": True},
    "uint4": {"weight_type": "uint4"},
    "uint4+zp": {"weight_type": "uint4", "zero_points": True},
    "int8": {"weight_type": "int8"},
    "uint8+zp": {"weight_type": "uint8", "zero_points": True},
    "int2": {"weight_type": "int2"},
    "uint2+zp": {"weight_type": "uint2", "zero_points": True},
    "fp16": {"scale_dtype": "float16"},
    "fp16+zp+gather": {"scale_dtype": "float16", "zero_points": True, "embedding": "quantized"},
    "gather+external": {"embedding": "quantized", "storage": "external"},
    "uint4+zp+gather": {"weight_type": "uint4", "zero_points": True, "embedding": "quantized"},
    "block16+external": {"block_size": 16, "storage": "external"},
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def _file_sha(path: Path) -> str:
    return _sha(path.read_bytes())


def _models(work: Path) -> list[tuple[str, Path]]:
    out = []
    for name, kw in SYNTH.items():
        path = work / "synth" / name / "model.onnx"
        path.parent.mkdir(parents=True)
        out.append((f"synth/{name}", write_model(SynthConfig.tiny(**kw), path)))
    hand = {f"gather/{k}": m for k, (m, _) in hand_gather_models().items()}
    hand.update({f"fp16/{k}": m for k, (m, _) in fp16_graphs().items()})
    for name, m in hand.items():
        for storage in ("inline", "external"):
            path = work / "hand" / f"{name}-{storage}".replace("/", "_") / "model.onnx"
            path.parent.mkdir(parents=True)
            if storage == "external":
                onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="model.data",
                          size_threshold=0)
            else:
                onnx.save(m, path)
            out.append((f"{name}-{storage}", path))
    return out


def digests(work: Path) -> list[str]:
    lines = []
    settings = session_settings()
    cache = Cache(work / "cache")
    for label, path in _models(work):
        out = work / "out" / label.replace("/", "_")
        with ortmem.load(path) as model:
            convert_to(model, out, settings)
        for f in sorted(out.iterdir()):
            if f.name != "conversion.json":
                lines.append(f"{label} convert {f.name} {_file_sha(f)}")
        with ortmem.load(path) as model:
            entry, _, _ = convert_cached(model, settings, cache)
        if entry is None:
            lines.append(f"{label} cache (nothing to convert)")
        else:
            for f in sorted(entry.path.iterdir()):
                if f.name != "manifest.json":
                    lines.append(f"{label} cache {f.name} {_file_sha(f)}")
            m = entry.manifest()
            lines.append(f"{label} cache manifest.digests {json.dumps(m['digests'], sort_keys=True)}")
            lines.append(f"{label} cache manifest.spans {_sha(json.dumps(m['spans']).encode())}")
        with ortmem.load(path) as model:
            plan = plan_conversion(model, settings)
            conv = convert_in_memory(model, plan)
            lines.append(f"{label} memory buffer {_sha(bytes(conv.buffer))}")
            lines.append(f"{label} memory skeleton {_sha(conv.skeleton.replace(conv.name.encode(), b'MEM'))}")
            lines.append(f"{label} memory releasable {_sha(json.dumps(conv.releasable).encode())}")
    return lines


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ortmem-digests-") as tmp:
        os.environ.setdefault("ORTMEM_CACHE_DIR", str(Path(tmp) / "root"))
        for line in digests(Path(tmp)):
            print(line)


if __name__ == "__main__":
    main()
