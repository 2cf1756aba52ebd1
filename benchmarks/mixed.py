"""Offline jobs and online requests of the same model at once: requests riding in the jobs' mini-batches
(`scheduler.merge_requests_into_jobs`) against requests run apart, measured side by side.

For each model and phase one stack runs: 1 CPU worker with 2 streams (1 ONNX Runtime thread each),
the shipped settings otherwise; the model registered with a measured profile (riders are filled
with job rows by its latency curve). Jobs of the model (chunks of `--chunk` rows, mini-batches of 128)
keep both stream slots busy, while C client threads send one-row requests (`wait: true`) with a
think time between them, until the last job ends. Phases, alternating per round:
  alone   the jobs without online traffic (the jobs' own rate, for reference)
  apart   with online traffic, merge off: a request runs in a batch of its own, on a slot a chunk
          lends it between two mini-batches when it outranks the chunk, else after the chunks
  merged  with online traffic, merge on: a request also rides in a chunk's next mini-batch
Reported: job rows/s (and as a share of `alone`), requests served per second during the jobs,
their P50/P99 latency, the share that shared a run with job rows (`job_rows` > 0 in the result), and
failures.

    python benchmarks/mixed.py --quick   # about 1.5 minutes
    python benchmarks/mixed.py           # about 4 minutes: 2 rounds
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.client import ApiClient, ApiError  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

PHASES = ("alone", "apart", "merged")
MODELS = {"mlp": ("features", (64,)), "convnet": ("pixels", (3, 32, 32))}
JOB_BATCH = 128


def b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


FIXED_BATCHING = {"max_batch_size": 64, "max_queue_delay": 0}
"""`--batching fixed`: the online batching settings before they followed the profile."""


def run_phase(model: str, phase: str, *, rows: int, jobs: int, chunk: int, clients: int,
              think: float, batching: str = "auto") -> dict[str, Any]:
    """One stack, `jobs` jobs of `rows` rows, with or without online clients; the raw figures."""
    input_name, shape = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="sits-mixed-") as tmp:
        home = Path(tmp)
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            scheduler={"merge_requests_into_jobs": phase == "merged"},
            resources={"max_concurrent_streams": 2, "intra_op_threads": 1},
            online={"batching": FIXED_BATCHING if batching == "fixed" else {}},
            api={"port": 0})
        rng = np.random.default_rng(0)
        np.save(home / "input.npy", rng.standard_normal((rows, *shape)).astype(np.float32))
        one = rng.standard_normal((1, *shape)).astype(np.float32)
        body = {"model": model, "inputs": {input_name: {"b64": b64(one)}}, "wait": True}
        with Stack(settings, worker_count=1, api_port=0) as stack:
            admin = stack.client()
            record = admin.post("/v1/models", {"name": model, "path": str(build_zoo(home / "models")[model]),
                                               "profile_mode": "full"})  # riders fill by the measured curve
            while record["profile_status"] == "pending":
                time.sleep(0.2)
                record = admin.get(f"/v1/models/{record['ref']}")
            admin.post("/v1/requests", body)  # load the session before the clock starts
            latencies: list[float] = []
            job_rows: list[int] = []
            failures = [0]
            lock = threading.Lock()
            done = threading.Event()

            def client() -> None:
                api = ApiClient(stack.api_url, stack.api_key)
                while not done.is_set():
                    started = time.perf_counter()
                    try:
                        answer = api.post("/v1/requests", body)
                    except ApiError:
                        answer = {}
                    with lock:
                        if answer.get("status") == "succeeded" and not done.is_set():
                            latencies.append((time.perf_counter() - started) * 1000)
                            job_rows.append(int(answer.get("job_rows") or 0))
                        elif answer.get("status") != "succeeded":
                            failures[0] += 1
                    time.sleep(think)

            ids = [admin.post("/v1/jobs", {"model": model, "input_batch": str(home / "input.npy"),
                                           "output_dir": str(home / f"out{index}"), "chunk_size": chunk,
                                           "batch_size": JOB_BATCH})["id"] for index in range(jobs)]
            started = time.monotonic()
            threads = [threading.Thread(target=client) for _ in range(clients if phase != "alone" else 0)]
            for thread in threads:
                thread.start()
            finished = []
            for job_id in ids:
                while (job := admin.get(f"/v1/jobs/{job_id}"))["status"] not in ("succeeded", "failed", "cancelled"):
                    time.sleep(0.1)
                finished.append(job)
            done.set()
            wall = time.monotonic() - started
            for thread in threads:
                thread.join()
    if any(job["status"] != "succeeded" for job in finished):
        raise SystemExit(f"a job failed: {[job['error'] for job in finished]}")
    return {"rows_per_second": rows * jobs / wall, "seconds": wall, "latencies": latencies, "job_rows": job_rows,
            "failures": failures[0]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, smaller jobs")
    parser.add_argument("--models", default="mlp,convnet")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--think", type=float, default=0.02, help="seconds a client waits between requests")
    parser.add_argument("--batching", choices=("auto", "fixed"), default="auto",
                        help="online batching: auto (from the measured profile, the default settings) or fixed"
                             " (max_batch_size 64, no delay)")
    args = parser.parse_args()
    rounds = 1 if args.quick else 2
    sizes = {"mlp": (200_000, 16 if args.quick else 24, 20_000), "convnet": (2_000, 3 if args.quick else 4, 250)}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for model in args.models.split(","):
        rows, jobs, chunk = sizes[model]
        for _ in range(rounds):
            for phase in PHASES:
                run = run_phase(model, phase, rows=rows, jobs=jobs, chunk=chunk, clients=args.clients,
                                think=args.think, batching=args.batching)
                results.setdefault((model, phase), []).append(run)
                print(f"  {model} {phase}: {run['rows_per_second']:,.0f} rows/s, {len(run['latencies'])} requests",
                      file=sys.stderr)
    print(f"\n{args.clients} clients, {args.think * 1000:.0f} ms think time, {rounds} round(s), "
          f"{args.batching} batching; 1 worker, 2 streams, 1 ORT thread each; job batch {JOB_BATCH}\n")
    print("| model | phase | job rows/s | of alone | requests/s | P50 ms | P99 ms | rode along | failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        alone = statistics.median(run["rows_per_second"] for run in results[(model, "alone")])
        for phase in PHASES:
            runs = results[(model, phase)]
            rate = statistics.median(run["rows_per_second"] for run in runs)
            latencies = [value for run in runs for value in run["latencies"]]
            rode = [rows > 0 for run in runs for rows in run["job_rows"]]
            served = sum(len(run["latencies"]) for run in runs) / sum(run["seconds"] for run in runs)
            share = f"{sum(rode) / len(rode):.0%}" if rode else "-"
            print(f"| {model} | {phase} | {rate:,.0f} | {rate / alone:.2f} | "
                  f"{served:,.0f} | {percentile(latencies, 0.5):.1f} | {percentile(latencies, 0.99):.1f} | "
                  f"{share} | {sum(run['failures'] for run in runs)} |")


if __name__ == "__main__":
    main()
