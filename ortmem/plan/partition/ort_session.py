"""ORT's own way of running a plan in one session, where one suffices (one CUDA device beside CPU
devices): the session settings, and the whole model with each node annotated with its device
(``model_annotated.onnx``).

An alternative to :class:`ortmem.plan.partition.run.pipeline_session.PipelineSession`'s one session per stage; written beside
the stages, not used by ortmem itself.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from onnx import ModelProto

from ortmem.plan.partition.devices import is_cpu
from ortmem.plan.partition.graph import PartitionGraph
from ortmem.plan.partition.partition_plan import PartitionPlan
from ortmem.plan.partition.submodels import StageGraph
from ortmem.plan.partition.stage_weights import WeightsLayout, relocate_graph

ANNOTATED_FILE = "model_annotated.onnx"
LAYER_ANN = "layer_ann"  # ORT's node metadata key for session.layer_assignment_settings


def _designator(device: str, provider: str, options: Mapping[str, Any]) -> str:
    """The device designator ``session.layer_assignment_settings`` uses for this device."""
    if is_cpu(provider):
        return "cpu"
    if provider == "CUDAExecutionProvider":
        return f"gpu:{int(options.get('device_id', 0))}" if ":" in device or device.isdigit() else "cuda"
    if provider == "DmlExecutionProvider":
        return "dml"
    return provider


def _annotation(device: str) -> str:
    return "ortmem_" + "".join(ch if ch.isalnum() else "_" for ch in device)


def ort_settings(plan: PartitionPlan, *, stats_file: str | None = None) -> dict[str, Any] | None:
    """ORT's own way of running the plan in ONE session, when one suffices: at most one device with a
    non-CPU provider (ORT registers one instance of an EP per session) and the rest on the CPU.

    Returns ``{"providers", "session_config", "alternative_session_config", "annotations", "status"}``:
    ``session.layer_assignment_settings`` = ``"gpu:0(=ortmem_cuda_0); cpu(=ortmem_cpu)"`` for a model
    whose nodes carry ``layer_ann`` metadata (written as ``model_annotated.onnx``; grammar from
    onnxruntime/core/framework/layering_annotations.cc: ``device(ann, ...); ...``, ``=`` for an exact
    match), and, as ORT's greedy alternative, ``session.resource_cuda_partitioning_settings`` =
    ``"<budget KiB>,<stats file>"`` (``"<KiB>,"`` without one). Not run on a GPU here.
    """
    gpu = [d for d in plan.devices if not is_cpu(d.provider) and d.stages]
    if len(gpu) != 1 or gpu[0].provider != "CUDAExecutionProvider":
        return None
    dev = gpu[0]
    stage0 = next(s for s in plan.stages if s.device == dev.name)
    groups: dict[str, list[str]] = {}
    annotations: dict[str, str] = {}
    for d in plan.devices:
        if not d.stages:
            continue
        opts = next(s.provider_options for s in plan.stages if s.device == d.name)
        desig = _designator(d.name, d.provider, opts)
        ann = _annotation(d.name)
        annotations[d.name] = ann
        groups.setdefault(desig, []).append("=" + ann)
    layer = "; ".join(f"{desig}({', '.join(anns)})" for desig, anns in groups.items())
    kib = dev.budget_bytes // 1024
    resource = f"{kib},{stats_file}" if stats_file else f"{kib},"
    return {
        "model": ANNOTATED_FILE,
        "providers": [["CUDAExecutionProvider", dict(stage0.provider_options)], ["CPUExecutionProvider", {}]],
        "session_config": {"session.layer_assignment_settings": layer},
        "alternative_session_config": {"session.resource_cuda_partitioning_settings": resource},
        "annotations": annotations,
        "status": ("format accepted by ORT's parser (CPU builds 1.25-1.32); placement not run on a GPU: untested. "
                   "The alternative is ORT's own greedy walk, which stops at the first node over budget."),
    }


def annotated_model(G: PartitionGraph, stage_models: Sequence[StageGraph], plan: PartitionPlan, layout: WeightsLayout,
                     location: str) -> ModelProto:
    m = ModelProto()
    m.CopyFrom(G.model.skeleton)
    ann_of: dict[str, str] = {}
    for sg, st in zip(stage_models, plan.stages):
        for label in sg.nodes:
            ann_of[label] = _annotation(st.device)
        for label in sg.replicated:
            ann_of.setdefault(label, _annotation(st.device))
    for i, node in enumerate(m.graph.node):
        ann = ann_of.get(G.labels_all[i])
        if ann is None:
            continue
        for prop in list(node.metadata_props):
            if prop.key == LAYER_ANN:
                node.metadata_props.remove(prop)
        e = node.metadata_props.add()
        e.key, e.value = LAYER_ANN, ann
    relocate_graph(m.graph, G.model.path.parent.resolve(), layout, location)
    return m
