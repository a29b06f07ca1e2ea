"""Probe strategies for the partition measurement (``bench/partition/measure.py``).

Each runs in the probe's fresh child process. ``model_path`` is a stage file (``stage_session``) or a
plan folder's ``plan.json`` (``pipeline``). Sessions use the warm strategy's cache folder, filled by
the unmeasured ``prepare_*`` step, so what is measured is a cache hit, as in production after the
first start.
"""
from __future__ import annotations

from typing import Any


def _cache():
    from ortmem.store.cache import cache_root

    return cache_root() / "bench" / "partition"


def stage_session(model_path: str, options: dict) -> Any:
    """One stage's ``ortmem.InferenceSession`` (what ``PipelineSession`` creates for that stage)."""
    import ortmem

    return ortmem.InferenceSession(model_path, providers=["CPUExecutionProvider"], cache=_cache())


def prepare_stage(model_path: str, options: dict, workdir: str) -> str:
    stage_session(model_path, options)
    return model_path


def pipeline(model_path: str, options: dict) -> Any:
    """Every stage in one process, run through ``PipelineSession`` (the per-process total)."""
    from ortmem.plan.partition.run.pipeline_session import PipelineSession

    return PipelineSession(model_path, cache=_cache())


def prepare_pipeline(model_path: str, options: dict, workdir: str) -> str:
    pipeline(model_path, options)
    return model_path


def whole(model_path: str, options: dict) -> Any:
    """The unpartitioned model through ``ortmem.InferenceSession`` (the reference)."""
    return stage_session(model_path, options)


def prepare_whole(model_path: str, options: dict, workdir: str) -> str:
    whole(model_path, options)
    return model_path


def stage_session_warmed(model_path: str, options: dict) -> Any:
    """A stage's session that has already run twice (inside the measured creation window): with the
    probe's own run, the peak covers creation and three runs. ORT's memory-pattern planner allocates
    its pattern block on the second run, beside the arena chunks of the first."""
    from ortmem.ort.feeds import make_inputs

    sess = stage_session(model_path, options)
    feeds = make_inputs(sess, options)
    for _ in range(2):
        sess.run(None, feeds)
    return sess
