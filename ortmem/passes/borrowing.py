"""Which borrowed buffers ONNX Runtime stops reading once a session exists.

When ortmem hands converted weights to ORT as in-memory external data with
``session.use_external_initializer_file_buffers_directly=1``, ORT borrows them for the session's
life. A kernel that pre-packs an input (MatMulNBits packs B, and at some accuracy levels more) keeps
its own packed copy and never reads the borrowed bytes again, so ortmem can give those pages back.
Which inputs are packed depends on the ORT build and the CPU (MLAS picks kernels by instruction set),
so instead of mirroring ORT's source this module *asks ORT*: it builds a tiny MatMulNBits session
with the same bits, block size, accuracy level and scale type from borrowed buffers, overwrites each
input after creation, and checks whether the output changes. Only inputs whose overwrite changes
nothing are ever released. The answer is cached per process.
"""
from __future__ import annotations

import functools
import mmap
import uuid

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from ortmem.passes.skeleton_edit import MS_DOMAIN
from ortmem.onnxfile.weights import page_align

BORROW_KEY = "session.use_external_initializer_file_buffers_directly"

#: MatMulNBits input positions.
B, SCALES, ZERO_POINTS = 1, 2, 3


@functools.lru_cache(maxsize=None)
def matmulnbits_unread_inputs(bits: int, block_size: int, accuracy_level: int, scale_type: int, has_zp: bool) -> frozenset[int]:
    """Input positions (B=1, scales=2, zero_points=3) that ORT does not read after session creation."""
    K, N = 4 * block_size, 16
    kb = K // block_size
    blob = block_size * bits // 8
    rng = np.random.default_rng(0)
    s_np = np.float16 if scale_type == TensorProto.FLOAT16 else np.float32
    arrays = {B: rng.integers(0, 256, size=(N, kb, blob), dtype=np.uint8),
              SCALES: (rng.random((N, kb)) * 0.1 + 0.01).astype(s_np)}
    if has_zp:
        arrays[ZERO_POINTS] = rng.integers(0, 256, size=(N, -(-kb * bits // 8)), dtype=np.uint8)
    names = {B: "B", SCALES: "scales", ZERO_POINTS: "zp"}
    location = f"ortmem-probe-{uuid.uuid4().hex}.bin"
    offsets, size = {}, 0
    for pos, a in arrays.items():
        offsets[pos] = size
        size = page_align(size + a.nbytes)
    buf = mmap.mmap(-1, size)
    inits = []
    for pos, a in arrays.items():
        np.frombuffer(buf, np.uint8, a.nbytes, offsets[pos])[:] = a.reshape(-1).view(np.uint8)
        t = TensorProto(name=names[pos], data_type=TensorProto.UINT8 if pos != SCALES else scale_type, dims=a.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(offsets[pos])), ("length", str(a.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
    a_type = scale_type
    inputs = ["A", "B", "scales"] + (["zp"] if has_zp else [])
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain=MS_DOMAIN, K=K, N=N, bits=bits,
                            block_size=block_size, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", a_type, [2, K])],
                              [helper.make_tensor_value_info("Y", a_type, [2, N])], inits)
    model = helper.make_model(graph, ir_version=10,
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
    def session(borrow: bool) -> ort.InferenceSession:
        so = ort.SessionOptions()
        if borrow:
            so.add_session_config_entry(BORROW_KEY, "1")
        so.add_external_initializers_from_files_in_memory([location], [np.frombuffer(buf, np.uint8)], [size])
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    x = (rng.random((2, K)) - 0.5).astype(s_np)
    try:
        ref = session(borrow=False).run(None, {"A": x})[0]  # ORT copies: our buffer plays no part later
    except Exception:  # noqa: BLE001 - an unsupported combination: release nothing
        buf.close()
        return frozenset()
    unread = set()
    for pos, a in arrays.items():
        # Overwrite right after creation and before the first run, so a kernel that reads the
        # buffer lazily (on first run) is caught too.
        sess = session(borrow=True)
        region = np.frombuffer(buf, np.uint8, a.nbytes, offsets[pos])
        saved = region.copy()
        region[:] ^= 0x5A
        if np.array_equal(sess.run(None, {"A": x})[0], ref):
            unread.add(pos)
        region[:] = saved
        del sess, region
    buf.close()
    return frozenset(unread)
