"""Deadline admission measured: how close predicted finishes come to real ones, how many accepted jobs meet
their deadline, and whether admission refuses jobs that would have made it.

One stack (one CPU worker at its fitted defaults, the zoo's mlp and convnet registered with a measured
profile) receives the same stream of jobs twice, alternating the phase:

- `reject` (the default `sla.admission`): a job predicted to miss its deadline is refused;
- `flag`: every job is accepted, the ones admission would refuse marked `at_risk`, so that what they
  would have done is seen.

The stream: `--jobs` jobs, arriving `--gap` seconds apart on average (exponential gaps, seeded), each
of a random model and size (mlp 400,000 to 1,600,000 rows, convnet 2,048 to 8,192 images) with a deadline
of a random multiple (0.5x to 6x) of its own run time alone, as measured in warm-up jobs of each model:
whether it can be met depends on what is queued when it arrives. Reported per phase: jobs accepted,
the share of accepted jobs that met their deadline, the prediction error of accepted jobs (real − predicted finish, as a
share of the real time from submit to finish: median, P90 of its absolute value), and for `flag` how
many of the at-risk jobs met their deadline with 20 % of their time to spare (jobs refused that
should not have been).

`--part predictor` rates the violation predictor instead. Two CPU workers of one stream each (a core
each) run 12 convnet jobs with deadlines (all accepted, `admission: flag`), sized in seconds of the
fleet's measured speed, so a round lasts about a minute on a slow machine or a fast one. Two seconds
in, one worker is frozen for 20 s (SIGSTOP: its leases expire and its chunks go to the other) and a
flood of express jobs (level 12) without deadlines arrives. Every half second each active deadline
job's `sla_risk` is read, and beside it the plain rule (alert when the predicted finish is past the
deadline). Each job is then labelled by whether it met its deadline. Reported per round, for the
predictor and the rule: AUC over the samples, precision and recall over the jobs alerted at the alert
rule's threshold (0.5) and at 0.8, and the median lead time from a missed job's first alert to its
deadline. The predictor learns from every job that ends, so later rounds use what earlier ones taught.
`--record FILE` keeps every sample and job record; `--replay FILE` prints the table of a recording.

    python benchmarks/sla.py --quick     # 12 jobs a phase, one round: about 4 minutes
    python benchmarks/sla.py             # 30 jobs a phase, 2 rounds: about 15 minutes
    python benchmarks/sla.py --part predictor --rounds 4 --record run.json   # about 5 minutes
    python benchmarks/sla.py --replay run.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

SIZES = {"mlp": (400_000, 1_600_000), "convnet": (2_048, 8_192)}
SHAPES = {"mlp": (64,), "convnet": (3, 32, 32)}
STEPS = {"mlp": 200_000, "convnet": 1_024}
"""Job sizes are multiples of these, so a round needs a few input files, not one a job."""


def input_file(home: Path, model: str, rows: int) -> Path:
    """An input of exactly `rows` rows of `model`, the first rows of its largest input (written once)."""
    path = home / f"{model}-{rows}.npy"
    if not path.exists():
        np.save(path, np.load(home / f"{model}.npy", mmap_mode="r")[:rows])
    return path


@dataclass
class Planned:
    """One job of the stream: when it comes, what it is, how tight its deadline is."""

    at: float
    model: str
    rows: int
    tightness: float


def plan(count: int, gap: float, seed: int) -> list[Planned]:
    """The same stream for every phase of one round."""
    rng = np.random.default_rng(seed)
    at, out = 0.0, []
    for _ in range(count):
        at += float(rng.exponential(gap))
        model = str(rng.choice(list(SIZES)))
        low, high = SIZES[model]
        rows = int(rng.integers(low, high + 1)) // STEPS[model] * STEPS[model]
        out.append(Planned(at, model, rows, float(rng.uniform(0.5, 6.0))))
    return out


def post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{stack.api_url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {stack.api_key}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_all(stack: Stack, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    client, done, ends = stack.client(), {}, time.monotonic() + timeout
    while len(done) < len(ids) and time.monotonic() < ends:
        for job_id in ids:
            if job_id not in done:
                job = client.get(f"/v1/jobs/{job_id}")
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    done[job_id] = job
        time.sleep(0.2)
    return done


def measured_rate(stack: Stack, home: Path, model: str, number: int) -> float:
    """Rows/s of one job of the model alone (the warm-up: one of the middle size, from its first lease to
    its finish), to size the stream's deadlines."""
    low, high = SIZES[model]
    rows = (low + high) // 2 // STEPS[model] * STEPS[model]  # a job of the middle size, chunked as the stream's
    status, job = post(stack, "/v1/jobs", {"model": model, "input_batch": str(input_file(home, model, rows)),
                                           "output_dir": str(home / "out" / f"warm-{model}-{number}")})
    assert status in (200, 201), job
    done = wait_all(stack, [job["id"]], 300)[job["id"]]
    return rows / (done["finished_at"] - done["started_at"])


def run_phase(stack: Stack, home: Path, mode: str, jobs: list[Planned], rates: dict[str, float],
              tag: str, verbose: bool = False) -> list[dict[str, Any]]:
    """Submit the stream under `mode` ('reject' or 'flag': the model names registered for each)."""
    paths = [input_file(home, planned.model, planned.rows) for planned in jobs]  # written before the phase
    os.sync()  # (their write-back would slow the phase's first jobs)
    started, outcomes = time.time(), []
    for number, (planned, path) in enumerate(zip(jobs, paths, strict=True)):
        time.sleep(max(0.0, started + planned.at - time.time()))
        now = time.time()
        alone = planned.rows / rates[planned.model]
        deadline_s = planned.tightness * alone
        status, body = post(stack, "/v1/jobs", {
            "model": f"{planned.model}_{mode}", "input_batch": str(path),
            "output_dir": str(home / "out" / f"{tag}-{mode}-{number}"), "deadline_s": round(deadline_s, 3)})
        # an accepted job is judged by the deadline it was given: deadline_s from the API's receipt
        outcomes.append({"planned": planned, "submitted_at": body.get("created_at") or now,
                         "deadline": body.get("deadline") or now + deadline_s, "status": status, "body": body})
    accepted = [o["body"]["id"] for o in outcomes if o["status"] in (200, 201)]
    finished = wait_all(stack, accepted, 600)
    for outcome in outcomes:
        if outcome["status"] in (200, 201):
            outcome["final"] = finished.get(outcome["body"]["id"])
        if verbose:
            print(describe(outcome))
    return outcomes


def describe(outcome: dict[str, Any]) -> str:
    """One job of a phase, times from its submit: deadline, prediction, real finish (or the refusal)."""
    planned, at = outcome["planned"], outcome["submitted_at"]
    head = f"  {planned.model:8s} {planned.rows:7,d} rows, deadline +{outcome['deadline'] - at:6.1f} s"
    if outcome["status"] not in (200, 201):
        body = outcome["body"]
        predicted = body.get("predicted_finish")
        return f"{head}: {outcome['status']}, predicted +{predicted - at:.1f} s" if predicted else f"{head}: {body}"
    final, body = outcome.get("final") or {}, outcome["body"]
    predicted = body.get("predicted_finish")
    real = final.get("finished_at")
    started, busy, last_ack = final.get("started_at"), final.get("busy_seconds"), final.get("checkpoint_ts")
    merge = f", merged {real - last_ack:4.2f} s after the last ack" if real and last_ack else ""
    return (f"{head}: predicted +{(predicted or at) - at:6.1f} s, real +{(real or at) - at:6.1f} s"
            f" (started +{(started or at) - at:5.1f} s, {busy or 0:5.2f} slot s{merge})"
            f"{' (at risk)' if body.get('at_risk') else ''}")


def summarize(mode: str, outcomes: list[dict[str, Any]], sla: Any) -> dict[str, Any]:
    """A phase's figures; `sla` (the stack's `sla` settings) tells an at-risk job refused for its own finish
    from one refused for another job's deadline (its own finish with the margin fits its deadline)."""
    accepted = [o for o in outcomes if o["status"] in (200, 201) and o.get("final")]
    refused = [o for o in outcomes if o["status"] == 422]
    errors, met, risky, risky_met_with_room, for_another = [], 0, 0, 0, 0
    for outcome in accepted:
        final, body = outcome["final"], outcome["body"]
        real = final["finished_at"] - outcome["submitted_at"]
        if body.get("predicted_finish") and real > 0:
            errors.append((final["finished_at"] - body["predicted_finish"]) / real)
        on_time = final["status"] == "succeeded" and final["finished_at"] <= outcome["deadline"]
        if body.get("at_risk"):
            risky += 1
            room = outcome["deadline"] - 0.2 * (outcome["deadline"] - outcome["submitted_at"])
            met_with_room = final["finished_at"] <= room
            risky_met_with_room += met_with_room
            predicted = body.get("predicted_finish") or math.inf
            kept = max((predicted - outcome["submitted_at"]) * sla.admission_margin, sla.admission_margin_floor)
            for_another += met_with_room and predicted + kept <= outcome["deadline"]
        else:
            met += on_time
    trusted = len(accepted) - risky
    absolute = np.abs(errors) if errors else np.array([np.nan])
    return {"mode": mode, "jobs": len(outcomes), "accepted": trusted, "refused": len(refused), "at_risk": risky,
            "met_share": met / trusted if trusted else float("nan"),
            "error_median": float(np.median(errors)) if errors else float("nan"),
            "abs_error_p90": float(np.percentile(absolute, 90)),
            "at_risk_met_with_20pct": risky_met_with_room, "of_them_for_another_job": for_another}


FREEZE_AT, FREEZE_SECONDS = 2.0, 20.0
"""When (seconds after the round's jobs are in) and for how long the predictor scenario freezes one of its
two workers."""
JOB_SECONDS = (2.0, 5.0)
"""A deadline job's size in the predictor scenario, in seconds of the two workers' measured speed."""
FLOOD_JOBS, FLOOD_SECONDS, FLOOD_AT, FLOOD_PRIORITY = 6, 2.0, 2.5, 12
"""The flood of express jobs without deadlines (level 12: they go before deadline work): how many, each how
long, when (as `FREEZE_AT`)."""
PREDICTOR_STEP = 128
"""The predictor scenario's job sizes are multiples of this many images."""


def predictor_round(stack: Stack, home: Path, rate: float, *, jobs: int, seed: int,
                    tag: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """One scenario: deadline jobs, a frozen worker, a flood; the risk samples of every deadline job, and
    every job's final record (the flood's too).

    Sizes are in seconds of the fleet's measured `rate` (convnet images a second on both workers), so the
    scenario lasts about as long on a slow machine as on a fast one: each job 2-5 s of work, its deadline
    its own time times its place in the stream times 1.0-2.0, plus up to 3 s. The freeze takes about
    10 s of the fleet's time and the flood 12 s, so the later jobs miss unless their deadline has room."""
    rng = np.random.default_rng(seed)
    step = PREDICTOR_STEP
    ids, deadlines = [], {}
    for number in range(jobs):
        rows = max(step, int(rate * rng.uniform(*JOB_SECONDS)) // step * step)
        status, job = post(stack, "/v1/jobs", {
            "model": "convnet_flag", "input_batch": str(input_file(home, "convnet", rows)),
            "output_dir": str(home / "out" / f"{tag}-p{number}"),
            "deadline_s": round(rows / rate * (number + 1) * float(rng.uniform(1.5, 3.0))
                                + float(rng.uniform(0.0, 6.0)), 3)})
        assert status in (200, 201), job
        ids.append(job["id"])
        deadlines[job["id"]] = job["deadline"]
    flood_rows = max(step, int(rate * FLOOD_SECONDS) // step * step)
    worker = next(child.process.pid for child in stack.children if child.name.startswith("worker"))
    client, samples, floods, started = stack.client(), [], [], time.monotonic()
    frozen = flooded = False
    try:
        while time.monotonic() - started < 300:
            elapsed = time.monotonic() - started
            if not frozen and elapsed > FREEZE_AT:
                os.kill(worker, signal.SIGSTOP)
                frozen = True
            if frozen and elapsed > FREEZE_AT + FREEZE_SECONDS and worker:
                os.kill(worker, signal.SIGCONT)
                worker = 0
            if not flooded and elapsed > FLOOD_AT:
                for number in range(FLOOD_JOBS):
                    _, flood = post(stack, "/v1/jobs", {"model": "convnet_flag", "priority": FLOOD_PRIORITY,
                                             "input_batch": str(input_file(home, "convnet", flood_rows)),
                                             "output_dir": str(home / "out" / f"{tag}-f{number}")})
                    floods.append(flood["id"])
                flooded = True
            active = 0
            for job_id in ids:
                job = client.get(f"/v1/jobs/{job_id}")
                if job["status"] in ("queued", "running"):
                    active += 1
                    rule = job["predicted_finish"] is not None and job["predicted_finish"] > job["deadline"]
                    samples.append({"job": job_id, "t": time.time(), "risk": job["sla_risk"] or 0.0,
                                    "rule": 1.0 if rule else 0.0})
            if not active and elapsed > FREEZE_AT + FREEZE_SECONDS:
                break
            time.sleep(0.5)
    finally:
        if worker:
            os.kill(worker, signal.SIGCONT)
    finals = wait_all(stack, ids + floods, 300)
    for sample in samples:
        final = finals.get(sample["job"], {})
        sample["missed"] = not (final.get("status") == "succeeded" and final["finished_at"] <= deadlines[sample["job"]])
        sample["deadline"] = deadlines[sample["job"]]
    return samples, finals


def rate_alerts(samples: list[dict[str, Any]], score: str, threshold: float = 0.5) -> dict[str, float]:
    """AUC over samples, precision over jobs alerted at `threshold`, median lead of the first alert of a
    missed job before its deadline."""
    from broker.sla.predictor import auc

    by_job: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        by_job.setdefault(sample["job"], []).append(sample)
    alerted = {job: next((s["t"] for s in rows if s[score] >= threshold), None) for job, rows in by_job.items()}
    missed = {job: rows[0]["missed"] for job, rows in by_job.items()}
    hits = [job for job, at in alerted.items() if at is not None]
    leads = [by_job[job][0]["deadline"] - at for job, at in alerted.items() if at is not None and missed[job]]
    return {"auc": auc([s[score] for s in samples], [s["missed"] for s in samples]),
            "precision": sum(missed[job] for job in hits) / len(hits) if hits else float("nan"),
            "recall": (sum(1 for job in hits if missed[job]) / sum(missed.values())) if any(missed.values())
            else float("nan"),
            "lead_s": float(np.median(leads)) if leads else float("nan"),
            "jobs": len(by_job), "missed": sum(missed.values())}


def predictor_main(args: argparse.Namespace) -> None:
    rounds = args.rounds or 2
    with tempfile.TemporaryDirectory(prefix="sits-sla-") as tmp:
        home = Path(tmp)
        zoo = build_zoo(home / "zoo")
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            scheduler={"lease_timeout": "3s", "reap_interval": "0.5s", "ticket_timeout": "6s",
                       "worker_heartbeat_timeout": "5s"},
            resources={"max_concurrent_streams": 1, "intra_op_threads": 1},  # a worker a core: one frozen is half
            sla={"models": {"convnet_flag": {"admission": "flag"}}})
        with Stack(settings, worker_count=2, api_port=0) as stack:
            client = stack.client()
            client.post("/v1/models", {"name": "convnet_flag", "path": str(zoo["convnet"]), "profile_mode": "full"})
            while client.get("/v1/models/convnet_flag").get("profile_status") != "ready":
                time.sleep(0.2)
            rate, step = 0.0, PREDICTOR_STEP
            for number, seconds in enumerate((0.0, 4.0)):  # the first builds the sessions; the second is the speed
                warm_rows = max(4_096, int(rate * seconds) // step * step)
                np.save(home / "convnet.npy", np.random.default_rng(0).standard_normal(
                    (warm_rows, *SHAPES["convnet"])).astype(np.float32))
                status, warm = post(stack, "/v1/jobs", {"model": "convnet_flag",
                                                        "input_batch": str(home / "convnet.npy"),
                                                        "output_dir": str(home / "out" / f"warm{number}")})
                done = wait_all(stack, [warm["id"]], 300)[warm["id"]]
                rate = done["rows_total"] / (done["finished_at"] - done["started_at"])
            largest = int(rate * JOB_SECONDS[1]) // step * step + step
            np.save(home / "convnet.npy", np.random.default_rng(0).standard_normal(
                (largest, *SHAPES["convnet"])).astype(np.float32))
            print(f"alone: {rate:,.0f} images/s on 2 workers")
            recorded = []
            for number in range(rounds):
                samples, finals = predictor_round(stack, home, rate, jobs=args.jobs or 12,
                                                  seed=args.seed + number, tag=f"r{number}")
                recorded.append({"samples": samples, "jobs": finals})
                print(json.dumps({"round": number + 1, **rate_alerts(samples, "risk")}))
    if args.record:
        Path(args.record).write_text(json.dumps({"rate": rate, "rounds": recorded}))
    print_predictor_table(recorded)


def print_predictor_table(recorded: list[dict[str, Any]]) -> None:
    """The predictor's and the plain rule's figures per round of a recording, at the alert rule's
    threshold (0.5) and at a stricter one (0.8)."""
    print()
    print("| round | score | jobs | missed | AUC | precision at 0.5 | recall | median lead | "
          "precision at 0.8 | recall | median lead |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for number, recording in enumerate(recorded, start=1):
        for score, name in (("risk", "predictor"), ("rule", "plain rule")):
            at, strict = rate_alerts(recording["samples"], score), rate_alerts(recording["samples"], score, 0.8)
            print(f"| {number} | {name} | {at['jobs']} | {at['missed']} | {at['auc']:.2f} | {at['precision']:.2f} | "
                  f"{at['recall']:.2f} | {at['lead_s']:.1f} s | {strict['precision']:.2f} | {strict['recall']:.2f} | "
                  f"{strict['lead_s']:.1f} s |")


def calibration_line(stack: Stack) -> str:
    """What the stack's jobs taught admission: each model's factor, and each pair's relative to it (how much
    slower than on average a model's chunks ran beside another model, or alone)."""
    from broker.sla.figures import calibrations, contention

    client = stack.client()
    names = {client.get(f"/v1/models/{model}")["version"]: model for model in SIZES}
    names["alone"] = "nothing"
    factors = calibrations(stack.store)
    own = [f"{names[version]} {factor:.2f}" for version, factor in factors.items() if version in names]
    pairs = [f"{names.get(version, version)} beside {names.get(other, other)} {factor:.2f}"
             for (version, other), factor in sorted(contention(factors).items())]
    return "calibration: " + ", ".join(own) + "; relative, by pair: " + ", ".join(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--gap", type=float, default=4.0, help="mean seconds between arrivals")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--verbose", action="store_true", help="print every job")
    parser.add_argument("--margin", type=float, default=None, help="sla.admission_margin (default: the setting's)")
    parser.add_argument("--part", choices=("admission", "predictor"), default="admission")
    parser.add_argument("--record", metavar="FILE",
                        help="predictor: write every round's risk samples and job records to FILE (JSON)")
    parser.add_argument("--replay", metavar="FILE", help="predictor: print the table of a recording; run nothing")
    args = parser.parse_args()
    if args.replay:
        print_predictor_table(json.loads(Path(args.replay).read_text())["rounds"])
        return
    if args.part == "predictor":
        predictor_main(args)
        return
    count = args.jobs or (12 if args.quick else 30)
    rounds = args.rounds or (1 if args.quick else 2)

    with tempfile.TemporaryDirectory(prefix="sits-sla-") as tmp:
        home = Path(tmp)
        zoo = build_zoo(home / "zoo")
        rng = np.random.default_rng(0)
        for model, (_, high) in SIZES.items():
            np.save(home / f"{model}.npy", rng.standard_normal((high, *SHAPES[model])).astype(np.float32))
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            sla={"models": {f"{model}_flag": {"admission": "flag"} for model in SIZES},
                 **({} if args.margin is None else {"admission_margin": args.margin})})
        print(f"sla.admission_margin {settings.sla.admission_margin:g}")
        with Stack(settings, worker_count=1, api_port=0) as stack:
            client = stack.client()
            for model in SIZES:
                for name in (model, f"{model}_reject", f"{model}_flag"):
                    client.post("/v1/models", {"name": name, "path": str(zoo[model]), "profile_mode": "full"})
            for model in SIZES:
                for name in (model, f"{model}_reject", f"{model}_flag"):
                    while client.get(f"/v1/models/{name}").get("profile_status") != "ready":
                        time.sleep(0.2)
            # twice: the first job of a model also builds its sessions; the best of the two is its speed
            rates = {model: max(measured_rate(stack, home, model, n) for n in range(2)) for model in SIZES}
            print("alone: " + ", ".join(f"{model} {rate:,.0f} rows/s" for model, rate in rates.items()))
            results = []
            for round_number in range(rounds):
                jobs = plan(count, args.gap, args.seed + round_number)
                modes = ("reject", "flag") if round_number % 2 == 0 else ("flag", "reject")
                for mode in modes:
                    outcomes = run_phase(stack, home, mode, jobs, rates, tag=f"r{round_number}", verbose=args.verbose)
                    results.append(summarize(mode, outcomes, settings.sla))
                    print(json.dumps(results[-1]))
            print(calibration_line(stack))
    print()
    print("| phase | jobs | accepted | refused | at risk | accepted that met their deadline | "
          "real − predicted, median | abs. error P90 | at risk that met it with 20 % to spare "
          "(refused for another job's deadline) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['mode']} | {r['jobs']} | {r['accepted']} | {r['refused']} | {r['at_risk']} | "
              f"{r['met_share']:.0%} | {r['error_median']:+.0%} | {r['abs_error_p90']:.0%} | "
              f"{r['at_risk_met_with_20pct']} ({r['of_them_for_another_job']}) |")


if __name__ == "__main__":
    main()
