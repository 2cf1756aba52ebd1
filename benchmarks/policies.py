"""The policy table: round-robin vs graph-aware-backfill on a mixed stream of three zoo models.

For each policy (and each device-memory setting) one stack runs: 1 CPU worker with 2 streams
(1 ONNX Runtime thread each), mlp + convnet + transformer registered, and C client threads
sending one-row requests, each thread to one model, for a fixed time. Reported: req/s, P99
latency per model and overall, mean batch, and the worker's time-weighted memory
fragmentation (reserved but unused / reserved, reservations in 128 MiB units).

    python benchmarks/policies.py [--seconds 10] [--clients 12] [--memory 16GiB,384MiB]
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config import Settings  # noqa: E402
from sits_api.cli.client import ApiClient, ApiError  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

MODELS = {"mlp": ("features", (64,), np.float32), "convnet": ("pixels", (3, 32, 32), np.float32),
          "transformer": ("input_ids", (16,), np.int64)}


def b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def run(policy: str, memory: str, seconds: float, clients: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sits-policy-") as tmp:
        home = Path(tmp)
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            scheduler={"policy": policy}, resources={"max_concurrent_streams": 2, "intra_op_threads": 1,
                                                     "device_memory": memory},
            api={"port": 0})
        with Stack(settings, worker_count=1, api_port=0) as stack:
            paths = build_zoo(home / "models")
            admin = stack.client()
            for name in MODELS:
                admin.post("/v1/models", {"name": name, "path": str(paths[name])})
            admin.request("PUT", "/v1/policy", {"ordering": "dynamic"})
            rng = np.random.default_rng(0)
            bodies = {}
            for name, (input_name, shape, dtype) in MODELS.items():
                is_ids = dtype == np.int64
                data = rng.integers(0, 1000, size=(1, *shape)) if is_ids else rng.standard_normal((1, *shape))
                bodies[name] = {"model": name, "inputs": {input_name: {"b64": b64(data.astype(dtype))}}, "wait": True}
            latencies: dict[str, list[float]] = {name: [] for name in MODELS}
            batches: list[int] = []
            errors = [0]
            ends = time.monotonic() + seconds
            lock = threading.Lock()

            def client(name: str) -> None:
                api = ApiClient(stack.api_url, stack.api_key)
                while time.monotonic() < ends:
                    started = time.perf_counter()
                    try:
                        answer = api.post("/v1/requests", bodies[name])
                    except ApiError:
                        with lock:
                            errors[0] += 1
                        continue
                    with lock:
                        latencies[name].append((time.perf_counter() - started) * 1000)
                        batches.append(answer.get("batch_size") or 0)

            threads = [threading.Thread(target=client, args=(list(MODELS)[i % len(MODELS)],)) for i in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(2.5)  # one more heartbeat carries the ledger's final figures
            memory_stats = admin.get("/v1/status")["workers"][0]["memory"]
    every = [value for values in latencies.values() for value in values]
    return {"policy": policy, "memory": memory, "rps": len(every) / seconds,
            "p99": float(np.percentile(every, 99)) if every else float("nan"),
            "p99_by_model": {name: float(np.percentile(v, 99)) if v else float("nan") for name, v in latencies.items()},
            "mean_batch": float(np.mean(batches)) if batches else 0.0,
            "fragmentation": memory_stats["fragmentation_mean"], "errors": errors[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--memory", default="16GiB,384MiB", help="device memory settings to run")
    args = parser.parse_args()
    rows = [run(policy, memory, args.seconds, args.clients) for memory in args.memory.split(",")
            for policy in ("round-robin", "graph-aware-backfill")]
    print(f"\nMixed stream (mlp, convnet, transformer 16 tokens), {args.clients} closed-loop clients, "
          f"{args.seconds:.0f} s each; 1 CPU worker, 2 streams x 1 ORT thread; dynamic ordering\n")
    print("| device memory | policy | req/s | P99 ms | P99 mlp | P99 convnet | P99 transformer | mean batch | "
          "fragmentation | errors |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        by = row["p99_by_model"]
        print(f"| {row['memory']} | {row['policy']} | {row['rps']:.0f} | {row['p99']:.1f} | {by['mlp']:.1f} | "
              f"{by['convnet']:.1f} | {by['transformer']:.1f} | {row['mean_batch']:.1f} | "
              f"{row['fragmentation'] * 100:.1f} % | {row['errors']} |")


if __name__ == "__main__":
    main()
