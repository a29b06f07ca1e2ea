"""Ask the installed ONNX Runtime, with tiny models, what it does with the patterns ortmem rewrites.

Why a probe
-----------
What ORT fuses (``DQMatMulToMatMulNBits``: bit widths, zero points, scale types, block-size bounds) and
which ``MatMulNBits`` / ``GatherBlockQuantized`` variants its kernels run correctly change from release
to release (1.32 fuses block 512, 1.31 stops at 256; 1.25 refuses a 2-bit GatherBlockQuantized with zero
points and fails 2-bit MatMulNBits with fp16 scales at run time). A table read from one release's source is
not enough, so ortmem asks the build it runs on: for each variant it builds a DQ model of a few KiB,

1. lets ORT optimize it (``optimized_model_filepath``) and records whether ORT fused it and with which
   attributes (the *fusion* question: converting where ORT would not changes numerics);
2. runs ORT on the QDQ model (the reference) and on the model ortmem's own rewrite produces, and records
   whether the outputs are identical (the *kernel* question: ortmem must never write a node this ORT
   cannot run or runs differently).

This module is the child program (:func:`main` prints one JSON object); it runs in a subprocess
because older releases crash the process on some malformed graphs, and a crash must cost a probe, not
the user's program. :mod:`ortmem.ort.release` runs it by module name once per ORT build and CPU and
caches the answer (about 130 tiny sessions, a few seconds).

Why here and not in ``ortmodel``: the questions are put to ortmem's own converter, pre-finisher and
session path, which sit above ``ortmodel``; the release model only names the variants
(:mod:`ortmem.ort.variants`) and reads the answers, so ``ortmodel`` imports nothing above it. The
converter and the session path are imported inside the functions that use them, so that
:func:`import_baseline_bytes` measures the process with the session path and nothing more.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortmem.ort.variants import (ACCURACY_LEVELS, BLOCK_SWEEP, GATHER_WEIGHT_TYPES, SCALE_TYPES, SHARED_WEIGHT_KEY, WEIGHT_TYPES, dq_gather_model, dq_matmul_model, dq_shared_weight_model, variant_key)


def _feeds(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {}
    for vi in m.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TensorProto.INT64:
            out[vi.name] = np.array([3, 0, 15], np.int64)
        else:
            dt = np.float16 if vi.type.tensor_type.elem_type == TensorProto.FLOAT16 else np.float32
            out[vi.name] = rng.standard_normal(shape).astype(dt)
    return out


def _session(ort: Any, path: Path, accuracy: int, level: Any = None, optimized: Path | None = None) -> Any:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    if level is not None:
        so.graph_optimization_level = level
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def probe_variant(ort: Any, m: onnx.ModelProto, accuracy: int, work: Path, fused_op: str,
                  convert: bool = True) -> dict[str, Any]:
    """Fusion and kernel answers for one model (see the module docstring)."""
    from ortmem.store.writer import write_converted
    from ortmem.ort.settings import session_settings
    from ortmem.onnxfile.loader import load
    from ortmem.passes.engine import plan_conversion
    from ortmem.ort.release import unrestricted_capabilities

    work.mkdir(parents=True, exist_ok=True)
    src = work / "qdq.onnx"
    onnx.save(m, src)
    answer: dict[str, Any] = {}
    try:
        _session(ort, src, accuracy, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, work / "opt.onnx")
        opt = onnx.load(work / "opt.onnx", load_external_data=False)
        nodes = [n for n in opt.graph.node if n.op_type == fused_op]
        answer["fused"] = bool(nodes) and not any(n.op_type == "DequantizeLinear" for n in opt.graph.node)
        if nodes:
            answer["attrs"] = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute
                               if a.type == onnx.AttributeProto.INT}
    except Exception as exc:  # noqa: BLE001 - ORT's pybind errors: the answer is the message
        answer["fused"], answer["ort_error"] = False, _short(exc)
    feeds = _feeds(m)
    try:
        reference = _session(ort, src, accuracy).run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        answer["reference_error"] = _short(exc)
        return answer
    if not convert:
        return answer
    try:
        model = load(src)
        with model:
            plan = plan_conversion(model, session_settings(accuracy_level=accuracy), capabilities=unrestricted_capabilities())
            if not plan.has_work:
                answer["ortmem"] = "not converted"
                return answer
            out = work / "converted"
            out.mkdir()
            write_converted(model, plan, out)
        ours = _session(ort, out / "model.onnx", accuracy).run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        answer["ortmem"] = "error: " + _short(exc)
        return answer
    same = len(ours) == len(reference) and all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(ours, reference))
    if same:
        answer["ortmem"] = "equal"
    else:
        diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) for a, b in zip(ours, reference))
        answer["ortmem"] = f"differs (max |diff| {diff:.3g})"
    return answer


def probe_prepacked(ort: Any, work: Path) -> dict[str, Any]:
    """Does this release save its finished model of a converted QDQ model with the pre-packed MatMulNBits
    weights in an external file (:func:`ortmem.store.finished.finish_model`), and does a session on it at
    ``ORT_DISABLE_ALL`` give the QDQ model's outputs? (1.25 saves no pre-packed weights; 1.32 re-packs
    and compares them.)"""
    from ortmem.store.writer import write_converted
    from ortmem.ort.settings import OrtSettings, session_settings
    from ortmem.onnxfile.loader import load
    from ortmem.passes.engine import plan_conversion
    from ortmem.files.layout import MODEL_FILE
    from ortmem.store.finished import finish_model
    from ortmem.ort.release import unrestricted_capabilities

    work.mkdir(parents=True, exist_ok=True)
    # B must be large enough to be stored as external data (ortmem keeps tensors of one page inline)
    m = dq_matmul_model("int4", "float", 128, False, n=128)
    src = work / "qdq.onnx"
    onnx.save(m, src)
    feeds = _feeds(m)
    reference = _session(ort, src, 4).run(None, feeds)
    out = work / "converted"
    out.mkdir()
    with load(src) as model:
        write_converted(model, plan_conversion(model, session_settings(accuracy_level=4),
                                               capabilities=unrestricted_capabilities()), out)
    settings = OrtSettings(session_config={"session.qdq_matmulnbits_accuracy_level": "4"})
    try:
        report = finish_model(out / MODEL_FILE, out, "finished", settings=settings)
    except Exception as exc:  # noqa: BLE001 - FinishError or ORT's own
        return {"saved": False, "error": _short(exc)}
    if not report.prepacked:
        return {"saved": False}
    saved = out / "finished.onnx"
    if not report.useful:  # ORT packed, but its finished model did not pass the check (other outputs, no gain)
        return {"saved": True, "reload": "differs", "refusal": report.refusal}
    ours = _session(ort, saved, 4, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, feeds)
    if not all(np.array_equal(a, b) for a, b in zip(ours, reference)):
        return {"saved": True, "reload": "differs"}
    decoder = _finished_decoder_refusal(work / "decoder", settings)
    if decoder:  # 1.28 and 1.30 save a finished decoder that gives other outputs than its source
        return {"saved": True, "reload": "differs", "refusal": decoder}
    return {"saved": True, "reload": "equal", "validated": _refuses_a_changed_blob(ort, Path(saved))}


def _finished_decoder_refusal(work: Path, settings: Any) -> str:
    """Why ORT's finished model of a small converted Llama-shaped decoder (embedding, attention, bias adds,
    norms: what ORT's optimizers rewrite, unlike a lone MatMul) is not used, or "" when its outputs are
    the converted model's, as :func:`ortmem.store.finished.finish_model` checks every finished model."""
    from ortmem.store.writer import write_converted
    from ortmem.ort.settings import session_settings
    from ortmem.onnxfile.loader import load
    from ortmem.passes.engine import plan_conversion
    from ortmem.files.layout import MODEL_FILE
    from ortmem.store.finished import finish_model
    from ortmem.ort.release import unrestricted_capabilities
    from ortmem.measure.synth import SynthConfig, write_model

    work.mkdir(parents=True, exist_ok=True)
    src = work / "qdq.onnx"
    write_model(SynthConfig.tiny(form="qdq", storage="external", name="qdq"), src)
    out = work / "converted"
    out.mkdir()
    with load(src) as model:
        write_converted(model, plan_conversion(model, session_settings(accuracy_level=4),
                                               capabilities=unrestricted_capabilities()), out)
    try:
        report = finish_model(out / MODEL_FILE, out, "finished", settings=settings)
    except Exception as exc:  # noqa: BLE001 - FinishError or ORT's own
        return _short(exc)
    # a refusal for memory alone ("keeps ... MiB private") says nothing of the release: not a verdict here
    wrong = report.refusal and "MiB private" not in report.refusal
    return report.refusal if report.prepacked and not report.useful and wrong else ""


def _refuses_a_changed_blob(ort: Any, saved: Path) -> bool:
    """Does ORT read and check saved pre-packed blobs while it creates the session? One byte of the
    first blob is flipped in a copy of the folder: 1.32 refuses the model (``session_state.cc
    ValidatePrePackedWeights`` re-packs every buffer and compares), earlier releases map the blob
    unread. The answer says whether the blobs are resident after creation (the estimator's
    ``blobs_read_at_create``) and whether a warm start pays a second packing."""
    copy = saved.parent.with_name(saved.parent.name + "-changed")
    shutil.copytree(saved.parent, copy)
    model = onnx.load(str(copy / saved.name), load_external_data=False)
    for t in model.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        blob = next((v for k, v in ext.items() if k.startswith("prepacked")), None)
        if blob is None:
            continue
        offset, length, _checksum = blob.split("|")[1].split(";")
        with open(copy / ext["location"], "r+b") as f:
            f.seek(int(offset) + int(length) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        try:
            _session(ort, copy / saved.name, 4)
        except Exception:  # noqa: BLE001 - ORT's refusal, whatever its type
            return True
        return False
    return False


def probe_borrowing(ort: Any) -> bool:
    """Does ORT borrow in-memory external data in place under ``session.use_external_initializer_file_buffers_directly``
    (new in 1.31), instead of copying it at creation? A buffer changed after creation shows in the
    output only when it was borrowed (``ortmem.session.inmemory``'s zero-copy path depends on it)."""
    from ortmem.passes.borrowing import BORROW_KEY

    n = 1024
    buffer = np.ones(n, np.float32)
    c = onnx.TensorProto(name="C", data_type=TensorProto.FLOAT, dims=[n], data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", "buffer.bin"), ("offset", "0"), ("length", str(buffer.nbytes))):
        c.external_data.add(key=key, value=value)
    g = helper.make_graph([helper.make_node("Add", ["X", "C"], ["Y"])], "borrow",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [n])], [c])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry(BORROW_KEY, "1")
    so.add_external_initializers_from_files_in_memory(["buffer.bin"], [buffer.view(np.uint8)], [buffer.nbytes])
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    buffer[:] = 2.0
    return bool(sess.run(None, {"X": np.zeros(n, np.float32)})[0][0] == 2.0)


def variants() -> Iterator[tuple[str, onnx.ModelProto, int, str, bool]]:
    """(key, model, accuracy level, fused op, convert?) for every question the probe asks."""
    for wtype in WEIGHT_TYPES:
        for has_zp in (False, True):
            for stype in SCALE_TYPES:
                for acc in ACCURACY_LEVELS:
                    yield (variant_key("matmul", wtype, has_zp, stype, acc),
                           dq_matmul_model(wtype, stype, 32, has_zp), acc, "MatMulNBits", True)
    for block in BLOCK_SWEEP:
        yield f"block:{block}", dq_matmul_model("int4", "float", block, False), 4, "MatMulNBits", True
    # structural rules of ORT's DQ+MatMul fusion: ortmem never converts these, it predicts them
    yield SHARED_WEIGHT_KEY, dq_shared_weight_model(), 4, "MatMulNBits", False
    for wtype in GATHER_WEIGHT_TYPES:
        for has_zp in (False, True):
            for stype in SCALE_TYPES:
                yield (variant_key("gather", wtype, has_zp, stype), dq_gather_model(wtype, stype, has_zp), 4,
                       "GatherBlockQuantized", True)


#: What a start that converts imports beyond ``ortmem.session.inference`` (onnx, the loader, the passes, the
#: publisher): ``bench/estimator/fixed_costs.py`` measures them apart from the session path.
CONVERSION_MODULES = ("ortmem.session.cold_start", "ortmem.onnxfile.loader", "ortmem.store.publish")


def import_baseline_bytes() -> int:
    """Resident memory of a fresh interpreter once numpy, onnxruntime, ortmem's session path and its
    conversion (:data:`CONVERSION_MODULES`) are imported: the baseline every fresh-process measurement
    starts from, which differs per release (the estimator's calibrated constants were measured on one).
    This module imports onnx for its own models anyway, so the conversion is measured whole."""
    import importlib

    import onnxruntime  # noqa: F401

    import ortmem.session.inference  # noqa: F401

    for module in CONVERSION_MODULES:
        importlib.import_module(module)

    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_all() -> dict[str, Any]:
    import onnxruntime as ort

    try:
        baseline = import_baseline_bytes()  # first, before any session grows the heap
    except OSError:
        baseline = 0
    ort.set_default_logger_severity(4)
    results: dict[str, Any] = {"onnxruntime": ort.__version__, "variants": {}, "import_baseline_bytes": baseline}
    with tempfile.TemporaryDirectory(prefix="ortmem-probe-") as tmp:
        for i, (key, m, acc, op, convert) in enumerate(variants()):
            try:
                results["variants"][key] = probe_variant(ort, m, acc, Path(tmp) / str(i), op, convert)
            except Exception as exc:  # noqa: BLE001 - one broken question must not lose the others
                results["variants"][key] = {"probe_error": _short(exc), "trace": traceback.format_exc(limit=3)}
        try:
            results["prepacked"] = probe_prepacked(ort, Path(tmp) / "prepacked")
        except Exception as exc:  # noqa: BLE001
            results["prepacked"] = {"saved": False, "probe_error": _short(exc)}
        try:
            results["borrows_memory_buffers"] = probe_borrowing(ort)
        except Exception as exc:  # noqa: BLE001 - a release without the API or the key
            results["borrows_memory_buffers"], results["borrowing_error"] = False, _short(exc)
    return results


def main() -> None:
    """Entry point of the probe child (see :func:`ortmem.ort.release.run_probe`)."""
    json.dump(run_all(), sys.stdout)
