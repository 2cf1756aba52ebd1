"""Degrading under memory jitter: the top class's latency while a worker sheds its lower classes.

One stack per mode: 1 CPU worker with 1 stream slot (1 ONNX Runtime thread), the zoo transformer
(128 tokens, about 0.4 ms a row). Load, all on that one model:
  P2   a job of short chunks (`--chunk` rows, mini-batches of `--mini-batch`) at priority 2, enough
       rows to outlast the run
  P1   one closed-loop client of one-row requests at priority 9
  P0   one closed-loop client of one-row requests at priority 13
The worker's memory readings jitter by 4 GiB (25 % of its 16 GiB) from `--calm` seconds after its
first reading, for `--jitter` seconds (`faults.memory_jitter`); the degrade steps are shortened
(window 2 s, a step down every 1 s, one back after 3 s of calm). Each request's end-to-end time is
put in the phase the worker was in when it was answered: calm (step 0 before the jitter), degraded
(step 2), restored (step 0 after it), by the times the worker logged its steps. `off` is the same stack
and jitter with `degrade.enabled: false`.
After the run the P2 job must have every row exactly once: rows done against its rows, and a sample
of its output rows against a direct ONNX Runtime run.

    python benchmarks/degrade.py --quick   # about 3 minutes
    python benchmarks/degrade.py           # about 6 minutes
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from broker.online.requests import encode_array  # noqa: E402
from sits_api.cli.client import ApiClient  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.device.runtime import session_options  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

TOKENS = 128
DEGRADE = {"window": "2s", "sample_interval": "0.1s", "step_interval": "1s", "calm_for": "3s"}
PHASES = ("calm", "degraded", "restored")


def closed_loop(client: ApiClient, priority: int, stop: threading.Event, answered: list[tuple[float, float]]) -> None:
    """One client: a one-row request at `priority`, its answer awaited, again until `stop`;
    (answered at, end-to-end seconds) each."""
    ids = np.random.default_rng(priority).integers(1, 1000, size=(1, TOKENS)).astype(np.int64)
    body = {"model": "transformer", "inputs": {"input_ids": {"b64": encode_array(ids)}}, "priority": priority}
    while not stop.is_set():
        started = time.time()
        answer = client.post("/v1/requests?wait=true", body)
        while answer["status"] == "queued":  # (not done within online.max_wait: it waits on)
            time.sleep(0.05)
            answer = client.get(f"/v1/requests/{answer['id']}")
        answered.append((time.time(), time.time() - started))
        time.sleep(0.02)


def watch_job(client: ApiClient, job_id: str, stop: threading.Event, progress: list[tuple[float, int]]) -> None:
    """The P2 job's rows done every 0.1 s: (at, rows done) each."""
    while not stop.is_set():
        progress.append((time.time(), int(client.get(f"/v1/jobs/{job_id}")["rows_done"])))
        time.sleep(0.1)


def phase_at(steps: list[tuple[float, int]], at: float, jitter_from: float, jitter_to: float) -> str | None:
    """The phase at time `at`, by the worker's step changes `steps` ((at, step) each, as it logged them):
    calm before the jitter, degraded while the step is 2 (for `off`, which takes no steps: within the
    jitter), restored once back at 0 after it; None in between."""
    step = next((step for when, step in reversed(steps) if when <= at), 0)
    if at < jitter_from:
        return "calm" if step == 0 else None
    if step == 2 or (at < jitter_to and not steps):
        return "degraded"
    return "restored" if at > jitter_to and step == 0 else None


def p2_rates(progress: list[tuple[float, int]], steps: list[tuple[float, int]], jitter_from: float,
             jitter_to: float) -> dict[str, float]:
    """The P2 job's rows a second in each phase (from the samples within it)."""
    rates = {}
    for phase in PHASES:
        inside = [(at, rows) for at, rows in progress if phase_at(steps, at, jitter_from, jitter_to) == phase]
        if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
            rates[phase] = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
    return rates


def rows_for(seconds: float, mini_batch: int) -> int:
    """Rows the transformer runs in `seconds` on one ONNX Runtime thread here, in mini-batches of
    `mini_batch` (timed on 512 rows), with a margin: a job that ends before the phases do would measure
    nothing."""
    with tempfile.TemporaryDirectory(prefix="sits-degrade-") as tmp:
        session = ort.InferenceSession(str(build_zoo(Path(tmp))["transformer"]), session_options(1),
                                       providers=["CPUExecutionProvider"])
        ids = np.random.default_rng(1).integers(1, 1000, size=(mini_batch, TOKENS)).astype(np.int64)
        feed = {node.name: ids if node.name == "input_ids" else np.ones_like(ids) for node in session.get_inputs()}
        session.run(None, feed)
        started = time.perf_counter()
        for _ in range(512 // mini_batch):
            session.run(None, feed)
        rate = 512 / (time.perf_counter() - started)
    return int(rate * seconds * 1.2)


def check_job(home: Path, model: Path, job: dict[str, Any], rows: np.ndarray) -> tuple[int, int]:
    """(rows lost, rows duplicated) of the finished P2 job: its counts, and 512 sampled rows of its output
    against a direct ONNX Runtime run."""
    session = ort.InferenceSession(str(model), session_options(1), providers=["CPUExecutionProvider"])
    output = np.load(home / "low" / f"{session.get_outputs()[0].name}.npy", mmap_mode="r")
    sample = np.random.default_rng(2).choice(len(rows), size=min(512, len(rows)), replace=False)
    wrong = 0
    for index in sample:
        feed = {node.name: rows[index:index + 1] if node.name == "input_ids" else np.ones_like(rows[index:index + 1])
                for node in session.get_inputs()}
        wrong += not np.allclose(session.run(None, feed)[0], output[index:index + 1], rtol=1e-4, atol=1e-5)
    lost = max(0, len(rows) - int(job["rows_done"])) + wrong
    return lost, max(0, int(job["rows_done"]) - len(rows)) + max(0, len(output) - len(rows))


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One stack in `mode` (on or off); the latencies by phase and the job's check."""
    with tempfile.TemporaryDirectory(prefix="sits-degrade-") as tmp:
        home = Path(tmp)
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            resources={"max_concurrent_streams": 1, "intra_op_threads": 1}, api={"port": 0},
            degrade=DEGRADE | {"enabled": mode == "on"},
            faults={"enabled": True, "memory_jitter": "4GiB", "memory_jitter_after": f"{args.calm}s",
                    "memory_jitter_for": f"{args.jitter}s"})
        rows = np.random.default_rng(5).integers(1, 1000, size=(args.rows, TOKENS)).astype(np.int64)
        np.save(home / "tokens.npy", rows)
        model = build_zoo(home / "models")["transformer"]
        with Stack(settings, worker_count=1, api_port=0) as stack:
            jitter_from = time.time() + args.calm  # (the worker's first reading is at about its start)
            client = stack.client()
            client.post("/v1/models", {"name": "transformer", "path": str(model)})
            job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(home / "tokens.npy"),
                                           "output_dir": str(home / "low"), "priority": 2,
                                           "chunk_size": args.chunk, "batch_size": args.mini_batch})
            stop = threading.Event()
            answered: dict[int, list[tuple[float, float]]] = {13: [], 9: []}
            progress: list[tuple[float, int]] = []
            threads = [threading.Thread(target=closed_loop, args=(stack.client(), level, stop, answered[level]))
                       for level in answered]
            threads.append(threading.Thread(target=watch_job, args=(stack.client(), job["id"], stop, progress)))
            for thread in threads:
                thread.start()
            time.sleep(args.calm + args.jitter + args.after)
            stop.set()
            for thread in threads:
                thread.join()
            deadline = time.monotonic() + 600
            while (done := client.get(f"/v1/jobs/{job['id']}"))["status"] not in ("succeeded", "failed"):
                assert time.monotonic() < deadline, "the P2 job did not finish"
                time.sleep(0.5)
            [worker] = client.get("/v1/status")["workers"]
        lost, duplicated = check_job(home, model, done, rows)
    changes = (worker.get("degrade") or {}).get("changes") or []
    steps = [(float(change["at"]), int(change["step"])) for change in changes]
    if steps:
        jitter_from = steps[0][0]  # (the first step down comes at the first jittering reading, 0.1 s in)
    jitter_to = jitter_from + args.jitter
    by_phase: dict[str, dict[int, list[float]]] = {phase: {13: [], 9: []} for phase in PHASES}
    for level, entries in answered.items():
        for at, seconds in entries:
            phase = phase_at(steps, at, jitter_from, jitter_to)
            if phase is not None:
                by_phase[phase][level].append(seconds * 1000)
    recovered = steps[-1][0] - jitter_to if len(steps) >= 4 else None
    return {"mode": mode, "by_phase": by_phase, "lost": lost, "duplicated": duplicated, "status": done["status"],
            "recover_s": recovered, "steps": [step for _, step in steps],
            "p2_rates": p2_rates(progress, steps, jitter_from, jitter_to)}


def p99(values: list[float]) -> str:
    return f"{np.percentile(values, 99):.1f} ms ({len(values)})" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter phases")
    parser.add_argument("--rows", type=int, default=0,
                        help="rows of the P2 job (default: enough to outlast the run at this machine's speed)")
    parser.add_argument("--chunk", type=int, default=96)
    parser.add_argument("--mini-batch", type=int, default=4)
    parser.add_argument("--calm", type=float, default=20.0, help="seconds before the jitter starts")
    parser.add_argument("--jitter", type=float, default=30.0, help="seconds it lasts")
    parser.add_argument("--after", type=float, default=20.0, help="seconds measured after it")
    parser.add_argument("--modes", default="on,off", help="which of on and off to run, in order")
    args = parser.parse_args()
    if args.quick:
        args.calm, args.jitter, args.after = 12.0, 15.0, 12.0
    if not args.rows:
        args.rows = rows_for(args.calm + args.jitter + args.after, args.mini_batch)
    results = [run_mode(mode, args) for mode in args.modes.split(",")]
    print("| degrade | phase | P0 P99 (answers) | P1 P99 (answers) | P2 job rows/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in results:
        for phase in PHASES:
            rate = row["p2_rates"].get(phase)
            print(f"| {row['mode']} | {phase} | {p99(row['by_phase'][phase][13])} | {p99(row['by_phase'][phase][9])} | "
                  f"{f'{rate:,.0f}' if rate is not None else '-'} |")
    print()
    print("| degrade | steps | back to step 0 after the jitter | P2 job | rows lost | rows duplicated |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for row in results:
        recover = f"{row['recover_s']:.1f} s" if row["recover_s"] is not None else "-"
        print(f"| {row['mode']} | {' '.join(map(str, row['steps'])) or '-'} | {recover} | {row['status']} | "
              f"{row['lost']} | {row['duplicated']} |")


if __name__ == "__main__":
    main()
