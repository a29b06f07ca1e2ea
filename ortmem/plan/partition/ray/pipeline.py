"""``RayPipeline``: the stages of a partition plan as Ray actors, one per stage, each on its node.

The in-process twin is :class:`ortmem.plan.partition.run.pipeline_session.PipelineSession`; this class answers the same
``run(output_names, input_feed)`` and ``get_inputs/get_outputs/get_providers``, plus :meth:`submit`
/ :meth:`run_many` for several requests in flight at once.

Where things live
-----------------
* **One actor per stage**, pinned to its node with ``NodeAffinitySchedulingStrategy(soft=False)``
  and reserving the stage's planned bytes of the node's Ray ``memory`` resource. The actor creates
  the stage with :class:`ortmem.InferenceSession` from ``folder`` *on its node*: the partition
  folder is read from a path every node sees (a shared or replicated path, by default the plan's
  own folder), not shipped; each node's ortmem cache (warm conversions, pre-packed weights) is its
  own. A node that lacks the files is refused (a pinned task checks each node) before any actor
  exists.
* **Tensors** go through Ray's object store: the driver puts the feeds once; each stage's outputs
  are separate objects (``num_returns``), handed by reference to the stages that read them, so a
  tensor moves from the node that made it straight to each node that reads it (once per node), and
  numpy arrays are read zero-copy from the reading node's store.
* **Pipelining**: :meth:`submit` only enqueues calls (each actor runs its calls in order, one at a
  time), so with several requests in flight stage k works on request i+1 while stage k+1 works on
  request i. Split a large batch into micro-batches and submit each for the same effect.

Faults
------
* Every wait has a deadline (``timeout_s``): a request not done by then raises
  :class:`~ortmem.errors.StageFailedError` naming the first stage not finished and its node.
* A stage actor that dies (killed, out of memory) is restarted by Ray on the same node up to
  ``max_restarts`` times; the call it was running (or the next one) is retried on the new actor
  (``max_task_retries``), which reloads its session from the node's files. A stage is a pure function
  of its inputs, so a retried call gives the same outputs. With restarts exhausted (or
  ``max_restarts=0``) the request fails with :class:`~ortmem.errors.StageFailedError` naming the stage
  and node; no output of a failed stage is ever returned.
* A plan that no longer matches the cluster (a node gone, too little Ray ``memory`` on a node) is
  refused with :class:`~ortmem.errors.PlanError` (``needed``: bytes per node) before any actor
  exists (:func:`~ortmem.plan.partition.ray.cluster.check_plan`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ortmem.errors import StageFailedError
from ortmem.errors import PlanError
from ortmem.plan.partition import PartitionPlan, stage_providers
from ortmem.plan.partition.run.stage_io import StagedModelIO
from ortmem.plan.partition.ray.cluster import ClusterNode, check_plan, cluster_nodes, connect, stage_reservations
from ortmem.plan.partition.ray.stage_actor import StageWorker, missing_files

__all__ = ["IOArg", "RayPipeline", "RayRequest"]


@dataclass(frozen=True)
class IOArg:
    """An input or output of the pipeline (what ORT's ``NodeArg`` says: name, type, shape)."""

    name: str
    type: str
    shape: list


class RayRequest:
    """One request in flight: :meth:`result` waits for it (with a deadline)."""

    def __init__(self, pipeline: "RayPipeline", wanted: list[str], refs: Mapping[str, Any],
                 stage_refs: list[list[Any]]):
        self._p, self._wanted, self._refs, self._stage_refs = pipeline, wanted, refs, stage_refs

    def result(self, timeout_s: float | None = None) -> list[np.ndarray]:
        """The outputs, in the order asked; :class:`StageFailedError` on a dead or late stage."""
        p = self._p
        deadline = time.monotonic() + (p.timeout_s if timeout_s is None else timeout_s)
        for k, refs in enumerate(self._stage_refs):
            if not refs:
                continue
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=left, fetch_local=False)
            if len(ready) < len(refs):
                raise StageFailedError(f"no result within the deadline ({p.timeout_s if timeout_s is None else timeout_s} s)",
                                       stage=k, node=p.nodes[k].name)
        try:
            out = ray.get([self._refs[n] for n in self._wanted], timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            raise StageFailedError("outputs not fetched within the deadline", stage=len(self._stage_refs) - 1,
                                   node=p.nodes[-1].name) from None
        except RayError as e:
            raise self._culprit(e) from e
        return [np.asarray(x) for x in out]

    def _culprit(self, err: Exception) -> StageFailedError:
        """The first stage whose own outputs failed (a later stage only saw its input fail)."""
        for k, refs in enumerate(self._stage_refs):
            if not refs:
                continue
            try:
                ray.get(refs[0], timeout=1.0)
            except GetTimeoutError:
                continue
            except RayError as e:
                return StageFailedError(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", stage=k,
                                        node=self._p.nodes[k].name)
        return StageFailedError(f"failed: {type(err).__name__}: {err}", stage=len(self._stage_refs) - 1,
                                node=self._p.nodes[-1].name)


class RayPipeline(StagedModelIO):
    """Run a partition plan's stages as Ray actors on the nodes the plan names (module docstring).

    ``plan_or_dir``: a written :class:`PartitionPlan`, its folder or its ``plan.json``. ``folder``:
    where every node reads the stage files (default: the plan's folder, a shared path).
    ``address``: the cluster to connect to when this process is not connected (default
    ``RAY_ADDRESS`` / the local one). ``providers_per_device`` as for ``PipelineSession``;
    ``sess_options``: a callable returning the ``onnxruntime.SessionOptions`` for each stage (made on
    the node; SessionOptions do not pickle); other keyword arguments go to ``ortmem.InferenceSession``.
    ``timeout_s``: deadline of a request and of the stages' creation.
    """

    def __init__(self, plan_or_dir: PartitionPlan | str | os.PathLike, *, folder: str | os.PathLike | None = None,
                 address: str | None = None, providers_per_device: Mapping[str, Any] | None = None,
                 sess_options: Callable[[], Any] | None = None, max_restarts: int = 1, max_task_retries: int = 1,
                 timeout_s: float = 120.0, **session_kwargs: Any):
        plan = plan_or_dir if isinstance(plan_or_dir, PartitionPlan) else PartitionPlan.load(plan_or_dir)
        if not plan.out_dir:
            raise PlanError("this plan was not written (partition(..., out_dir=...)): there are no stage files to run")
        self.plan = plan
        self.timeout_s = float(timeout_s)
        connect(address)
        alive = cluster_nodes()
        driver_id = ray.get_runtime_context().get_node_id()
        driver = next((n for n in alive if n.node_id == driver_id), None)
        self.nodes: list[ClusterNode] = check_plan(plan, alive, driver)  # before anything is loaded
        reserve = stage_reservations(plan)
        where = str(Path(folder) if folder is not None else Path(plan.out_dir))
        overrides = dict(providers_per_device or {})
        self._actors = []
        t0 = time.perf_counter()
        weights = plan.weights_file or "weights.bin"
        check = ray.remote(num_cpus=0)(missing_files)
        self._gather([check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
                      .remote([str(Path(where) / st.file), str(Path(where) / weights)])
                      for st, node in zip(plan.stages, self.nodes)], "file check", check_missing=True)
        remote_cls = ray.remote(StageWorker)
        for st, node, mem in zip(plan.stages, self.nodes, reserve):
            _, _, providers = stage_providers(st.device, st.provider, st.provider_options, overrides)
            self._actors.append(remote_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                num_cpus=0, memory=mem, max_restarts=max_restarts, max_task_retries=max_task_retries,
                name=None, max_concurrency=1,
            ).remote(st.index, node.name, where, st.file, weights, providers,
                     dict(session_kwargs), sess_options))
        try:
            self._memory = self._gather([a.load.remote() for a in self._actors], "session creation")
            ins, outs = zip(*self._gather([a.io.remote() for a in self._actors], "metadata"))
            # a name no stage declares raises PlanError: the actors started above must not outlive it
            self.declare_io(plan.inputs, plan.outputs, [IOArg(*a) for rows in ins for a in rows],
                            [IOArg(*a) for rows in outs for a in rows])
        except BaseException:
            self.shutdown()
            raise
        self.start_s = time.perf_counter() - t0
        self._last_read = plan.last_readers()

    # ---------------------------------------------------------------------------------- start-up
    def _gather(self, refs: list[Any], what: str, check_missing: bool = False) -> list[Any]:
        out = []
        deadline = time.monotonic() + self.timeout_s
        for k, ref in enumerate(refs):
            try:
                got = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                raise StageFailedError(f"{what} did not finish within {self.timeout_s} s (is the node's memory "
                                       "taken by other actors?)", stage=k, node=self.nodes[k].name) from None
            except RayError as e:
                raise StageFailedError(f"{what} failed: {str(e).splitlines()[0][:300]}", stage=k,
                                       node=self.nodes[k].name) from e
            if check_missing and got:
                raise StageFailedError(f"the partition folder is not on this node (missing {got}); give "
                                       "RayPipeline(folder=...) a path every node sees", stage=k,
                                       node=self.nodes[k].name, file=got[0])
            out.append(got)
        return out

    # ---------------------------------------------------------------------------------- metadata
    def get_providers(self) -> list[str]:
        out: list[str] = []
        for ps in self._gather([a.providers_used.remote() for a in self._actors], "get_providers"):
            out.extend(p for p in ps if p not in out)
        return out

    def memory(self) -> list[dict[str, Any]]:
        """Per stage: its actor's memory (:meth:`StageWorker.memory`) with the stage, node and budget."""
        rows = self._gather([a.memory.remote() for a in self._actors], "memory")
        for k, (row, st, node) in enumerate(zip(rows, self.plan.stages, self.nodes)):
            dev = next((d for d in self.plan.devices if d.name == st.device), None)
            row.update(stage=k, node=node.name, device=st.device, planned_bytes=st.bytes,
                       budget_bytes=dev.budget_bytes if dev else None)
        return rows

    def actor_pids(self) -> list[int]:
        return self._gather([a.pid.remote() for a in self._actors], "pid")

    # ---------------------------------------------------------------------------------- running
    def submit(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> RayRequest:
        """Enqueue one request on the stages and return at once (see :meth:`RayRequest.result`)."""
        wanted = self.plan.requested_outputs(output_names, input_feed)
        keep = set(wanted)
        refs: dict[str, Any] = {n: ray.put(np.asarray(v)) for n, v in input_feed.items()
                                if n in keep or n in self._last_read}
        stage_refs: list[list[Any]] = []
        for k, (st, actor) in enumerate(zip(self.plan.stages, self._actors)):
            outs = [o for o in st.outputs if o in keep or self._last_read.get(o, -1) > k]
            ins = [x for x in st.inputs if x in refs]
            if not outs:
                stage_refs.append([])
                continue
            got = actor.run.options(num_returns=len(outs)).remote(outs, ins, *[refs[x] for x in ins])
            got = [got] if len(outs) == 1 else list(got)
            refs.update(zip(outs, got))
            stage_refs.append(got)
        return RayRequest(self, wanted, {n: refs[n] for n in wanted}, stage_refs)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """Outputs ``output_names`` (all, when None) for ``input_feed``, as ORT's ``run`` returns them.
        ``run_options`` is accepted for signature compatibility and must be None (they do not pickle)."""
        if run_options is not None:
            raise ValueError("RayPipeline.run takes no run_options (onnxruntime.RunOptions cannot be sent to actors)")
        return self.submit(output_names, input_feed).result()

    def run_many(self, output_names: Sequence[str] | None, feeds: Sequence[Mapping[str, Any]]
                 ) -> list[list[np.ndarray]]:
        """Several requests (or micro-batches) in flight at once: stages work in parallel."""
        requests = [self.submit(output_names, f) for f in feeds]
        return [r.result() for r in requests]

    # ---------------------------------------------------------------------------------- end
    def shutdown(self) -> None:
        """Stop the stage actors (their sessions go with them)."""
        for a in getattr(self, "_actors", []):
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass
        self._actors = []

    def __enter__(self) -> "RayPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
