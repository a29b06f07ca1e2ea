"""Random malformed requests against a live ``ortmem.serve.server``: every one must get 4xx, never 500.

    python -m bench.fuzz_serve                          # a tiny synthetic model, 20,000 requests (under a minute)
    python -m bench.fuzz_serve --model m.onnx --requests 20000 --seed 3
    python -m bench.fuzz_serve --url http://127.0.0.1:8000 --requests 500   # a server already running

Without ``--url`` it starts the recipe of docs/workers.md (gunicorn, one uvicorn worker, a free
loopback port, small limits so the 413 cases stay cheap), and reads the server's log at the end.
Each request is a valid ``/run`` body with one mutation (truncated or flipped bytes, another JSON
value at a random place, wrong dtypes, shapes, names, out-of-range ids, deep nesting, bodies or
tensors over the limits). Prints the count of each (mutation, status); exits 1 when any answer is a
5xx or a status that mutation must not get, when the server stops answering, or when its log holds
a traceback.
"""
from __future__ import annotations

import argparse
import base64
import collections
import copy
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import onnxruntime as ort

from ortmem.ort.feeds import make_inputs
from ortmem.serve.server import encode
from ortmem.measure.synth import SynthConfig, cached_model

CLIENT_ERRORS = {400, 413, 422}
ANY_ANSWER = CLIENT_ERRORS | {200}
# The limits a started server gets: small, so requests over them are small too.
LIMIT_ENV = {"ORTMEM_SERVE_MAX_BODY_BYTES": "256KiB", "ORTMEM_SERVE_MAX_INPUT_ELEMENTS": "20000",
             "ORTMEM_SERVE_MAX_TOTAL_ELEMENTS": "20000", "ORTMEM_SERVE_MAX_OUTPUT_ELEMENTS": "4000000"}
JSON_VALUES: list[Any] = [None, True, 0, -1, 1.5, 2**70, "", "x", "<f4", [], [1], [[1]], {}, {"a": 1},
                          float("nan"), "A" * 1000]

Mutation = Callable[[random.Random, dict, dict], tuple[bytes, set[int]]]


def _dump(body: Any) -> bytes:
    return json.dumps(body).encode()


def _first(body: dict) -> tuple[str, dict]:
    name = next(iter(body["inputs"]))
    return name, body["inputs"][name]


def truncated(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    data = _dump(body)
    return data[:rng.randrange(len(data))], {400}


def flipped_bytes(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    data = bytearray(_dump(body))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data), ANY_ANSWER  # a flip inside base64 may still decode to valid ids


def random_bytes(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))), {400}


def replaced_value(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    """Another JSON value at a random place of the body (the body itself included)."""
    body = copy.deepcopy(body)
    holders = list(_holders(body))
    value = rng.choice(JSON_VALUES)
    if not holders or rng.random() < 0.1:
        return _dump(value), {400}
    parent, key = rng.choice(holders)
    parent[key] = value
    return _dump(body), ANY_ANSWER


def _holders(node: Any) -> Iterator[tuple[Any, Any]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield node, key
        yield from _holders(child)


def wrong_dtype(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    body = copy.deepcopy(body)
    _, tensor = _first(body)
    tensor["dtype"] = rng.choice(["<i4", "<f8", "|b1", "O", "V8", "<U3", "f4,i4", "(2,)f4", "nonsense", "<M8"])
    return _dump(body), {400, 422}


def wrong_shape(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    body = copy.deepcopy(body)
    _, tensor = _first(body)
    rank = len(tensor["shape"])
    if rng.random() < 0.2:  # any small shape: the bytes may fill it (same element count)
        tensor["shape"] = [rng.randint(0, 9) for _ in range(rank)]
        return _dump(body), ANY_ANSWER
    tensor["shape"] = rng.choice([
        [], [1] * (rank + 1), [-1] * rank, [2**62] * rank, [1, 2**40][:rank] + [1] * (rank - 2),
        ["a"] * rank, [1.5] * rank, [True] * rank, [1] * 100,
    ])
    return _dump(body), CLIENT_ERRORS


def wrong_names(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    body = copy.deepcopy(body)
    name, tensor = _first(body)
    choice = rng.randrange(4)
    if choice == 0:
        body["inputs"]["nope" + str(rng.randrange(100))] = tensor
    elif choice == 1:
        del body["inputs"][name]
    elif choice == 2:
        body["outputs"] = ["nope"]
    else:
        body["outputs"] = info["outputs"] * 2
    return _dump(body), {400}


def bad_ids(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    """Integer inputs far outside any table (a model of another kind gets whatever it says)."""
    body = copy.deepcopy(body)
    name, tensor = _first(body)
    dtype, shape = np.dtype(tensor["dtype"]), tensor["shape"]
    if dtype.kind not in "iu":
        return _dump(body), ANY_ANSWER
    bad = rng.choice([10**6, 2**40, int(np.iinfo(dtype).max), -(10**6), int(np.iinfo(dtype).min)])
    values = np.full(shape, bad, dtype=dtype)
    tensor["b64"] = base64.b64encode(values.tobytes()).decode()
    return _dump(body), {422}


def deep_nesting(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    depth = rng.choice([2_000, 100_000])
    inner = "[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
    return ('{"inputs": ' + inner + "}").encode(), {400, 413}  # 413 when over the body limit


def huge_number(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    body = copy.deepcopy(body)
    _, tensor = _first(body)
    text = _dump(body).decode().replace(json.dumps(tensor["shape"]), "[1, " + "9" * 5000 + "]")
    return text.encode(), {400}


def over_limits(rng: random.Random, body: dict, info: dict) -> tuple[bytes, set[int]]:
    """A body over the byte limit, or a shape over an element limit with few bytes sent."""
    limits = info.get("limits", {})
    body = copy.deepcopy(body)
    if rng.random() < 0.5 and limits.get("max_body_bytes"):
        body["padding"] = "x" * (limits["max_body_bytes"] + 1)
        return _dump(body), {413}
    _, tensor = _first(body)
    if not limits.get("max_input_elements"):
        return _dump(body), ANY_ANSWER
    tensor["shape"] = [1] * (len(tensor["shape"]) - 1) + [limits["max_input_elements"] + 1]
    return _dump(body), {413, 422}  # 422 where the model fixes that dim


MUTATIONS: list[Mutation] = [truncated, flipped_bytes, random_bytes, replaced_value, wrong_dtype, wrong_shape,
                             wrong_names, bad_ids, deep_nesting, huge_number, over_limits]


def post(host: str, port: int, data: bytes, timeout: float = 60) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/run", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw[:200]


def fuzz(url: str, requests: int, seed: int, valid: dict, info: dict) -> tuple[collections.Counter, list[str]]:
    """Send ``requests`` mutated bodies; the count per (mutation, status) and every failure."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    for i in range(requests):
        mutation = rng.choice(MUTATIONS)
        data, allowed = mutation(rng, valid, info)
        status, answer = post(host, int(port), data)
        counts[(mutation.__name__, status)] += 1
        has_reason = isinstance(answer, dict) and ("error" in answer or status == 200)
        if status not in allowed or not has_reason:
            failures.append(f"#{i} {mutation.__name__}: {status} {str(answer)[:200]} for {data[:120]!r}")
    status, _ = post(host, int(port), _dump(valid))
    if status != 200:
        failures.append(f"the valid request got {status} after the fuzz")
    return counts, failures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """gunicorn with one uvicorn worker on a free loopback port, answering ``/info``."""
    port = _free_port()
    cmd = [sys.executable, "-m", "gunicorn", "-w", "1", "-k", "uvicorn_worker.UvicornWorker",
           "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "5", "ortmem.serve.server:app"]
    env = {**os.environ, "ORTMEM_SERVE_MODEL": model, "ORTMEM_SERVE_THREADS": "1", **LIMIT_ENV}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            get_info(url)
            return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                stop_server(server)
                raise RuntimeError(log_path.read_text(errors="replace")[-3000:]) from None
            time.sleep(0.2)


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def get_info(url: str) -> dict:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/info")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def valid_request(model: str) -> dict:
    """A request the model runs: inputs from its metadata (``measure.inputs.make_inputs``)."""
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return {"inputs": {k: encode(v) for k, v in make_inputs(sess, {"dims": {"seq": 4}}).items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model to serve and fuzz (default: a tiny synthetic Llama with a quantized embedding)")
    ap.add_argument("--url", help="fuzz a server already running (its model as --model); its log is not read")
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ortmem-fuzz-serve-") as d:
        model = args.model or str(cached_model(SynthConfig.tiny(storage="external", name="fuzz-serve",
                                                                embedding="quantized"), d))
        valid = valid_request(model)
        log_path = Path(d) / "server.log"
        server, url = (None, args.url) if args.url else start_server(model, log_path)
        start = time.perf_counter()
        try:
            counts, failures = fuzz(url, args.requests, args.seed, valid, get_info(url))
        finally:
            if server is not None:
                stop_server(server)
        log_text = log_path.read_text(errors="replace") if server is not None else ""
    if "Traceback" in log_text:
        failures.append("the server logged a traceback:\n" + log_text[log_text.index("Traceback"):][:3000])
    print(f"onnxruntime {ort.__version__}, seed {args.seed}, {args.requests} requests to {url}, "
          f"{time.perf_counter() - start:.1f} s")
    by_status = collections.Counter()
    for (name, status), n in sorted(counts.items()):
        print(f"  {name:15s} {status}: {n}")
        by_status[status] += n
    print("statuses: " + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items())) + f"; {len(failures)} failures")
    for line in failures:
        print("  " + line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
