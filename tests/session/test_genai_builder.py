"""``ortmem prepare`` and ``ortmem.session.genai`` on folders made by onnxruntime-genai's own model builder
(``python -m onnxruntime_genai.models.builder -p int4|fp32 -e cpu``) from random-weight Hugging Face models:
a tied-embedding Qwen2 (int4: GatherBlockQuantized over the shared head; fp32: Gather over a Transpose of
the head) and an untied Llama, each with GroupQueryAttention and symbolic past length and ``kv_cache_dim``.
Real builder output, real generation, fresh processes for memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.genai_builder import BuilderShape, builder_folder, builder_folders, builder_problem, copy_folder
from tests.support.genai_run import Generation, assert_same_generation, generate as run_generation

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")
if builder_problem():
    pytest.skip(builder_problem(), allow_module_level=True)

from ortmem.session import genai  # noqa: E402  (after the skips: genai's module is only for genai hosts)

PROMPT = [5, 6, 7, 8, 9]
MAX_LENGTH = 12
#: Big enough that ORT's packed MatMulNBits weights (about 50 MiB) stand well above what every genai
#: process holds anyway (the interpreter, genai, ORT, and ortmem's check and its imports).
MEMORY_SHAPE = BuilderShape(layers=4, hidden=1024, ffn=4096, heads=16, kv_heads=4, vocab=16384)
FOLDERS = {"tied-int4": ("int4", True), "untied-int4": ("int4", False), "tied-fp32": ("fp32", True)}


def generate(config) -> Generation:
    """Greedy generation from ``PROMPT``: the tokens and every step's logits."""
    return run_generation(config, PROMPT, MAX_LENGTH)


def assert_same(a: Generation, b: Generation) -> None:
    assert_same_generation(a, b, MAX_LENGTH - len(PROMPT))


def ortmem_prepare(folder: Path, cache: Path) -> subprocess.CompletedProcess:
    """``python -m ortmem prepare FOLDER`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ortmem", "prepare", str(folder)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "ORTMEM_CACHE_DIR": str(cache)})


class Prepared:
    """A builder-made folder copied and prepared by ``ortmem prepare``: the files it added and its output."""

    def __init__(self, name: str, folder: Path, before: set[str], proc: subprocess.CompletedProcess):
        self.name, self.folder, self.proc = name, folder, proc
        self.added = {p.name for p in folder.iterdir()} - before


def _prepared(tmp_path_factory, name: str, shape: BuilderShape = BuilderShape()) -> Prepared:
    precision, tied = FOLDERS[name]
    source = builder_folder(tmp_path_factory.getbasetemp(), precision, tied, shape=shape)
    folder = copy_folder(source, tmp_path_factory.mktemp(name) / "folder")
    before = {p.name for p in folder.iterdir()}
    return Prepared(name, folder, before, ortmem_prepare(folder, tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory) -> None:
    """Every folder this module uses, built at once (one child imports torch and transformers once)."""
    builder_folders(tmp_path_factory.getbasetemp(), [(p, t, BuilderShape()) for p, t in FOLDERS.values()]
                    + [(*FOLDERS["tied-int4"], MEMORY_SHAPE)])


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def prepared(request, tmp_path_factory) -> Prepared:
    return _prepared(tmp_path_factory, request.param)


# ------------------------------------------------------------------------------------------ tests
def test_builder_folder_has_the_traits_it_stands_for(prepared: Prepared):
    """The builder's decoder: GroupQueryAttention, symbolic past length and kv_cache_dim, and for a tied
    model the embedding read from the head's weight (GatherBlockQuantized in int4, Gather of a
    Transpose in fp32)."""
    import onnx

    model = onnx.load(str(prepared.folder / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert "GroupQueryAttention" in ops
    past = next(i for i in model.graph.input if i.name == "past_key_values.0.key")
    assert [d.dim_param for d in past.type.tensor_type.shape.dim][2:] == ["past_sequence_length", "kv_cache_dim"]
    embed = next(n for n in model.graph.node if "input_ids" in n.input)
    if prepared.name == "tied-int4":
        assert embed.op_type == "GatherBlockQuantized" and any(i.startswith("lm_head") for i in embed.input)
    elif prepared.name == "tied-fp32":
        transpose = next(n for n in model.graph.node if n.output[0] == embed.input[0])
        assert transpose.op_type == "Transpose" and transpose.input[0].startswith("lm_head")
    else:
        assert embed.op_type == "Gather" and embed.input[0] == "model.embed_tokens.weight"


def test_ortmem_prepare_prepares_the_builders_decoder(prepared: Prepared):
    """``ortmem prepare FOLDER`` exits 0 having prepared the decoder (not "nothing ORT packs"), and
    the config genai reads can name the prepared file."""
    assert prepared.proc.returncode == 0, prepared.proc.stderr
    assert "nothing" not in prepared.proc.stderr, prepared.proc.stderr  # was "nothing ORT packs" on exit 0
    onnx_files = {n for n in prepared.added if n.endswith(".onnx")}
    assert onnx_files and any(n.endswith(".data") for n in prepared.added), prepared.added
    genai.rewrite_config(prepared.folder)
    try:
        config = json.loads((prepared.folder / genai.GENAI_CONFIG).read_text())
        assert config["model"]["decoder"]["filename"] in onnx_files
    finally:
        genai.restore_config(prepared.folder)


def test_prepared_builder_folder_generates_the_same_tokens_and_logits(prepared: Prepared, caplog):
    plain = generate(og.Config(str(prepared.folder)))
    with caplog.at_level("WARNING", logger="ortmem"):
        config = genai.genai_config(prepared.folder)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # the prepared file is used
    assert_same(plain, generate(config))
    assert len(set(plain[0][len(PROMPT):])) > 1  # not two constant streams


# ------------------------------------------------------------------------------------------ memory
_CHILD = """
import json, sys
from pathlib import Path
import numpy as np
import onnxruntime_genai as og
folder, prepared = sys.argv[1], sys.argv[2] == "1"
if prepared:  # ortmem imported (and its cost counted) only where it is used
    from ortmem.session.genai import genai_model
model = genai_model(folder) if prepared else og.Model(og.Config(folder))
params = og.GeneratorParams(model)
params.set_search_options(max_length=12, do_sample=False)
gen = og.Generator(model, params)
gen.append_tokens(np.array([[5, 6, 7, 8, 9]], dtype=np.int32))
while not gen.is_done():
    gen.generate_next_token()
status = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l)
maps = {l.split(None, 5)[5] for l in Path("/proc/self/maps").read_text().splitlines() if len(l.split(None, 5)) == 6}
print(json.dumps({"anon": int(status["RssAnon"].split()[0]) * 1024,
                  "mapped": sorted(Path(m).name for m in maps if Path(m).parent == Path(folder).resolve())}))
"""


def _held(folder: Path, prepared: bool) -> dict:
    """RssAnon after generation, and which files of the folder are mapped, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), "1" if prepared else "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prepared_builder_folder_holds_far_less_private_memory(tmp_path_factory):
    """A builder-made int4 Qwen2-like folder: plain genai packs every MatMulNBits weight on each
    process's heap (about 50 MiB here); genai on the prepared folder maps them. Generous ceiling: half."""
    folder = _prepared(tmp_path_factory, "tied-int4", MEMORY_SHAPE)
    assert folder.proc.returncode == 0, folder.proc.stderr
    plain, mapped = _held(folder.folder, False), _held(folder.folder, True)
    data = {n for n in folder.added if n.endswith(".data")}
    assert data & set(mapped["mapped"]), mapped  # genai reads the prepared data
    print(f"\nprivate after generation: plain {plain['anon'] / 2**20:.0f} MiB, "
          f"prepared {mapped['anon'] / 2**20:.0f} MiB")
    assert mapped["anon"] <= 0.5 * plain["anon"]
