"""Run units against fixed sizes: many small jobs and one large job with a deadline, through the whole system.

One large job with a deadline is submitted, then many small jobs of the same model at once (from a few
client threads, as a batch pipeline would). Each arm runs on a fresh stack (API, Redis, one Celery
worker with the default streams), alternating so that drift in the machine's speed hits both:

- `fixed`: `jobs.merge_chunks: 1`, every leased chunk runs alone, at the size it was cut to at submit
  (SITS before run-time granularity);
- `units`: `jobs.merge_chunks: 16`, run units (a slot that leases a chunk takes further waiting chunks of
  the model and tenant along while they run within `jobs.unit_seconds`, in shared mini-batches);
- `split` (with `--split`): run units and `jobs.split_chunks: true` (a chunk running past twice
  `jobs.chunk_seconds` at the rate it shows ends early, its rest queued as a new chunk).

Reported per arm (medians over the repeats): the time from the first submit to the last job's end, the
large job's end against its deadline and its chunks at the end, the small jobs' median time from submit to
end, and the model's runs and mean rows a run (the workers' batch-size histogram). `--large-chunk` submits
the large job with that chunk size (a client's choice) instead of the server's `auto`.

    python benchmarks/run_units.py                       # convnet: 120 jobs of 32 images, one of 4,096
    python benchmarks/run_units.py --model mlp --small-rows 256 --large-rows 2000000
    python benchmarks/run_units.py --large-chunk 4096 --split   # the large job as one chunk; splits too
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from broker.monitoring.batch_sizes import decode_batch_sizes  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

SHAPES = {"mlp": (64,), "convnet": (3, 32, 32)}
ARMS = {"fixed": {"merge_chunks": 1}, "units": {"merge_chunks": 16},
        "split": {"merge_chunks": 16, "split_chunks": True}}


def run_arm(arm: str, args: argparse.Namespace, data: Path, work: Path, models: dict[str, Path]) -> dict[str, float]:
    """One arm on a fresh stack whose home is under `work`, its inputs in `data`; its figures."""
    home = work / arm
    settings = Settings().with_overrides(
        paths={"home": home, "model_roots": (data,), "input_roots": (data,), "output_roots": (work,)},
        jobs=ARMS[arm])
    with Stack(settings, worker_count=1, api_port=0) as stack:
        client = stack.client()
        record = client.post("/v1/models", {"name": args.model, "path": str(models[args.model]),
                                            "profile_mode": "full"})
        while record["profile_status"] == "pending":
            time.sleep(0.25)
            record = client.get(f"/v1/models/{record['ref']}")
        sized = {"batch_size": args.batch_size} if args.batch_size else {}
        warm = client.post("/v1/jobs", {"model": args.model, "input_batch": str(data / "small-0.npy"),
                                        "output_dir": str(home / "warm"), **sized})
        _wait(client, [warm["id"]])
        started = time.time()
        chunked = {"chunk_size": args.large_chunk} if args.large_chunk else {}
        large = client.post("/v1/jobs", {"model": args.model, "input_batch": str(data / "large.npy"),
                                         "output_dir": str(home / "large"), "deadline_s": args.deadline, **sized,
                                         **chunked})

        def submit(number: int) -> str:
            own = stack.client()
            return str(own.post("/v1/jobs", {"model": args.model,
                                             "input_batch": str(data / f"small-{number % args.inputs}.npy"),
                                             "output_dir": str(home / f"small-{number}"), **sized})["id"])

        with ThreadPoolExecutor(args.clients) as pool:
            small = list(pool.map(submit, range(args.small_jobs)))
        jobs = _wait(client, [large["id"], *small])
        ended = max(job["finished_at"] for job in jobs.values())
        big = jobs[large["id"]]
        assert stack.store is not None
        rows = decode_batch_sizes(stack.store.client.hgetall(stack.store.keys.batch_sizes)).get((record["ref"], "rows"))
    return {"total": ended - started, "large_end": big["finished_at"] - started,
            "large_late": big["finished_at"] - (started + args.deadline), "large_chunks": float(big["chunks_total"]),
            "small_median": statistics.median(jobs[job]["finished_at"] - jobs[job]["created_at"] for job in small),
            "runs": float(rows.count if rows else 0), "rows_per_run": rows.total / rows.count if rows else 0.0}


def _wait(client, ids: list[str]) -> dict[str, dict]:
    """Wait until every job ended, reading one job at a time (the first not ended yet) every 0.1 s; each must
    have succeeded. The figures are the server's own timestamps, so how often this reads changes none of
    them; reading every job five times a second, as this did, took the API and Redis about half the
    worker's CPU on two cores and slowed the work it measures."""
    done: dict[str, dict] = {}
    for job_id in ids:
        while (job := client.get(f"/v1/jobs/{job_id}"))["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.1)
        if job["status"] != "succeeded":
            raise SystemExit(f"job {job_id} {job['status']}: {job.get('error')}")
        done[job_id] = job
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="convnet")
    parser.add_argument("--small-jobs", type=int, default=120)
    parser.add_argument("--small-rows", type=int, default=32)
    parser.add_argument("--inputs", type=int, default=8, help="distinct small input files (jobs share them)")
    parser.add_argument("--large-rows", type=int, default=4_096)
    parser.add_argument("--deadline", type=float, default=15.0, help="the large job's deadline, seconds after submit")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="every job's batch size (0: the server's auto; a profile measured on each fresh stack "
                             "may pick another size per arm on a CPU's flat curve)")
    parser.add_argument("--clients", type=int, default=4, help="threads submitting the small jobs")
    parser.add_argument("--large-chunk", type=int, default=0, help="the large job's chunk size (0: auto)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each arm; medians shown")
    parser.add_argument("--split", action="store_true", help="a third arm: run units and chunk splits")
    args = parser.parse_args()
    arms = list(ARMS) if args.split else ["fixed", "units"]
    rng = np.random.default_rng(0)
    figures: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="sits-units-") as tmp:
        home = Path(tmp)
        models = build_zoo(home / "models")
        for number in range(args.inputs):
            np.save(home / f"small-{number}.npy",
                    rng.standard_normal((args.small_rows, *SHAPES[args.model])).astype(np.float32))
        np.save(home / "large.npy", rng.standard_normal((args.large_rows, *SHAPES[args.model])).astype(np.float32))
        for repeat in range(args.repeats):
            order = arms if repeat % 2 == 0 else list(reversed(arms))
            for arm in order:
                figures[arm].append(run_arm(arm, args, home, home / f"r{repeat}", models))
                print(arm, {key: round(value, 2) for key, value in figures[arm][-1].items()}, flush=True)
    print(f"\n{args.model}: one job of {args.large_rows:,} rows (chunk size {args.large_chunk or 'auto'}, "
          f"deadline {args.deadline:g} s) and "
          f"{args.small_jobs} jobs of {args.small_rows} rows, batch size {args.batch_size or 'auto'}, "
          f"median of {args.repeats} alternating runs\n")
    print("| arm | all done (s) | large job done (s) | deadline | large job's chunks | small job, submit to end (s) "
          "| runs | rows a run |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for arm, runs in figures.items():
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        met = "met" if all(run["large_late"] <= 0 for run in runs) else "missed"
        print(f"| {arm} | {med['total']:.2f} | {med['large_end']:.2f} | {met} | {med['large_chunks']:.0f} "
              f"| {med['small_median']:.2f} "
              f"| {med['runs']:,.0f} | {med['rows_per_run']:.1f} |")


if __name__ == "__main__":
    main()
