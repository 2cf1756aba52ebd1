"""The KServe v2 protocol over gRPC against the same protocol over HTTP, on one SITS stack.

One stack as `sitsctl up` runs it (embedded Redis, the API under gunicorn, the gRPC server, 1 worker
with the default stream slots and batching; ONNX Runtime's intra-op threads 2, as `peers.py` gives
every system), the zoo `mlp` registered. Closed loops of C client threads (`online_serving.closed_loop`),
one row of 64 floats per request, each thread with its own tritonclient:

- `grpc`: `tritonclient.grpc` (raw tensor contents) to the gRPC server (`python -m sits_api.grpc`);
- `http`: `tritonclient.http` (binary tensor data, its default) to `POST /v2/models/mlp/infer`.

The two alternate for `--rounds` rounds; each figure is the median round. CPU is read from /proc for
the API (gunicorn's master and workers), the gRPC server, the worker (Celery's main process and its
children), Redis and this process (the clients) over each run, per request answered.

    python benchmarks/grpc_serving.py --quick     # 5 s runs, 1 round, 32 clients: about 1 minute
    python benchmarks/grpc_serving.py             # 15 s runs, 3 rounds, 32 clients: about 3 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.online_serving import CpuMeter, closed_loop  # noqa: E402
from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

ORT_THREADS = 2
INPUTS = 256


def start(home: Path) -> Stack:
    settings = Settings().with_overrides(paths={"home": home, "model_roots": (home,)},
                                         resources={"intra_op_threads": ORT_THREADS}, api={"port": 0})
    stack = Stack(settings, worker_count=1, api_port=0).start()
    stack.client().post("/v1/models", {"name": "mlp", "path": str(build_zoo(home / "models")["mlp"])})
    return stack


def grpc_call(stack: Stack, rows: list[np.ndarray]) -> Callable[[int], Callable[[int], Any]]:
    import tritonclient.grpc as grpcclient

    headers = {"authorization": f"Bearer {stack.api_key}"}

    def make_call(index: int) -> Callable[[int], Any]:
        client = grpcclient.InferenceServerClient(stack.settings.api.grpc_address())

        def call(n: int) -> None:
            tensor = grpcclient.InferInput("features", [1, 64], "FP32")
            tensor.set_data_from_numpy(rows[(index + n) % len(rows)])
            client.infer("mlp", [tensor], headers=headers)

        return call

    return make_call


def http_call(stack: Stack, rows: list[np.ndarray]) -> Callable[[int], Callable[[int], Any]]:
    import tritonclient.http as httpclient

    def make_call(index: int) -> Callable[[int], Any]:
        client = httpclient.InferenceServerClient(stack.api_url.removeprefix("http://"), network_timeout=60.0)

        def call(n: int) -> None:
            tensor = httpclient.InferInput("features", [1, 64], "FP32")
            tensor.set_data_from_numpy(rows[(index + n) % len(rows)])
            client.infer("mlp", [tensor], headers={"Authorization": f"Bearer {stack.api_key}"})

        return call

    return make_call


def pids(stack: Stack) -> dict[str, int]:
    named = {child.name: child.process.pid for child in stack.children}
    found = {"SITS api": named["api"], "gRPC server": named["grpc"], "worker": named["worker0"],
             "clients (bench)": os.getpid()}
    if stack.redis is not None and stack.redis.process is not None:
        found["redis"] = stack.redis.process.pid
    return found


class Meter(CpuMeter):
    """CPU of each process, its children counted for the API (gunicorn) and the worker (Celery's pool)."""

    @staticmethod
    def _read(name: str, pid: int) -> float:
        from benchmarks.online_serving import cpu_seconds

        return cpu_seconds(pid, with_children=name in ("SITS api", "worker"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 s runs, 1 round")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 15.0)
    rounds = args.rounds or (1 if args.quick else 3)
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((1, 64), dtype=np.float32) for _ in range(INPUTS)]
    threading.stack_size(1 << 20)
    with tempfile.TemporaryDirectory() as folder:
        stack = start(Path(folder) / "home")
        try:
            runs: dict[str, list[dict[str, Any]]] = {"grpc": [], "http": []}
            for make in (grpc_call, http_call):  # (warm both paths first)
                closed_loop(4, 1.0, make(stack, rows))
            for _ in range(rounds):
                for transport, make in (("grpc", grpc_call), ("http", http_call)):
                    run = closed_loop(args.clients, seconds, make(stack, rows), Meter(pids(stack)))
                    runs[transport].append(run)
                    print(f"{transport}: {run['rps']:,.0f} req/s, {run['errors']} errors", file=sys.stderr)
        finally:
            stack.stop()
    print(f"| transport | clients | req/s | p50 ms | p99 ms | {' | '.join(runs['grpc'][0]['cpu'])} "
          f"| server CPU ms/req |")
    print("| --- " * (6 + len(runs["grpc"][0]["cpu"])) + "|")
    for transport, done in runs.items():
        run = sorted(done, key=lambda r: r["rps"])[len(done) // 2]
        per = {name: value * 1000 / max(run["done"], 1) for name, value in run["cpu"].items()}
        server = sum(value for name, value in per.items() if name != "clients (bench)")
        print(f"| {transport} | {args.clients} | {run['rps']:,.0f} | {run['p50']:.1f} | {run['p99']:.1f} | "
              + " | ".join(f"{value:.2f}" for value in per.values()) + f" | {server:.2f} |")
        each = ", ".join(f"{r['rps']:,.0f}" for r in done)
        print(f"  ({transport} rounds: {each} req/s; median {statistics.median(r['rps'] for r in done):,.0f})",
              file=sys.stderr)


if __name__ == "__main__":
    main()
