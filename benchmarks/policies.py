"""The policy table: round-robin vs graph-aware-backfill on a mixed stream of three zoo models.

For each configuration and policy one stack runs: 1 worker (the first GPU when NVML sees one and
ONNX Runtime has the CUDA provider, else the CPU) with the config's streams (1 ONNX Runtime thread
each), three zoo models registered, and C closed-loop client threads sending
one-row requests (each thread to one model, a third of them per model) for a fixed time, after one
warm-up request per model. Runs alternate (round-robin, graph-aware-backfill, round-robin, ...) on
the same machine. Reported per configuration and policy: req/s (overall, per model), P99 latency
(overall, per model), mean batch, and from the worker's memory ledger the time-weighted
fragmentation (reserved but unused / reserved), batches running (of 2 stream slots) and memory
reserved (share of the device), memory waits (a free slot found work but memory admitted none; it
polls again about 1 ms later) and backfills (it got batches around a head that did not fit); and
the CPU seconds the worker and the API used per second.

Configurations:
  default       the shipped settings: 16 GiB device, 128 MiB units; transformer requests of 16 tokens
  memory-bound  a CPU worker on a shared box capped at 256 MiB of activations, 16 MiB units;
                transformer requests of 512 tokens (15.6 MiB of activations each by the profile)
  device-bound  for a GPU (not in the default run): resnet50 (about 101 MiB of activations per
                image) in place of the convnet, 4 streams, the ledger capped at 1 GiB in 128 MiB
                units, transformer requests of 512 tokens: batches of the three models compete
                for memory and the device, not for the REST path

    python benchmarks/policies.py --quick   # about 1 minute: 6 s runs, one of each
    python benchmarks/policies.py           # about 3.5 minutes: 10 s runs, 3 alternating rounds
    python benchmarks/policies.py --configs device-bound,memory-bound --quick   # on a GPU
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.online_serving import CpuMeter  # noqa: E402
from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.client import ApiClient, ApiError  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import LARGE_MODELS, build_zoo  # noqa: E402

POLICIES = ("round-robin", "graph-aware-backfill")


@dataclass(frozen=True)
class Config:
    """One row group of the table: device settings a user could run, and the request mix."""

    name: str
    device_memory: str | None
    """Caps the worker's ledger (`device_memory` and `device_memory_limit`); None: shipped settings."""
    granularity: str | None
    """The reservation unit, on a CPU or a GPU worker alike; None: shipped settings."""
    transformer_tokens: int
    explanation: str
    image_model: str = "convnet"
    """The zoo's small convnet, or `resnet50` (device-bound: milliseconds per image on a GPU)."""
    streams: int = 2
    """The worker's `max_concurrent_streams`."""

    @property
    def models(self) -> tuple[str, ...]:
        """The three models of the mixed stream, in table order."""
        return ("mlp", self.image_model, "transformer")

    def resources(self) -> dict[str, str]:
        """The `resources` overrides of this config."""
        if self.device_memory is None or self.granularity is None:
            return {}
        return {"device_memory": self.device_memory, "device_memory_limit": self.device_memory,
                "gpu_memory_granularity": self.granularity, "cpu_memory_granularity": self.granularity}

    def inputs(self) -> dict[str, tuple[str, tuple[int, ...], Any]]:
        """Model -> (input name, one request's shape without the batch axis, dtype)."""
        images = {"convnet": (3, 32, 32), "resnet50": (3, 224, 224)}
        return {"mlp": ("features", (64,), np.float32),
                self.image_model: ("pixels", images[self.image_model], np.float32),
                "transformer": ("input_ids", (self.transformer_tokens,), np.int64)}


CONFIGS = {
    "default": Config("default", None, None, 16,
                      "shipped settings (a CPU worker: 16 GiB, 2 MiB units; a GPU worker: NVML's capacity, "
                      "128 MiB units), transformer requests of 16 tokens: every batch needs a few MiB, memory "
                      "never binds"),
    "memory-bound": Config("memory-bound", "256MiB", "16MiB", 512,
                           "worker capped at 256 MiB on a shared device, 16 MiB units, transformer requests "
                           "of 512 tokens (15.6 MiB each): a full transformer batch (256 MiB by the profile) "
                           "fits only on an idle device"),
    "device-bound": Config("device-bound", "1GiB", "128MiB", 512,
                           "for a GPU: resnet50 in place of the convnet (about 101 MiB of activations per "
                           "image), 4 streams, the ledger capped at 1 GiB in 128 MiB units, transformer "
                           "requests of 512 tokens: a resnet50 batch of 8 or a full transformer batch "
                           "(256 MiB) fits only beside little else", image_model="resnet50", streams=4),
}
DEFAULT_CONFIGS = ("default", "memory-bound")


def b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def run(config: Config, policy: str, seconds: float, clients: int) -> dict[str, Any]:
    """One stack under `policy` and `config`; the raw figures of one run."""
    models = config.inputs()
    with tempfile.TemporaryDirectory(prefix="sits-policy-") as tmp:
        home = Path(tmp)
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            scheduler={"policy": policy},
            resources={"max_concurrent_streams": config.streams, "intra_op_threads": 1, **config.resources()},
            api={"port": 0})
        with Stack(settings, worker_count=1, api_port=0) as stack:
            paths = build_zoo(home / "models", include_large=config.image_model in LARGE_MODELS)
            admin = stack.client()
            for name in models:
                admin.post("/v1/models", {"name": name, "path": str(paths[name])})
            admin.request("PUT", "/v1/policy", {"ordering": "dynamic"})
            rng = np.random.default_rng(0)
            bodies = {}
            for name, (input_name, shape, dtype) in models.items():
                is_ids = dtype == np.int64
                data = rng.integers(1, 1000, size=(1, *shape)) if is_ids else rng.standard_normal((1, *shape))
                bodies[name] = {"model": name, "inputs": {input_name: {"b64": b64(data.astype(dtype))}}, "wait": True}
            for body in bodies.values():  # load every session before the clock starts
                admin.post("/v1/requests", body)
            latencies: dict[str, list[float]] = {name: [] for name in models}
            batches: list[int] = []
            errors = [0]
            lock = threading.Lock()
            pids = {"worker": next(child.process.pid for child in stack.children if child.name == "worker0"),
                    "SITS api": next(child.process.pid for child in stack.children if child.name == "api")}
            meter = CpuMeter(pids)
            ends = time.monotonic() + seconds

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

            threads = [threading.Thread(target=client, args=(list(models)[i % len(models)],)) for i in range(clients)]
            meter.start()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            cpu = meter.stop()
            time.sleep(2.5)  # one more heartbeat carries the ledger's final figures
            worker = admin.get("/v1/status")["workers"][0]
    return {"latencies": latencies, "batches": batches, "errors": errors[0], "seconds": seconds,
            "memory": worker["memory"], "device": worker.get("device", "?"),
            "cpu": {name: value / seconds for name, value in cpu.items()}}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the rounds of one (config, policy): latencies and counts pooled, ledger figures averaged."""
    seconds = sum(run["seconds"] for run in runs)
    by_model = {name: [v for run in runs for v in run["latencies"][name]] for name in runs[0]["latencies"]}
    every = [v for values in by_model.values() for v in values]
    batches = [b for run in runs for b in run["batches"]]

    def mean(pick: Any) -> float:
        return float(np.mean([pick(run) for run in runs]))

    return {"rps": len(every) / seconds,
            "rps_rounds": [sum(len(v) for v in run["latencies"].values()) / run["seconds"] for run in runs],
            "rps_by_model": {name: len(values) / seconds for name, values in by_model.items()},
            "p99": float(np.percentile(every, 99)) if every else float("nan"),
            "p99_by_model": {name: float(np.percentile(v, 99)) if v else float("nan") for name, v in by_model.items()},
            "mean_batch": float(np.mean(batches)) if batches else 0.0,
            "fragmentation": mean(lambda run: run["memory"]["fragmentation_mean"]),
            "running": mean(lambda run: run["memory"].get("batches_running_mean", float("nan"))),
            "reserved": mean(lambda run: run["memory"].get("reserved_share_mean", float("nan"))),
            "cpu_worker": mean(lambda run: run["cpu"]["worker"]), "cpu_api": mean(lambda run: run["cpu"]["SITS api"]),
            "waits": mean(lambda run: run["memory"].get("memory_waits", 0)),
            "backfills": mean(lambda run: run["memory"].get("backfills", 0)),
            "capacity": runs[0]["memory"]["capacity_bytes"], "device": runs[0]["device"],
            "errors": sum(run["errors"] for run in runs)}


def print_table(config: Config, rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{config.name}: {config.explanation}.")
    first = next(iter(rows.values()))
    capacity = first["capacity"] / 2**20
    unit = config.granularity or "shipped"
    print(f"device memory {config.device_memory or 'shipped'} (the worker's ledger: {capacity:.0f} MiB), "
          f"units {unit}; {args.clients} "
          f"closed-loop clients, {args.seconds:.0f} s x {args.rounds} round(s) per policy; 1 worker on "
          f"{first['device']}, {config.streams} streams x 1 ORT thread; dynamic ordering\n")
    names = " / ".join(config.models)
    print(f"| policy | req/s | req/s {names} | P99 ms | "
          + " | ".join(f"P99 {name}" for name in config.models)
          + f" | mean batch | fragmentation | batches running (of {config.streams}) | memory reserved"
          " | worker / API CPU (cores) | memory waits / backfills | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for policy, row in rows.items():
        rps, p99 = row["rps_by_model"], row["p99_by_model"]
        spread = (f" ({min(row['rps_rounds']):.0f}-{max(row['rps_rounds']):.0f})"
                  if len(row["rps_rounds"]) > 1 else "")
        print(f"| {policy} | {row['rps']:.0f}{spread} | {' / '.join(f'{rps[name]:.0f}' for name in config.models)} "
              f"| {row['p99']:.1f} | {' | '.join(f'{p99[name]:.1f}' for name in config.models)} "
              f"| {row['mean_batch']:.1f} | {row['fragmentation'] * 100:.1f} % | "
              f"{row['running']:.2f} | {row['reserved'] * 100:.1f} % | {row['cpu_worker']:.2f} / "
              f"{row['cpu_api']:.2f} | {row['waits']:.0f} / {row['backfills']:.0f} | {row['errors']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 s runs, one round (about 2 minutes)")
    parser.add_argument("--seconds", type=float, help="seconds per run (default 10, quick 6)")
    parser.add_argument("--rounds", type=int, help="alternating rounds per policy (default 3, quick 1)")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"which of {', '.join(CONFIGS)} (default: {', '.join(DEFAULT_CONFIGS)})")
    args = parser.parse_args()
    args.seconds = args.seconds or (6.0 if args.quick else 10.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    configs = [CONFIGS[name] for name in args.configs.split(",")]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for config in configs:
            for policy in POLICIES:
                runs.setdefault((config.name, policy), []).append(run(config, policy, args.seconds, args.clients))
    print(f"\nMixed stream of one-row requests to three zoo models ({' '.join(sys.argv[1:]) or 'full'})")
    for config in configs:
        print_table(config, {policy: summarize(runs[(config.name, policy)]) for policy in POLICIES}, args)


if __name__ == "__main__":
    main()
