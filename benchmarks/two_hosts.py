"""Two worker hosts vs one: a CPU-bound job (the zoo's convnet) on one single-stream worker per host.

The hosts are network namespaces (`tests/e2e/netns_hosts.py`): each reaches the stack's embedded Redis,
which listens on the bridge between them (`redis.bind`), over its own veth link, and sees the shared
folder at the same path. The API stays in the root namespace. Each worker runs one stream of one ONNX
Runtime thread, so one host keeps one core busy. One-host and two-host runs alternate (the second
host's worker is started before each two-host run and stopped after it), so drift in the machine's
speed hits both; medians are reported. The figure is the job's rows over its own time from first lease
to finalized manifest. Target: two hosts at least 1.8 times one. Needs root and `ip` (iproute2).

    sudo .venv/bin/python benchmarks/two_hosts.py              # 8,192 rows, 3 pairs of runs
    sudo .venv/bin/python benchmarks/two_hosts.py --rows 4096 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402
from tests.e2e.netns_hosts import Hosts, fake_hosts, why_no_namespaces  # noqa: E402
from tests.e2e.stack_helpers import register, stack_settings  # noqa: E402


def run_job(stack: Stack, data: Path, out: Path, chunk: int, batch: int) -> dict:
    """Submit the job and wait for it (rare polls: the API shares the cores); returns the finished job."""
    client = stack.client()
    job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(data), "output_dir": str(out),
                                   "chunk_size": chunk, "batch_size": batch})
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.25)
        job = client.get(f"/v1/jobs/{job['id']}")
    if job["status"] != "succeeded":
        raise SystemExit(f"job failed: {job['error']}")
    return job


def rows_per_second(job: dict) -> float:
    """The job's rows over its time from first lease to finalized manifest."""
    return float(job["rows_total"]) / (job["finished_at"] - job["started_at"])


def busy_slots(job: dict) -> float:
    """How many stream slots ran the job's chunks on average over its time: 2 when both hosts never idled."""
    return float(job.get("busy_seconds") or 0.0) / (job["finished_at"] - job["started_at"])


def measure(hosts: Hosts, home: Path, rows: int, chunk: int, batch: int, repeats: int) -> list[tuple[float, float]]:
    """(one host's rows/s, two hosts' rows/s) for each of `repeats` alternating pairs of runs."""
    settings = stack_settings(home, streams=1).with_overrides(redis={"bind": hosts.redis_address})
    stack = Stack(settings, worker_count=0, api_port=0).start()
    try:
        register(stack.client(), "convnet", build_zoo(home / "models")["convnet"])
        data = home / "images.npy"
        np.save(data, np.random.default_rng(0).standard_normal((rows, 3, 32, 32), dtype=np.float32))
        stack.start_worker(0, launcher=hosts.launcher(0))
        stack.wait_for_workers(1, timeout=60)
        run_job(stack, data, home / "warm", chunk, batch)  # the session, the page cache
        pairs = []
        for repeat in range(repeats):
            alone = run_job(stack, data, home / f"one-{repeat}", chunk, batch)
            one = rows_per_second(alone)
            stack.start_worker(1, launcher=hosts.launcher(1))
            stack.wait_for_workers(2, timeout=60)
            run_job(stack, data, home / f"warm-{repeat}", chunk, batch)  # its session
            job = run_job(stack, data, home / f"two-{repeat}", chunk, batch)
            two = rows_per_second(job)
            stack.stop_child("worker1")
            pairs.append((one, two))
            split = "/".join(str(count) for _, count in sorted(job["workers"].items()))
            print(f"pair {repeat + 1}: one host {one:,.0f} rows/s (slot busy {busy_slots(alone):.2f} on average), "
                  f"two hosts {two:,.0f} rows/s (chunks {split}, slots busy {busy_slots(job):.2f}), "
                  f"{two / one:.2f}x", flush=True)
        return pairs
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8_192)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating pairs of runs; medians are shown")
    args = parser.parse_args()
    if reason := why_no_namespaces():
        raise SystemExit(f"cannot make worker hosts here: {reason}")
    with tempfile.TemporaryDirectory(prefix="sits-bench-") as tmp, fake_hosts(2) as hosts:
        pairs = measure(hosts, Path(tmp), args.rows, args.chunk_size, args.batch_size, args.repeats)
    one, two = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    ratio = statistics.median(p[1] / p[0] for p in pairs)
    print(f"\nconvnet, {args.rows:,} rows in chunks of {args.chunk_size} (batches of {args.batch_size}); one "
          f"single-stream worker (1 ONNX Runtime thread) per host; {os.cpu_count()} cores; median of "
          f"{args.repeats} pairs; load average before the last pair ended: {os.getloadavg()[0]:.1f}\n")
    print("| hosts | rows/s | vs one host |")
    print("| ---: | ---: | ---: |")
    print(f"| 1 | {one:,.0f} | 1.00 |")
    print(f"| 2 | {two:,.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
