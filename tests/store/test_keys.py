"""One test per cache-key field (finding 11): changing the field is a miss, and the session's outputs
equal plain ORT's under the new settings. Removing any field from ``ortmem.files.sources.converted_key`` makes
its test fail (the entry built under the old settings would be served)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.measure.synth import SynthConfig, write_model
from tests.support.compare import assert_same_outputs

FEEDS = {"input_ids": np.array([[1, 17, 5, 900, 42, 3]], dtype=np.int64)}


def _options(level=None, config: Optional[dict] = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    if level is not None:
        so.graph_optimization_level = level
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, v)
    return so


def _built(tmp_path: Path) -> tuple[Path, Path]:
    """A model and a cache holding its entry for default settings (checked to be a hit)."""
    folder = tmp_path / "m"
    folder.mkdir()
    path = write_model(SynthConfig.tiny(), folder / "model.onnx")
    cache = tmp_path / "cache"
    cold = ortmem.InferenceSession(path, cache=cache, prepacked=False)
    assert cold.ortmem_report is not None and cold.ortmem_report.converted > 0
    assert ortmem.InferenceSession(path, cache=cache, prepacked=False).ortmem_cache_hit
    return path, cache


def _miss_and_equal(path: Path, cache: Path, make_options: Callable[[], ort.SessionOptions], **kw) -> None:
    sess = ortmem.InferenceSession(path, make_options(), cache=cache, prepacked=False, **kw)
    assert not sess.ortmem_cache_hit, "an entry built under other settings was served"
    expected = ort.InferenceSession(str(path), make_options(), providers=["CPUExecutionProvider"],
                                    **kw).run(None, FEEDS)
    assert_same_outputs(sess.run(None, FEEDS), expected)


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   ort.GraphOptimizationLevel.ORT_ENABLE_BASIC])
def test_graph_optimization_level(tmp_path, level):
    path, cache = _built(tmp_path)
    _miss_and_equal(path, cache, lambda: _options(level=level))


@pytest.mark.parametrize("key,value", [("session.qdq_matmulnbits_accuracy_level", "0"),
                                       ("session.qdq_matmulnbits_block_size", "64"),
                                       ("session.disable_quant_qdq", "1")])
def test_session_config_entries(tmp_path, key, value):
    path, cache = _built(tmp_path)
    _miss_and_equal(path, cache, lambda: _options(config={key: value}))


def test_disabled_optimizers(tmp_path):
    path, cache = _built(tmp_path)
    _miss_and_equal(path, cache, _options, disabled_optimizers=["QDQSelectorActionTransformer"])


@pytest.mark.parametrize("module", ["onnxruntime", "onnx", "ortmem"])
def test_library_versions(tmp_path, monkeypatch, module):
    path, cache = _built(tmp_path)
    import ortmem.files.sources as sources

    target = {"onnxruntime": ort, "onnx": onnx, "ortmem": sources}[module]
    monkeypatch.setattr(target, "__version__", "0.0.0-other")
    _miss_and_equal(path, cache, _options)


def test_conversion_format(tmp_path, monkeypatch):
    path, cache = _built(tmp_path)
    import ortmem.files.sources as sources

    monkeypatch.setattr(sources, "CONVERSION_FORMAT", sources.CONVERSION_FORMAT + 1)
    _miss_and_equal(path, cache, _options)


def test_fp16_in_fp32(tmp_path):
    """The CPU EP runs a fused fp16 MatMulNBits in fp32 and CUDA/DML in fp16: the two forms have
    their own entries (asked of the handoff directly: no GPU here)."""
    from ortmem.session.decide import prepare
    from ortmem.session.request import Request

    folder = tmp_path / "m"
    folder.mkdir()
    path = write_model(SynthConfig.tiny(scale_dtype="float16", embedding="quantized"), folder / "model.onnx")
    cache = ortmem.store.cache.Cache(tmp_path / "cache")
    for fp16_in_fp32 in (None, False):
        h = prepare(path, Request(cache=cache, fp16_in_fp32=fp16_in_fp32))
        assert not h.cache_hit and h.report is not None
        h.cleanup()
    assert len(list(cache.entries())) == 2


def test_the_onnx_version_read_without_onnx_is_onnx_own():
    """A warm start keys its entry by onnx's version without importing onnx (the dist-info folder
    beside the package): it must be the ``onnx.__version__`` a cold start keyed it by."""
    import subprocess
    import sys

    probe = ("import sys\nfrom ortmem.files.sources import onnx_version\nv = onnx_version()\n"
             "assert 'onnx' not in sys.modules, 'onnx was imported'\nprint(v)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == onnx.__version__
