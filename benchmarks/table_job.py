"""A Parquet job against the same rows as .npy and a bare ONNX Runtime loop: rows/s and the worker's memory.

1,000,000 rows of 64 float32 features and an int64 id column, on the zoo's MLP. The Parquet job reads
the features from a Parquet file (row groups of 65,536 rows) and writes `outputs.parquet` (the id column
and the logits as fixed-size lists); the .npy job reads the same features from a memory-mapped .npy and
writes `logits.npy`. Each side runs on a stack of its own (a fresh worker), after a warm-up job of 50,000
rows of its format, so that the worker's high-water mark (`VmHWM`) is that of the measured job. While the
job runs, the worker's resident memory is sampled every 50 ms: `VmRSS` counts the pages of a mapped input
file it touched, `RssAnon` only the memory it allocated. The job's rate counts from its first lease to its
finalized manifest; the bare loop runs `session.run` over the .npy's rows at the job's batch size, with the
worker's session options. The outputs are checked against the bare loop's.

    python benchmarks/table_job.py                  # 1,000,000 rows
    python benchmarks/table_job.py --rows 200000    # quicker
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.device.runtime import session_options  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

FEATURES = 64
GROUP_ROWS = 65_536


def write_inputs(home: Path, features: np.ndarray, stem: str) -> dict[str, Path]:
    """The features as .npy and as Parquet (an int64 id column, then f00..f63; no dictionary encoding,
    as float features are usually written)."""
    np.save(home / f"{stem}.npy", features)
    ids = np.arange(10_000_000, 10_000_000 + len(features), dtype=np.int64)
    table = pa.table({"id": ids, **{f"f{col:02d}": features[:, col] for col in range(FEATURES)}})
    pq.write_table(table, home / f"{stem}.parquet", row_group_size=GROUP_ROWS, use_dictionary=False)
    return {"npy": home / f"{stem}.npy", "parquet": home / f"{stem}.parquet"}


def bare_loop(model: Path, features: np.ndarray, batch: int, threads: int) -> tuple[float, np.ndarray]:
    """Rows/s of a plain session.run loop, and its outputs."""
    session = ort.InferenceSession(str(model), session_options(threads), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    session.run(None, {name: features[:batch]})
    outputs = []
    started = time.perf_counter()
    for start in range(0, len(features), batch):
        outputs.append(session.run(None, {name: features[start : start + batch]})[0])
    return len(features) / (time.perf_counter() - started), np.concatenate(outputs)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            todo += [int(child) for child in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            pass
    return found


def _status(pid: int) -> dict[str, int]:
    """kB figures of /proc/<pid>/status."""
    figures = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                figures[key] = int(value.split()[0])
    except OSError:
        pass
    return figures


class MemorySampler(threading.Thread):
    """The largest VmRSS and RssAnon of the worker's processes, sampled every 50 ms."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.peak_rss, self.peak_anon, self.done = pids, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            for pid in self.pids:
                status = _status(pid)
                self.peak_rss = max(self.peak_rss, status.get("VmRSS", 0))
                self.peak_anon = max(self.peak_anon, status.get("RssAnon", 0))


def run_job(stack: Stack, body: dict) -> dict:
    client = stack.client()
    job = client.post("/v1/jobs", body)
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.25)
        job = client.get(f"/v1/jobs/{job['id']}")
    if job["status"] != "succeeded":
        raise SystemExit(f"job failed: {job['error']}")
    return job


def measure(settings: Settings, model: Path, data: Path, warm: Path, fmt: str, batch: int, chunk: int) -> dict:
    """One job of `fmt` on a fresh stack, after a warm-up job: its rows/s and the worker's memory (MiB)."""
    home = settings.paths.home
    with Stack(settings, worker_count=1, api_port=0) as stack:
        stack.client().post("/v1/models", {"name": "mlp", "path": str(model)})
        extra = {"id_column": "id", "output_format": "parquet"} if fmt == "parquet" else {}
        base = {"model": "mlp", "batch_size": batch, "chunk_size": chunk, **extra}
        run_job(stack, base | {"input_batch": str(warm), "output_dir": str(home / f"warm-{fmt}")})
        worker = next(child for child in stack.children if child.name.startswith("worker"))
        pids = _descendants(worker.process.pid)
        sampler = MemorySampler(pids)
        sampler.start()
        job = run_job(stack, base | {"input_batch": str(data), "output_dir": str(home / f"out-{fmt}")})
        sampler.done.set()
        sampler.join()
        hwm = max(_status(pid).get("VmHWM", 0) for pid in pids)
    return {"rows_per_second": job["rows_total"] / (job["finished_at"] - job["started_at"]),
            "chunks": job["chunks_total"], "hwm": hwm / 1024, "peak_rss": sampler.peak_rss / 1024,
            "peak_anon": sampler.peak_anon / 1024, "out": home / f"out-{fmt}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=131_072, help="rows per chunk (8 chunks of a million rows)")
    parser.add_argument("--streams", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="sits-bench-") as tmp:
        home = Path(tmp)
        model = build_zoo(home / "models")["mlp"]
        features = rng.standard_normal((args.rows, FEATURES), dtype=np.float32)
        data = write_inputs(home, features, "features")
        warm = write_inputs(home, features[:50_000], "warm")
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            resources={"max_concurrent_streams": args.streams, "intra_op_threads": 1},
            redis={"appendonly": True},
        )
        bare, expected = bare_loop(model, features, args.batch, args.streams)
        results = {fmt: measure(settings, model, data[fmt], warm[fmt], fmt, args.batch, args.chunk)
                   for fmt in ("npy", "parquet")}
        written = pq.read_table(results["parquet"]["out"] / "outputs.parquet")
        ids_in_order = written["id"].to_numpy().tolist() == list(range(10_000_000, 10_000_000 + args.rows))
        logits = np.asarray(written["logits"].combine_chunks().flatten()).reshape(args.rows, -1)
        same = bool(np.allclose(logits, expected, rtol=1e-4, atol=1e-5))
        same_npy = bool(np.allclose(np.load(results["npy"]["out"] / "logits.npy"), expected, rtol=1e-4, atol=1e-5))
    print(f"\n{args.rows:,} rows x {FEATURES} float32 + id, MLP, batch {args.batch}, chunks of {args.chunk:,} rows, "
          f"1 worker of {args.streams} streams x 1 ORT thread; bare loop {args.streams} ORT threads\n")
    print("| run | rows/s | vs bare | worker VmHWM MiB | peak VmRSS MiB | peak RssAnon MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| bare ORT loop (.npy in memory) | {bare:,.0f} | 1.00 | | | |")
    for fmt, result in results.items():
        print(f"| {fmt} job | {result['rows_per_second']:,.0f} | {result['rows_per_second'] / bare:.2f} "
              f"| {result['hwm']:,.0f} | {result['peak_rss']:,.0f} | {result['peak_anon']:,.0f} |")
    print(f"\nparquet ids in order: {ids_in_order}; parquet logits == bare loop: {same}; npy logits == bare loop: "
          f"{same_npy}; input sizes: see above")


if __name__ == "__main__":
    main()
