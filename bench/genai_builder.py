"""onnxruntime-genai folders made by genai's own model builder: plain genai against ortmem's prepared folder.

    ORTMEM_CACHE_DIR=$(mktemp -d) python -m bench.genai_builder [-n 3] [--layers 4] [--only WORD] [--out DIR]

Each folder is what ``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e cpu``
makes of a random-weight Hugging Face model (:mod:`tests.support.genai_builder`; needs the ``genai``
extra): Qwen2.5-0.5B's widths with ``--layers`` layers and its tied embedding (int4: the embedding
reads the quantized head through GatherBlockQuantized; fp32: through a Transpose of the head, which
ORT folds at load), and an untied Llama with the same widths and Phi-3's vocabulary.

Each is measured as ``ortmem bench FOLDER -s genai -s genai-prepared -n N --workers 4`` measures it
(:func:`bench.model_classes.measure`: fresh processes, strategies interleaved, ``ortmem prepare``
unmeasured): ``og.Model(og.Config(FOLDER))`` against ``ortmem.session.genai.genai_model(FOLDER)``. A
run generates 8 tokens greedily from a fixed prompt; "same tokens+logits" means the hashes of the
sequence and every step's logits were equal in every process of both strategies.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from bench.model_classes import WORKERS, ModelClass, Row, measure_each
from ortmem.measure.text_table import align
from ortmem.store.cache import cache_root
from tests.support.genai_builder import BuilderShape, builder_folder, builder_problem, copy_folder


@dataclass(frozen=True)
class Folder:
    """One builder-made folder: its name in the table and what the builder is given."""

    name: str
    precision: str
    tied: bool
    vocab: int


#: Qwen2.5-0.5B's widths (hidden 896, MLP 4864, 14 heads over 2 KV heads of 64).
QWEN_WIDTHS = dict(hidden=896, ffn=4864, heads=14, kv_heads=2, context=2048, scale=0.5)
FOLDERS = (
    Folder("Qwen2.5-0.5B-like, tied, int4", "int4", True, 151936),
    Folder("Qwen2.5-0.5B-like, tied, fp32", "fp32", True, 151936),
    Folder("Llama/Phi-3-like, untied, int4", "int4", False, 32064),
    Folder("Llama/Phi-3-like, untied, fp32", "fp32", False, 32064),
)


def build(folder: Folder, layers: int, models: Path) -> Callable[[Path], Path]:
    """The builder's folder (built once under ``models``, kept), copied fresh into the run's folder."""
    def make(work: Path) -> Path:
        shape = BuilderShape(layers=layers, vocab=folder.vocab, **QWEN_WIDTHS)
        source = builder_folder(models, folder.precision, folder.tied, shape=shape, reuse=True)
        target = work / source.parent.name
        shutil.rmtree(target, ignore_errors=True)
        return copy_folder(source, target)
    return make


def render(rows: list[Row]) -> str:
    header = ["folder", "weights MiB", "ORT packs", "private genai", "private ortmem", "ratio",
              f"{WORKERS}p PSS genai", f"{WORKERS}p PSS ortmem", "ratio", "init genai s", "init ortmem s",
              "same tokens+logits"]
    table = [header]
    for r in rows:
        table.append([r.name, f"{r.weights_mib:.0f}", r.ort_packs, f"{r.plain_private:.0f}", f"{r.warm_private:.0f}",
                      f"{r.private_ratio:.2f}", f"{r.plain_pss4:.0f}", f"{r.warm_pss4:.0f}",
                      f"{r.warm_pss4 / r.plain_pss4:.2f}", f"{r.plain_init[1]:.2f}", f"{r.warm_init[1]:.2f}",
                      "yes" if r.identical else "NO"])
    notes = (f"private: RssAnon after generating, MiB, median of the fresh processes; {WORKERS}p PSS: total PSS "
             f"of {WORKERS} processes started together, each after generating, MiB; init: median seconds of "
             "model creation; ORT packs: initializers ORT saves pre-packed at the source graph's level")
    return "\n".join(align(table) + [notes])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--repeat", type=int, default=3, help="fresh processes per strategy (default 3)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of every model (default 4)")
    p.add_argument("--only", action="append", default=[], metavar="WORD",
                   help="measure only the folders whose name contains WORD (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON (default: cache/genai-builder)")
    args = p.parse_args(argv)
    problem = builder_problem()
    if problem:
        print(f"bench.genai_builder: {problem}", file=sys.stderr)
        return 2
    out = args.out or cache_root() / "genai-builder"
    models, work = out / "models", out / "runs"
    models.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    chosen = [ModelClass(folder.name, build(folder, args.layers, models), plain="genai", warm="genai-prepared")
              for folder in FOLDERS if not args.only or any(w.lower() in folder.name.lower() for w in args.only)]
    rows = measure_each(chosen, work, out, args.repeat, say)
    if not rows:
        return 1
    print(render(rows))
    (out / "genai-builder.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"json: {out / 'genai-builder.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
