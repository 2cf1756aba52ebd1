"""Hot re-score of waiting items: how long each Redis call blocks (target: none over 5 ms).

Fills one queue with N waiting items (default 100,000), then re-scores them all
under new weights while a client keeps enqueuing and leasing, and reads Redis's
own SLOWLOG (which times every command inside the server) for the distribution
of the re-score script's durations.

    python benchmarks/rescore.py [--items 100000] [--count 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.jobs import fills as job_fills  # noqa: E402
from broker.jobs import records as jobs  # noqa: E402
from broker.queueing import (
    leases,
    policy,  # noqa: E402
    )
from broker.queueing.scoring import Weights  # noqa: E402
from broker.state.embedded import EmbeddedRedis  # noqa: E402
from broker.state.store import Store  # noqa: E402


def spec(job_id: str, rows: int) -> jobs.JobSpec:
    return jobs.JobSpec(job_id=job_id, model_name="m", model_version="v1", input_batch="/x.npy", input_format="npy",
                        input_checksum="c", output_dir="/o", output_names=["y"], rows_total=rows, chunk_size=1,
                        batch_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--count", type=int, default=32, help="ZSCAN COUNT per re-score call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), appendonly=False) as server:
        store = Store.connect(server.url)
        now = time.time()
        for start in range(0, args.items, 20_000):
            job_fills.create_job(store, spec(f"j{start}", min(20_000, args.items - start)), now=now)
        store.client.config_set("slowlog-log-slower-than", 0)
        store.client.config_set("slowlog-max-len", 100_000)
        store.client.slowlog_reset()
        stop = threading.Event()
        served = {"enqueued": 0, "leased": 0}

        def traffic() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                weights, ordering = policy.get_policy(store, default="dynamic")
                job_fills.create_job(store, spec(f"live{n}", 2), now=time.time(), weights=weights, ordering=ordering)
                served["enqueued"] += 2
                served["leased"] += len(leases.lease_batch(store, "m@v1", leases.LeaseOptions(max_items=1),
                                                           now=time.time(), lease_seconds=60).items)
                stop.wait(0.002)

        thread = threading.Thread(target=traffic)
        thread.start()
        started = time.perf_counter()
        weights = Weights(alpha=1.0, delta=0.5)
        policy.save_policy(store, weights, "dynamic")
        report = policy.rescore_all(store, weights, "dynamic", count=args.count)
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join()
        durations = sorted(entry["duration"] for entry in store.client.slowlog_get(100_000)
                           if b"EVALSHA" in entry["command"] and b" ready " in entry["command"])
    pick = lambda q: durations[min(len(durations) - 1, int(q * len(durations)))] / 1000  # noqa: E731
    print(f"\nHot re-score of {args.items:,} waiting items, ZSCAN COUNT {args.count}, with live traffic\n")
    print("| items re-scored | calls | wall time s | call p50 ms | call p99 ms | call max ms | over 5 ms | "
          "enqueued meanwhile | leased meanwhile |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {report['rescored']:,} | {report['calls']:,} | {elapsed:.2f} | {pick(0.5):.3f} | {pick(0.99):.3f} | "
          f"{durations[-1] / 1000:.3f} | {sum(d > 5000 for d in durations)} | {served['enqueued']:,} | "
          f"{served['leased']:,} |")


if __name__ == "__main__":
    main()
