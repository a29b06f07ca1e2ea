"""Partition a synthetic Llama over the nodes of a local Ray cluster and measure ``RayPipeline``:
first and warm starts, each stage actor's memory (creation and steady, private and shared), time per
request sequentially and pipelined, and the bytes moved between nodes per request.

    python -m bench.distributed.measure $WORK --config p100 --node n0=64MiB --node n1=60MiB \\
        --node n2=400MiB --fraction 0.8 --requests 16 --json bench/distributed/p100_3nodes.json

The cluster is ``ortmem.plan.partition.ray.local_cluster``: one raylet per node on 127.0.0.1, each with its
own Ray ``memory`` (the node's budget) and object store. The plan is made for ``--fraction`` of each
node's memory (``ortmem partition --ray auto --ray-fraction F``). Every stage runs with one intra-op
thread (the machine has 2 cores), as do the references (the whole model under
``ortmem.InferenceSession``; the same plan in one process under ``PipelineSession``). The ortmem
cache starts empty (``<workdir>/cache``), so the first start converts; on one machine the nodes share
that folder (on a real cluster each node has its own).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

MiB = 2**20
CONFIGS = {
    "small": dict(hidden=512, intermediate=1408, layers=6, vocab=4000, heads=4),  # 21 MB (the test's)
    "p100": dict(hidden=1024, intermediate=2816, layers=8, vocab=8000, heads=16),  # 0.10 GB of weights
}


def one_thread():
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return so


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="p100")
    ap.add_argument("--node", action="append", default=[], metavar="NAME=BYTES", required=True)
    ap.add_argument("--fraction", type=float, default=0.8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["ORTMEM_CACHE_DIR"] = str(cache)  # before any ortmem import and before the nodes start

    import onnxruntime as ort

    import ortmem
    from ortmem.plan.partition.ray import RayPipeline, cluster_devices, local_cluster
    from ortmem.plan.partition import partition
    from ortmem.measure.synth import SynthConfig, write_model
    from ortmem.base.units import parse_bytes

    nodes = {k: parse_bytes(v) for k, v in (x.split("=", 1) for x in args.node)}
    cfg = SynthConfig(**CONFIGS[args.config], storage="external", name=args.config)
    model = work / f"{args.config}.onnx"
    if not model.exists():
        write_model(cfg, model)
    dims = {"batch": 1, "seq": args.seq}
    feeds = [{"input_ids": np.random.default_rng(s).integers(0, cfg.vocab, size=(1, args.seq), dtype=np.int64)}
             for s in range(args.requests)]
    result: dict = {"onnxruntime": ort.__version__, "config": args.config, "nodes": nodes, "fraction": args.fraction,
                    "dims": dims, "requests": args.requests}
    with local_cluster(nodes, object_store_bytes=100 * MiB):
        import ray

        result["ray"] = ray.__version__
        t = time.perf_counter()
        plan = partition(model, cluster_devices(fraction=args.fraction), dims=dims, out_dir=work / "parts")
        result["plan_s"] = time.perf_counter() - t
        print(plan.report(), flush=True)
        result["links"] = plan.links()
        whole = ortmem.InferenceSession(str(model), one_thread())
        ref = [whole.run(None, f) for f in feeds]
        t = time.perf_counter()
        for f in feeds:
            whole.run(None, f)
        result["whole_model_s_per_request"] = (time.perf_counter() - t) / len(feeds)
        del whole
        starts = []
        for i in range(3):
            p = RayPipeline(plan.out_dir, sess_options=one_thread, timeout_s=300)
            starts.append(p.start_s)
            print(f"start {i + 1}: {p.start_s:.2f} s", flush=True)
            if i < 2:
                p.shutdown()
        result["start_s"] = starts
        same = all(np.array_equal(a, b) for a, b in zip(p.run(None, feeds[0]), ref[0]))
        after_one = p.memory()
        t = time.perf_counter()
        seq_out = [p.run(None, f) for f in feeds]
        result["sequential_s_per_request"] = (time.perf_counter() - t) / len(feeds)
        t = time.perf_counter()
        pipe_out = p.run_many(None, feeds)
        result["pipelined_s_per_request"] = (time.perf_counter() - t) / len(feeds)
        same = same and all(np.array_equal(a, b) for o, r in zip(seq_out + pipe_out, ref + ref) for a, b in zip(o, r))
        result["bit_identical"] = same
        rows = p.memory()
        node_of = [s.node for s in plan.stages]
        producer = {o: k for k, s in enumerate(plan.stages) for o in s.outputs}
        moved: dict[str, int] = {}
        for k, r in enumerate(rows):
            for name, nb in (r.get("last_input_bytes") or {}).items():
                src = producer.get(name)
                if src is not None and node_of[src] != node_of[k]:
                    key = f"{node_of[src]} -> {node_of[k]}"
                    moved[key] = moved.get(key, 0) + nb
        result["measured_link_bytes"] = moved
        result["stages_after_one_run"] = after_one
        result["stages"] = rows
        p.shutdown()
        from ortmem.plan.partition.run.pipeline_session import PipelineSession

        local = PipelineSession(plan.out_dir, sess_options=one_thread())
        t = time.perf_counter()
        for f in feeds:
            local.run(None, f)
        result["in_process_pipeline_s_per_request"] = (time.perf_counter() - t) / len(feeds)

    print("\n| stage | node | node budget | plan budget | planned | creation peak | creation private / shared "
          "| after 1 run: peak | after all runs: peak | steady private / shared / object store |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r1, r in zip(result["stages_after_one_run"], result["stages"]):
        base = r["baseline"]
        c, s = r["create"], r["steady"]
        print(f"| {r['stage']} | {r['node']} | {_mib(nodes[r['node']])} | {_mib(r['budget_bytes'])} | "
              f"{_mib(r['planned_bytes'])} | {_mib(c['peak_bytes'] - base['rss_bytes'])} | "
              f"{_mib(c['private_bytes'] - base['private_bytes'])} / {_mib(c['shared_bytes'] - base['shared_bytes'])} | "
              f"{_mib(r1['peak_above_baseline_bytes'])} | {_mib(r['peak_above_baseline_bytes'])} | "
              f"{_mib(s['private_bytes'] - base['private_bytes'])} / {_mib(s['shared_bytes'] - base['shared_bytes'])} / "
              f"{_mib(s['object_store_bytes'] - base['object_store_bytes'])} |")
    print(f"\nstarts (s): {', '.join(f'{x:.2f}' for x in result['start_s'])}; plan {result['plan_s']:.1f} s")
    print(f"per request (ms): whole model {1e3 * result['whole_model_s_per_request']:.1f}, in-process pipeline "
          f"{1e3 * result['in_process_pipeline_s_per_request']:.1f}, RayPipeline sequential "
          f"{1e3 * result['sequential_s_per_request']:.1f}, pipelined {1e3 * result['pipelined_s_per_request']:.1f}")
    print("bytes per request between nodes: planned "
          + ", ".join(f"{x['from_node']} -> {x['to_node']} {x['bytes']:,}" for x in result["links"])
          + "; measured " + ", ".join(f"{k} {v:,}" for k, v in moved.items()))
    print(f"bit-identical: {result['bit_identical']}; onnxruntime {result['onnxruntime']}, ray {result['ray']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
