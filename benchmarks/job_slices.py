"""Queueing and cancelling a job of many chunks: the longest single Redis call, sliced vs one call.

A job's chunks are queued (and, on a cancel, taken out) in calls of `job_slices.ENQUEUE_SLICE` items, so
that no call holds Redis, and with it every online request, for long. This creates and then cancels
jobs of N one-row chunks on an embedded Redis, once in slices and once in a single call (the
baseline, as before slicing), and reads Redis's own SLOWLOG (which times every command inside the
server) for the longest call of each.

    python benchmarks/job_slices.py [--chunks 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.jobs import fills as job_fills  # noqa: E402
from broker.jobs import records as jobs  # noqa: E402
from broker.jobs import slices as job_slices  # noqa: E402
from broker.jobs import stops as job_stops  # noqa: E402
from broker.state.embedded import EmbeddedRedis  # noqa: E402
from broker.state.store import Store  # noqa: E402


def spec(job_id: str, chunks: int) -> jobs.JobSpec:
    return jobs.JobSpec(job_id=job_id, model_name="m", model_version="v1", input_batch="/x.npy", input_format="npy",
                        input_checksum="c", output_dir="/o", output_names=["y"], rows_total=chunks, chunk_size=1,
                        batch_size=1)


def script_calls_ms(store: Store) -> list[float]:
    """How long each script call since the last reset took inside Redis, in ms, sorted."""
    calls = [entry["duration"] / 1000 for entry in store.client.slowlog_get(1_000_000)
             if b"EVALSHA" in entry["command"]]
    store.client.slowlog_reset()
    return sorted(calls)


def measure(store: Store, job_id: str, chunks: int) -> dict[str, float]:
    store.client.slowlog_reset()
    started = time.perf_counter()
    job_fills.create_job(store, spec(job_id, chunks), now=time.time())
    created = time.perf_counter() - started
    create = script_calls_ms(store)
    started = time.perf_counter()
    job_stops.stop_job(store, job_id, status="cancelled", error="", now=time.time())
    stopped = time.perf_counter() - started
    stop = script_calls_ms(store)
    p99 = lambda calls: calls[min(len(calls) - 1, int(0.99 * len(calls)))]  # noqa: E731
    return {"create_s": created, "create_calls": len(create), "create_p99_ms": p99(create), "create_max_ms": create[-1],
            "stop_s": stopped, "stop_calls": len(stop), "stop_p99_ms": p99(stop), "stop_max_ms": stop[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="1000,10000,100000", help="comma-separated chunk counts")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), appendonly=False) as server:
        # a socket timeout above redis-py's default 5 s, which one call of 100,000 items outlasts (the API
        # answered 503 while the job was created anyway): here it is measured, not refused
        store = Store(redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=120))
        store.client.config_set("slowlog-log-slower-than", 0)
        store.client.config_set("slowlog-max-len", 1_000_000)
        sliced = job_slices.ENQUEUE_SLICE
        for chunks in (int(count) for count in args.chunks.split(",")):
            for label, size in (("one call (before)", 10**9), (f"slices of {sliced}", sliced)):
                job_slices.ENQUEUE_SLICE = size
                rows.append((chunks, label, measure(store, f"j{chunks}-{size}", chunks)))
        job_slices.ENQUEUE_SLICE = sliced
    print("\nQueueing and cancelling a job of N chunks (embedded Redis, no AOF): wall time, and the longest "
          "single script call inside Redis (SLOWLOG)\n")
    print("| chunks | enqueue | create s | calls | call p99 ms | longest ms | cancel s | calls | call p99 ms | "
          "longest ms |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for chunks, label, row in rows:
        late = " (over 5 s: a 503)" if row["create_s"] > 5 else ""
        print(f"| {chunks:,} | {label} | {row['create_s']:.3f}{late} | {row['create_calls']:,} "
              f"| {row['create_p99_ms']:.1f} | {row['create_max_ms']:.1f} | {row['stop_s']:.3f} "
              f"| {row['stop_calls']:,} | {row['stop_p99_ms']:.1f} | {row['stop_max_ms']:.1f} |")


if __name__ == "__main__":
    main()
