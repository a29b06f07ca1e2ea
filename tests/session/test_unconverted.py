"""Fresh-process memory: an embedded model through ortmem costs what its external-data copy costs
under plain ORT (the foundation issue's target is <= 1.02x; asserted here with a margin for CI noise,
the measured ratios are in docs/benchmarks.md)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import ortmem.session.inference  # noqa: F401  (imported with this module, before the probe's clock: see below)
from ortmem.measure.probe import probe
from ortmem.measure.strategies import create_ortmem_nocache
from ortmem.onnxfile.walk import iter_tensor_sites
from tests.support import builders as mb

pytestmark = pytest.mark.slow

MARGIN = 1.10  # target 1.02; fresh-process peaks on a shared 2-core box move by a few percent
MiB = 1 << 20
FIXED_COST_BYTES = 6 * MiB  # what a small model may exceed ORT by whatever its weights (see below)
#: The question here is copies of the weights, not the import cost of a first ortmem call (onnx and the
#: session path, ~15-18 MiB, which the bench's ortmem columns include): this strategy's
#: module (this file, imported by the child before its clock) has imported the session path already.
NOCACHE = f"{os.path.abspath(__file__)}:create_nocache_preimported"


def create_nocache_preimported(model: str, options: dict):
    """``ortmem.InferenceSession(cache=False)``, its session path imported before the clock."""
    return create_ortmem_nocache(model, options)


def _shapes(rng):
    return {
        # one huge tensor (64 MiB table) and a few medium ones
        "huge": mb.embedding_model(rng, vocab=16384, hidden=1024, out=1024),
        # thousands of 1 KiB tensors, under the inline threshold (8 MiB in all: enough that
        # one extra copy of every weight shows above fresh-process noise)
        "many_small": mb.many_small(rng, 12000, width=256),
        # If/Loop bodies, a Constant node and a sparse initializer
        "subgraphs": mb.subgraph_model(rng, n=1024),
    }


@pytest.mark.parametrize("shape", ["huge", "many_small", "subgraphs"])
def test_embedded_through_ortmem_costs_what_external_costs_under_ort(tmp_path, shape):
    model = _shapes(np.random.default_rng(0))[shape]
    embedded = mb.save(model, tmp_path / "emb" / "m.onnx")
    external = mb.save(model, tmp_path / "ext" / "m.onnx", external=True)
    options = {"dims": {"batch": 1, "seq": 4}}
    if shape == "subgraphs":
        options = {}
    ort_emb = probe("ort", str(embedded), options=options)
    ort_ext = probe("ort", str(external), options=options)
    ortmem_emb = probe(NOCACHE, str(embedded), options=options)
    assert ortmem_emb.output_hash == ort_ext.output_hash == ort_emb.output_hash
    ratio = ortmem_emb.peak_above_baseline_bytes / ort_ext.peak_above_baseline_bytes
    print(f"{shape}: ORT embedded +{ort_emb.peak_above_baseline_bytes / MiB:.1f} MiB, "
          f"ORT external +{ort_ext.peak_above_baseline_bytes / MiB:.1f}, "
          f"ortmem embedded +{ortmem_emb.peak_above_baseline_bytes / MiB:.1f} (x{ratio:.3f})")
    # A ratio hides a copy of small weights under a large fixed cost: bound the excess by the weight
    # bytes too, so an extra copy of every weight (+1.0x their bytes) always fails.
    weight_bytes = sum(len(site.tensor.raw_data) for site in iter_tensor_sites(model))
    excess = ortmem_emb.peak_above_baseline_bytes - ort_ext.peak_above_baseline_bytes
    # ...and the ratio, where a fixed cost independent of the weights (ORT reads a skeleton file through
    # a 4 MiB buffer: +4.7 MiB on the small subgraph model with onnxruntime 1.31.1) is not the question
    assert ratio <= MARGIN or excess <= FIXED_COST_BYTES, f"x{ratio:.3f}, +{excess / MiB:.1f} MiB"
    assert excess <= 0.5 * weight_bytes, f"+{excess / MiB:.1f} MiB over ORT on {weight_bytes / MiB:.1f} MiB of weights"
    if shape == "huge":  # where embedded weights dominate, ORT pays for them twice and ortmem does not
        assert ortmem_emb.peak_above_baseline_bytes < 0.6 * ort_emb.peak_above_baseline_bytes


def test_external_through_ortmem_is_never_worse(tmp_path):
    model = mb.embedding_model(np.random.default_rng(1), vocab=16384, hidden=1024, out=1024)
    external = mb.save(model, tmp_path / "m.onnx", external=True)
    options = {"dims": {"batch": 1, "seq": 4}}
    a = probe("ort", str(external), options=options)
    b = probe(NOCACHE, str(external), options=options)
    assert b.output_hash == a.output_hash
    assert b.peak_above_baseline_bytes <= MARGIN * a.peak_above_baseline_bytes
