"""onnxruntime-genai folders made by genai's own model builder (``onnxruntime_genai.models.builder``), from a
random-weight Hugging Face model: what a user gets from ``python -m onnxruntime_genai.models.builder``, at a
size that builds in seconds.

Two architectures, chosen for the traits that matter to ortmem:

* ``tied=True``: a Qwen2 config with ``tie_word_embeddings`` (Qwen2.5, SmolLM2). In int4 the builder shares
  the quantized LM head with the embedding (``GatherBlockQuantized`` over ``lm_head``'s blocks); in fp32 the
  embedding is ``Gather(Transpose(lm_head weight))``, a Transpose ORT constant-folds at load.
* ``tied=False``: a Llama config (Phi-3 and Llama alike: separate embedding and head).

Both use GroupQueryAttention with a symbolic ``past_sequence_length`` and ``kv_cache_dim`` and
``num_key_value_heads`` below ``num_attention_heads``. Weights are drawn with ``initializer_range`` 0.5
(Hugging Face's 0.02 makes a random decoder repeat one token, and a comparison of two constant
streams proves little). The tokenizer is a word-level ``tokenizer.json`` written here: the builder
loads one with ``AutoTokenizer`` and copies it, genai generates from token ids and never needs it.

The build runs in a child process (torch and transformers stay out of the test process, whose memory
some tests measure), offline (``HF_HUB_OFFLINE``): nothing is fetched from a hub.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import pytest

#: What the builder imports beyond the test extra: ``pip install -e '.[genai]'`` installs them all.
BUILDER_MODULES = ("torch", "transformers", "onnx_ir", "onnxruntime_genai")
#: genai's builder, run as ``python -m``.
BUILDER = "onnxruntime_genai.models.builder"


@dataclass(frozen=True)
class BuilderShape:
    """The random model's sizes (Hugging Face config names). The default builds in about 10 s,
    most of it importing torch and transformers."""

    layers: int = 2
    hidden: int = 256
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    context: int = 256
    scale: float = 0.5  # initializer_range
    seed: int = 0


def builder_problem() -> Optional[str]:
    """Why genai's builder cannot run here (a module it imports is missing), or None."""
    missing = [name for name in BUILDER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        return f"genai's model builder needs {', '.join(missing)} (pip install -e '.[genai]')"
    if importlib.util.find_spec(BUILDER) is None:
        return f"this onnxruntime-genai has no {BUILDER}"
    return None


# The child: for each request, a random Hugging Face model folder, then genai's builder on it (one
# interpreter for all: torch and transformers are imported once). Argument: the JSON list of requests.
_CHILD = r"""
import json, runpy, shutil, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

for req in json.loads(sys.argv[1]):
    s, hf = req["shape"], Path(req["hf"])
    torch.manual_seed(s["seed"])
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  num_key_value_heads=s["kv_heads"], max_position_embeddings=s["context"],
                  initializer_range=s["scale"], tie_word_embeddings=req["tied"],
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if req["tied"]:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(hf)
    del model
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, s["vocab"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<unk>").save_pretrained(hf)
    sys.argv = ["builder", "-i", str(hf), "-o", req["out"], "-p", req["precision"], "-e", "cpu", "-c", req["cache"]]
    runpy.run_module("%s", run_name="__main__", alter_sys=True)
    shutil.rmtree(hf)  # the fp32 safetensors: not needed again
    shutil.rmtree(req["cache"], ignore_errors=True)
""" % BUILDER

_built: dict[tuple, Path] = {}


#: ``(precision, tied, shape)``: one folder's request.
Spec = tuple[str, bool, BuilderShape]


def builder_folders(tmp: Path, specs: list[Spec], *, timeout: float = 600.0, reuse: bool = False) -> list[Path]:
    """Genai folders made by genai's builder (``-p PRECISION -e cpu``) under ``tmp``, one per
    ``(precision, tied, shape)``, each built once per test session (the missing ones in one child
    process): callers that write into one copy it first (:func:`copy_folder`). ``reuse``: a folder an
    earlier process built under ``tmp`` is taken as it is (benchmarks). Skips the test, saying what is
    missing, where the builder cannot run."""
    problem = builder_problem()
    if problem:
        pytest.skip(problem)
    requests = []
    for precision, tied, shape in specs:
        done = _built.get((precision, tied, shape))
        if done is not None and (done / "genai_config.json").is_file():
            continue
        work = Path(tmp) / f"builder-{_name(precision, tied, shape)}"
        if reuse and (work / "genai" / "genai_config.json").is_file():
            _built[(precision, tied, shape)] = work / "genai"
            continue
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        requests.append({"precision": precision, "tied": tied, "shape": asdict(shape), "hf": str(work / "hf"),
                         "out": str(work / "genai"), "cache": str(work / "cache")})
    if requests:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HOME": str(Path(tmp) / "hf-home")}
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(requests)], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=tmp)
        for req in requests:
            if not (Path(req["out"]) / "genai_config.json").is_file():
                raise RuntimeError(f"genai's builder failed on a random {Path(req['out']).parent.name[8:]} model "
                                   f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        for req in requests:
            _built[(req["precision"], req["tied"], BuilderShape(**req["shape"]))] = Path(req["out"])
    return [_built[(precision, tied, shape)] for precision, tied, shape in specs]


def builder_folder(tmp: Path, precision: str = "int4", tied: bool = True, *,
                   shape: BuilderShape = BuilderShape(), timeout: float = 600.0, reuse: bool = False) -> Path:
    """One folder of :func:`builder_folders`."""
    return builder_folders(tmp, [(precision, tied, shape)], timeout=timeout, reuse=reuse)[0]


def _name(precision: str, tied: bool, shape: BuilderShape) -> str:
    return f"{'tied' if tied else 'untied'}-{precision}-{shape.layers}x{shape.hidden}x{shape.vocab}"


def copy_folder(src: Path, dst: Path) -> Path:
    """A copy of a builder-made folder to prepare or measure (a prepared file records its source's
    identity, so each copy is prepared on its own)."""
    shutil.copytree(src, dst)
    return dst
