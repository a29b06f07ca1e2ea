"""Every QDQ variant through ``ortmem.InferenceSession`` equals ORT's own run of the QDQ model, on
whatever release is installed.

2/4/8-bit, signed and unsigned, with and without zero points, float and fp16 scales, accuracy levels 0
and 4, block sizes 16..512: ortmem converts exactly the variants the installed release allows
(``ortmem.ort.release``, table + probe), the converted entry runs on this ORT, and the outputs are
bit-identical to ORT's session on the QDQ model with the same accuracy level. Where ORT itself cannot run
its own fused model (1.25: 2-bit with fp16 scales), ortmem must fail the same way, never differently.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortmem
from ortmem.store.cache import Cache
from ortmem.ort.release import capabilities
from ortmem.ort.variants import ACCURACY_LEVELS, SCALE_TYPES, WEIGHT_TYPES, dq_matmul_model
from tests.support.reference import run_plain
from tests.support.release_expect import matmul_refusal

VARIANTS = [pytest.param(w, z, s, a, 32, id=f"{w}-{'zp' if z else 'nozp'}-{s}-acc{a}")
            for w, z, s, a in itertools.product(WEIGHT_TYPES, (False, True), SCALE_TYPES, ACCURACY_LEVELS)]
VARIANTS += [pytest.param("int4", False, "float", 4, b, id=f"int4-block{b}") for b in (16, 128, 256, 512)]


def _options(accuracy: int) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    return so


@pytest.mark.parametrize("wtype,zp,stype,acc,block", VARIANTS)
def test_session_equals_ort_on_the_qdq_model(wtype, zp, stype, acc, block, tmp_path):
    m = dq_matmul_model(wtype, stype, block, zp, seed=11, n=64)
    path = tmp_path / "qdq.onnx"
    onnx.save(m, path, save_as_external_data=True, location="qdq.data", size_threshold=0)
    k = 2 * block
    x = np.random.default_rng(5).standard_normal((2, k)).astype(np.float16 if stype == "float16" else np.float32)
    try:
        expected = run_plain(path, {"A": x}, _options(acc))
    except Exception as exc:  # noqa: BLE001 - ORT's own run fails: ortmem must fail likewise, not differently
        with pytest.raises(type(exc)):
            ortmem.InferenceSession(path, _options(acc), providers=["CPUExecutionProvider"],
                                    cache=tmp_path / "cache").run(None, {"A": x})
        assert matmul_refusal(wtype, zp, stype, acc, block), "ortmem converted a variant ORT cannot run"
        return
    sess = ortmem.InferenceSession(path, _options(acc), providers=["CPUExecutionProvider"], cache=tmp_path / "cache")
    got = sess.run(None, {"A": x})
    if block > capabilities().convert_block_max:
        # ORT fuses this block size itself but its kernel is wrong here (1.25: garbage that differs from
        # session to session); ortmem hands ORT the QDQ model untouched, so there is nothing stable to compare
        assert not list(Cache(tmp_path / "cache").entries())
        assert sess.ortmem_report is None or sess.ortmem_report.converted == 0
        return
    assert len(got) == len(expected) == 1
    assert got[0].dtype == expected[0].dtype and np.array_equal(got[0], expected[0])
    refusal = matmul_refusal(wtype, zp, stype, acc, block)
    entries = list(Cache(tmp_path / "cache").entries())
    if refusal is None:  # converted ahead of time: the entry holds the MatMulNBits ORT would have made
        assert sess.ortmem_report is not None and sess.ortmem_report.converted == 1
        (entry,) = entries
        ops = [n.op_type for n in onnx.load(str(entry.model_path), load_external_data=False).graph.node]
        assert "MatMulNBits" in ops and "DequantizeLinear" not in ops
    else:  # left to ORT, with the reason in the report
        assert not entries or sess.ortmem_report is None or sess.ortmem_report.converted == 0
        assert sess.ortmem_report is None or any(refusal in why for _, why in sess.ortmem_report.skipped)
