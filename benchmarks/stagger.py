"""Staggering a window measured: five overlapping daily schedules, released as they fall and then as
`schedule plan --apply` staggers them, on one real stack (beat, releaser, workers).

One stack (`--workers` CPU workers at their fitted defaults, the beat and a releaser) runs the zoo's mlp,
registered with a measured profile. A warm-up job measures its rows/s alone, and each schedule's job is
sized to `--job-seconds` of one stream slot's work. Five cron schedules fall in one window: two at its
first minute, two at the next, one at the third, each with a deadline `--deadline` after its slot.

- `as they fall`: every run released at its slot, no slot cap.
- `planned`: the crons moved to a later window, `POST /v1/schedules/plan` (what `sitsctl schedule plan
  --apply` sends) stores a release offset and a slot cap on each, and the beat releases them so.

Each phase samples every `SAMPLE` seconds the chunks in flight (one stream slot each: a worker's drain
leases one chunk at a time) and the rows done of the five jobs. Reported per phase: the peak of slots in
use, the peak rows/s (over 5-second windows), and each run's finish against its deadline. The plan's
own prediction (peak before and after, each run's predicted finish) is printed beside.

    python benchmarks/stagger.py            # about 8 minutes: two phases, each starting at a minute boundary
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

MINUTES = (0, 0, 1, 1, 2)
"""Each schedule's slot, in minutes after the window opens."""
SAMPLE = 0.25
RATE_WINDOW = 5.0
"""Rows/s is taken over windows this long: rows are counted as chunks end (each a fraction of a second of
one slot's work here), so shorter windows measure the acks' bunching more than the load."""
CHUNKS = 24
"""Chunks of each job: enough for a run to spread over every slot when nothing caps it."""


def at_minute(unix: float) -> tuple[int, int]:
    moment = datetime.fromtimestamp(unix, UTC)
    return moment.hour, moment.minute


def next_opening(after: float) -> float:
    """The first minute boundary at least `after`, with the window's minutes within one hour and one day."""
    opening = math.ceil(after / 60) * 60
    while at_minute(opening)[1] > 59 - max(MINUTES) - 1 or at_minute(opening)[0] == 23:
        opening += 60
    return float(opening)


def crons(opening: float) -> list[str]:
    return [f"{at_minute(opening + 60 * minute)[1]} {at_minute(opening)[0]} * * *" for minute in MINUTES]


def measured_rate(client: Any, home: Path, rows: int) -> float:
    job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(home / "warm.npy"), "chunk_size": rows // 8,
                                   "output_dir": str(home / "out" / f"warm-{time.time():.0f}")})
    while (done := client.get(f"/v1/jobs/{job['id']}"))["status"] not in ("succeeded", "failed"):
        time.sleep(0.2)
    assert done["status"] == "succeeded", done
    return float(rows / (done["finished_at"] - done["started_at"]))


def run_phase(stack: Stack, names: list[str], opening: float, deadline_s: float) -> dict[str, Any]:
    """Sample until the five runs of the window released at `opening` end; the peak and each run's end."""
    client, store = stack.client(), stack.store
    jobs: dict[str, str] = {}
    samples: list[tuple[float, int, int]] = []  # (time, slots in use, rows done by the five jobs)
    finished: dict[str, dict[str, Any]] = {}
    ends = opening + max(MINUTES) * 60 + deadline_s + 120
    while len(finished) < len(names) and time.time() < ends:
        for name in names:
            if name not in jobs:
                runs = [run for run in client.get(f"/v1/schedules/{name}")["runs"]
                        if run["job_id"] and datetime.fromisoformat(run["slot"]).timestamp() >= opening]
                if runs:
                    jobs[name] = runs[0]["job_id"]
        rows = 0
        for name, job_id in jobs.items():
            job = finished.get(name) or client.get(f"/v1/jobs/{job_id}")
            rows += int(job["rows_done"])
            if job["status"] in ("succeeded", "failed", "cancelled"):
                finished[name] = job
        refs = store.client.smembers(store.keys.queues)
        in_flight = sum(store.client.zcard(store.keys.inflight(ref)) for ref in refs)
        samples.append((time.time(), in_flight, rows))
        time.sleep(SAMPLE)
    peak_rate = 0.0
    for index, (at, _, rows) in enumerate(samples):
        back = next((j for j in range(index, -1, -1) if at - samples[j][0] >= RATE_WINDOW), None)
        if back is not None:
            peak_rate = max(peak_rate, (rows - samples[back][2]) / (at - samples[back][0]))
    runs = []
    for name in names:
        job = finished.get(name, {})
        runs.append({"schedule": name, "status": job.get("status", "not finished"),
                     "finish": job.get("finished_at"), "deadline": job.get("deadline"),
                     "on_time": bool(job.get("finished_at") and job["finished_at"] <= job["deadline"])})
    return {"peak_slots": max((s[1] for s in samples), default=0), "peak_rows_per_second": round(peak_rate),
            "runs": runs, "all_on_time": all(run["on_time"] for run in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--job-seconds", type=float, default=12.0, help="each run's work on one stream slot")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds after its slot each run must end")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sits-stagger-") as tmp:
        home = Path(tmp)
        zoo = build_zoo(home / "zoo")
        warm_rows = 400_000
        data = np.random.default_rng(0).standard_normal((warm_rows, 64)).astype(np.float32)
        np.save(home / "warm.npy", data)
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)})
        with Stack(settings, worker_count=args.workers, api_port=0, beat=True) as stack:
            client = stack.client()
            client.post("/v1/models", {"name": "mlp", "path": str(zoo["mlp"]), "profile_mode": "full"})
            while client.get("/v1/models/mlp").get("profile_status") != "ready":
                time.sleep(0.2)
            rate = max(measured_rate(client, home, warm_rows) for _ in range(2))
            rows = int(rate * args.job_seconds) // CHUNKS * CHUNKS
            np.save(home / "nightly.npy", np.resize(data, (rows, 64)))
            print(f"mlp alone: {rate:,.0f} rows/s on one slot; each run {rows:,} rows in {CHUNKS} chunks")
            opening = next_opening(time.time() + 20)
            names = [f"eod{index}" for index in range(len(MINUTES))]
            for name, cron in zip(names, crons(opening), strict=True):
                client.post("/v1/schedules", {"name": name, "cron": cron, "deadline": args.deadline, "job": {
                    "model": "mlp", "input_batch": str(home / "nightly.npy"), "chunk_size": rows // CHUNKS,
                    "output_dir": str(home / "out" / name / "{slot}")}})
            print(f"as they fall: window opens {datetime.fromtimestamp(opening, UTC):%H:%M} UTC")
            before = run_phase(stack, names, opening, args.deadline)
            print(json.dumps(before))

            opening = next_opening(time.time() + 30)
            for name, cron in zip(names, crons(opening), strict=True):
                client.request("PATCH", f"/v1/schedules/{name}", {"cron": cron})
            first, last = opening, opening + 60 * (max(MINUTES) + 1)
            window = "-".join(f"{hour:02d}:{minute:02d}" for hour, minute in (at_minute(first), at_minute(last)))
            plan = client.post("/v1/schedules/plan", {"window": window,
                                                      "day": datetime.fromtimestamp(first, UTC).strftime("%Y-%m-%d")})
            print(f"plan of {window} UTC on {plan['slots']} slots: peak {plan['before']['peak_slots']} -> "
                  f"{plan['after']['peak_slots']} slots, {plan['before']['peak_rows_per_second']:,.0f} -> "
                  f"{plan['after']['peak_rows_per_second']:,.0f} rows/s; analysis: "
                  f"{plan['response_time_analysis']['verdict']}")
            for run in plan["runs"]:
                print(f"  {run['schedule']}: offset {run['offset_s']:g} s, max_slots {run['max_slots']}, "
                      f"predicted finish {run['predicted_finish']}, deadline {run['deadline']}")
            after = run_phase(stack, names, opening, args.deadline)
            print(json.dumps(after))
    print()
    print("| phase | peak slots in use | peak rows/s | runs on time |")
    print("| --- | ---: | ---: | ---: |")
    for label, phase in (("as they fall", before), ("planned (`schedule plan --apply`)", after)):
        on_time = sum(run["on_time"] for run in phase["runs"])
        print(f"| {label} | {phase['peak_slots']} | {phase['peak_rows_per_second']:,} | "
              f"{on_time} of {len(phase['runs'])} |")
    if after["peak_slots"]:
        print(f"peak slots {before['peak_slots'] / after['peak_slots']:.1f}x lower, peak rows/s "
              f"{before['peak_rows_per_second'] / max(1, after['peak_rows_per_second']):.1f}x lower")


if __name__ == "__main__":
    main()
