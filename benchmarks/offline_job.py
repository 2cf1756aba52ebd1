"""Offline job throughput: the whole system (API, Redis queue, Celery worker) vs a bare ONNX Runtime loop.

Both sides use the same model and ONNX Runtime threads, measured in one run on
the same machine, alternating (bare, system, bare, ...) so that drift in the
machine's speed hits both; medians are reported. The bare loop runs at its
best batch size (`--batch best`, the default: a sweep over 64..2048 rows
before the pairs picks it) and the job with the server's defaults (`jobs.batch_size`
and `jobs.chunk_size` auto, from the measured profile); `--batch fixed` runs
both at each model's fixed batch size (the table's), as earlier figures did.
The system figure is the job's rows over its wall time from first lease to
the finalized manifest, so it includes leasing, input reads, part writes,
acks and the final merge. Target: the system keeps at least 90 % of the bare
loop at its best batch size for both models with one CPU worker (issue 3;
issue 2 asked for 80 %).

    python benchmarks/offline_job.py            # mlp and convnet, prints a Markdown table
    python benchmarks/offline_job.py --quick    # smaller inputs
    python benchmarks/offline_job.py --chunk-size default   # the server picks the chunk size (jobs.chunk_size)
    python benchmarks/offline_job.py --batch fixed --chunk-size fixed   # both sides at one fixed batch size
    python benchmarks/offline_job.py --chunk-size default --resources default   # the job at every default

Models are registered with `profile_mode=full` (by default), so `jobs.chunk_size: auto` finds a
measured throughput to size chunks from; with `--profile-mode static` it falls back to 4,096 rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.device.runtime import session_options  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

CASES = {  # model: (rows, rows in --quick, batch size, fixed chunk size, input maker)
    "mlp": (1_000_000, 200_000, 128, 65_536, lambda rng, n: rng.standard_normal((n, 64), dtype=np.float32)),
    "convnet": (8_192, 2_048, 64, 512, lambda rng, n: rng.standard_normal((n, 3, 32, 32), dtype=np.float32)),
}


BARE_SWEEP = (64, 128, 256, 512, 1024, 2048)
SWEEP_ROWS = {"mlp": 200_000, "convnet": 2_048}  # enough for a stable rate at each size, in a few seconds


def best_bare_loop(model_path: Path, inputs: np.ndarray, threads: int) -> tuple[float, int]:
    """(Rows/s, batch size) of the fastest bare loop over `BARE_SWEEP`."""
    return max((bare_loop(model_path, inputs, batch, threads), batch) for batch in BARE_SWEEP)


def bare_loop(model_path: Path, inputs: np.ndarray, batch: int, threads: int) -> float:
    """Rows/s of a plain session.run loop over all rows (after one warm-up batch), with the session
    options SITS's workers use (`sits_worker.device.runtime.session_options`: the same optimisation and spin)."""
    session = ort.InferenceSession(str(model_path), session_options(threads), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    session.run(None, {name: inputs[:batch]})
    started = time.perf_counter()
    for start in range(0, len(inputs), batch):
        session.run(None, {name: inputs[start : start + batch]})
    return len(inputs) / (time.perf_counter() - started)


def system_run(stack: Stack, model: str, data: Path, out: Path, batch: int | None, chunk: int | None) -> dict:
    """Submit the job through the REST API and wait for it; returns the finished job.

    `batch` / `chunk` None leave the batch / chunk size to the server (`jobs.batch_size`, `jobs.chunk_size`).
    """
    client = stack.client()
    body: dict = {"model": model, "input_batch": str(data), "output_dir": str(out)}
    body |= {"batch_size": batch} if batch else {}
    job = client.post("/v1/jobs", body if chunk is None else body | {"chunk_size": chunk})
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.25)  # rare polls: the API shares the cores; the figure comes from the job's own timestamps
        job = client.get(f"/v1/jobs/{job['id']}")
    if job["status"] != "succeeded":
        raise SystemExit(f"job failed: {job['error']}")
    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--rows-scale", type=float, default=1.0,
                        help="multiply every model's rows (a longer job amortizes its fixed costs: the last "
                             "chunk's commit and the final merge)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; medians are shown")
    parser.add_argument("--batch", choices=("best", "fixed"), default="best",
                        help="'best': the bare loop at its best batch size, the job at the server's default "
                             "(jobs.batch_size auto); 'fixed': both at the model's fixed batch size")
    parser.add_argument("--chunk-size", default="fixed",
                        help="'fixed': each model's own (the table's); 'default': none, the server picks "
                             "(jobs.chunk_size); or a number of rows")
    parser.add_argument("--chunk-seconds", type=float, default=None,
                        help="jobs.chunk_seconds of the stack (for --chunk-size default); unset: its default")
    parser.add_argument("--resources", choices=("one-stream", "default"), default="one-stream",
                        help="'one-stream': the worker runs one stream of --threads threads; 'default': the "
                             "server's resources.* defaults, as the worker fits them to its cores")
    parser.add_argument("--profile-mode", choices=("full", "static"), default="full",
                        help="how models are registered; 'full' measures the throughput that auto chunks use")
    args = parser.parse_args()
    if args.chunk_size not in ("fixed", "default") and not args.chunk_size.isdigit():
        parser.error("--chunk-size must be 'fixed', 'default' or a number of rows")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="sits-bench-") as tmp:
        home = Path(tmp)
        models = build_zoo(home / "models")
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            resources={"max_concurrent_streams": 1, "intra_op_threads": args.threads}
            if args.resources == "one-stream" else {},
            redis={"appendonly": True},
            **({"jobs": {"chunk_seconds": args.chunk_seconds}} if args.chunk_seconds else {}),
        )
        rows_out = []
        with Stack(settings, worker_count=1, api_port=0) as stack:
            for model in args.models.split(","):
                rows, quick_rows, batch, fixed_chunk, make = CASES[model]
                chunk = {"fixed": fixed_chunk, "default": None}.get(args.chunk_size, fixed_chunk)
                chunk = int(args.chunk_size) if args.chunk_size.isdigit() else chunk
                n = int((quick_rows if args.quick else rows) * args.rows_scale)
                inputs = make(rng, n)
                data = home / f"{model}.npy"
                np.save(data, inputs)
                _register(stack, model, models[model], args.profile_mode)
                job_batch = batch if args.batch == "fixed" else None
                system_run(stack, model, data, home / f"warm-{model}", job_batch, chunk)  # session, page cache
                bare_batch = batch
                if args.batch == "best":  # once, before the pairs: a best-of-six per pair would favour the bare side
                    bare_batch = best_bare_loop(models[model], inputs[: SWEEP_ROWS[model]], args.threads)[1]
                bares, systems, chunks = [], [], []
                for repeat in range(args.repeats):  # alternate the two, so drift in machine speed hits both
                    bares.append(bare_loop(models[model], inputs, bare_batch, args.threads))
                    job = system_run(stack, model, data, home / f"out-{model}-{repeat}", job_batch, chunk)
                    systems.append(job["rows_total"] / (job["finished_at"] - job["started_at"]))
                    chunks.append((job["batch_size"], job["chunk_size"], job["chunks_total"]))
                rows_out.append((model, n, bare_batch, *chunks[-1], float(np.median(bares)),
                                 float(np.median(systems))))
    worker = (f"1 stream, {args.threads} ORT threads" if args.resources == "one-stream"
              else "the default streams and threads, fitted to its cores")
    print(f"\nOffline job through SITS (1 CPU worker, {worker}) vs bare ONNX Runtime,"
          f" median of {args.repeats} alternating runs\n")
    print(f"chunk size: {args.chunk_size}, jobs.chunk_seconds {settings.jobs.chunk_seconds:g}; "
          f"models registered with profile_mode={args.profile_mode}\n")
    print("| model | rows | bare batch | job batch | chunk | chunks | bare ORT rows/s | SITS job rows/s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, n, bare_batch, job_batch, chunk, chunks_total, bare, system in rows_out:
        print(f"| {model} | {n:,} | {bare_batch} | {job_batch} | {chunk:,} | {chunks_total} | {bare:,.0f} "
              f"| {system:,.0f} | {system / bare:.2f} |")


def _register(stack: Stack, name: str, path: Path, profile_mode: str) -> None:
    """Register a model and wait until a worker has profiled it (profile_mode=full)."""
    client = stack.client()
    record = client.post("/v1/models", {"name": name, "path": str(path), "profile_mode": profile_mode})
    while record["profile_status"] == "pending":
        time.sleep(0.25)
        record = client.get(f"/v1/models/{record['ref']}")
    if record["profile_status"] == "failed":
        raise SystemExit(f"profiling {name} failed: {record.get('profile_error')}")


if __name__ == "__main__":
    main()
