"""ortmem's layers, declared once: the import-graph test checks that imports point down them, and
``bench/session_path.py`` counts the session path's moves over them."""
from __future__ import annotations

#: The layers, bottom first: a module may import its own layer and those below, never one above. A
#: module belongs to the layer of its longest listed prefix. Ordered by what the code needs:
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # stdlib/numpy-level primitives and what the hook reads before it imports anything heavy. The package
    # root holds only __version__, the exceptions and lazy names. ``store.trust`` and ``store.layout``
    # import nothing of ortmem: the store is built on them, the release model keeps its probe answers
    # private with trust, and the converter and the partitioner name their files from layout;
    # ``store.stamps`` (files checked in full this boot) is built on trust alone, below the digests.
    ("bottom", ("ortmem", "ortmem.errors", "ortmem.lazy", "ortmem.units", "ortmem.dtypes", "ortmem.protowire",
                "ortmem.onnx_walk", "ortmem.progress", "ortmem.helper_env", "ortmem.ort_original", "ortmem.options",
                "ortmem.hygiene", "ortmem.model_facts", "ortmem.store.trust", "ortmem.store.layout",
                "ortmem.store.stamps")),
    # one model of ORT: what it fuses, its settings, graph indexes, external-data rules, providers
    ("ortmodel", ("ortmem.ortmodel",)),
    # the loader follows ORT's external-data rules (ortmodel.external_data), so it sits just above them;
    # ``store.digest`` hashes page-aligned spans (weights.PAGE) and the passes' writers digest what they
    # write, so it sits here though the store's folder holds it; ``store.sources`` (keys, and what an
    # entry records of its source files: stat identities and digests) is built on digest alone
    ("load", ("ortmem.loader", "ortmem.weights", "ortmem.model", "ortmem.store.digest", "ortmem.store.sources")),
    ("passes", ("ortmem.passes",)),
    ("store", ("ortmem.store",)),
    ("session", ("ortmem.inmemory", "ortmem.convert", "ortmem.handoff",
                 "ortmem.session")),
    ("reach", ("ortmem.reach",)),
    # planners, measurement, commands and programs; PipelineSession runs a partition plan, so it sits
    # with the planner it reads; the release probe is a child program that puts ORT's questions to the
    # session path
    ("top", ("ortmem.plan", "ortmem.measure", "ortmem.cli", "ortmem.__main__", "ortmem.doctor", "ortmem.inspection",
             "ortmem.synth", "ortmem.distributed", "ortmem.release_probe", "ortmem.reach.pipeline")),
)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer (its longest listed prefix)."""
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer
