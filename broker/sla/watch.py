"""Watching the active jobs that have a deadline: each reaper pass scores their risk of a miss with the
online model of `broker/sla/predictor.py`, and every job that ends teaches the model what its risk
should have been.

Per job the pass stores in its hash `sla_risk_model` (the model's probability), `sla_risk_at` (when),
`sla_ahead` (the work ahead of it then, for the next pass's `growth`) and `sla_snapshots` (its last
`SNAPSHOTS_KEPT` feature vectors, one at most every `SNAPSHOT_SECONDS`).
`jobs.with_deadline` reports the fresh model risk as `sla_risk`. When the job leaves the active index
(`figures.drop_ended`) its snapshots, labelled missed or met, update the weights in `keys.sla_model`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from broker.jobs.finish_prediction import Fleet, Work, finishes
from broker.jobs.records import ACTIVE_STATUSES, job_record
from broker.sla import predictor as sla_predictor
from broker.state.store import Store, translate_redis_errors

WATCHED_JOBS = 200
"""Most active jobs with a deadline one pass scores (the soonest deadlines first)."""
SNAPSHOT_SECONDS = 1.0
"""Least time between two recorded feature snapshots of one job."""
SNAPSHOTS_KEPT = 16
"""Snapshots a job keeps for learning when it ends (the newest)."""


def weights(store: Store) -> dict[str, float]:
    """The predictor's current weights (`sla_predictor.PRIOR` until a job has ended)."""
    with translate_redis_errors():
        raw = store.client.hget(store.keys.sla_model, "weights")
    return {**sla_predictor.PRIOR, **(json.loads(raw) if raw else {})}


def score_active(store: Store, active: Sequence[Work], *, workers: int, now: float, fleet: Fleet) -> int:
    """Score every watched job of `active` (already the admission's view: score order, device seconds):
    features, risk, a snapshot. Returns how many were scored.

    A running job's `lateness` is judged on its own rate's finish; a queued one's on the later of
    admission's and the plan's. The plan places the job and the work ahead of it on the `fleet`'s live
    stream slots as they are now (`finish_prediction.finishes`: how they share workers and slow each
    other down too), and is the job's `plan` feature either way: it sees a
    flood that has just arrived ahead of the job, or a worker gone, which its own rate sees only once
    it has slowed down, but it is pessimistic on a running job (the later of the two ranked missed
    jobs worse than the plain rule), so the predictor learns how much to trust it."""
    ordered = sorted(active, key=lambda work: (work.score, work.job_id))
    planned = dict(zip([work.job_id for work in ordered],
                       finishes(ordered, fleet, now=now), strict=True))
    ahead, due = 0.0, []
    for work in ordered:
        if work.deadline_at is not None:
            due.append((work, ahead / max(1, workers)))
        ahead += work.seconds
    due = sorted(due, key=lambda pair: pair[0].deadline_at or 0.0)[:WATCHED_JOBS]
    if not due:
        return 0
    learnt = weights(store)
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        for work, _ in due:
            pipe.hgetall(store.keys.job(work.job_id))
        records = pipe.execute()
        pipe = store.client.pipeline(transaction=False)
        for (work, ahead_seconds), raw in zip(due, records, strict=True):
            if not raw or raw.get("status") not in ACTIVE_STATUSES or not raw.get("deadline"):
                continue
            job = job_record(raw, now=now)
            if job.deadline is None:
                continue
            plan, own = planned[work.job_id], job.predicted_finish or 0.0
            running = job.eta_seconds is not None  # (its own rate gave predicted_finish)
            finish = own if running else max(plan, own)
            x = sla_predictor.features(sla_predictor.Live(
                ahead_growth=ahead_growth(raw.get("sla_ahead"), raw.get("sla_risk_at"), ahead_seconds, now=now),
                created_at=job.created_at, deadline=job.deadline, predicted_finish=finish, planned_finish=plan,
                rows_total=job.rows_total, rows_done=job.rows_done, rows_per_second=job.rows_per_second,
                ahead_seconds=ahead_seconds, chunks_done=job.chunks_done, chunk_runs=job.chunk_runs,
                workers=workers), now=now)
            fields: dict[str, Any] = {"sla_risk_model": round(sla_predictor.risk(learnt, x), 4), "sla_risk_at": now,
                                      "sla_ahead": round(ahead_seconds, 4)}
            snapshots = json.loads(raw.get("sla_snapshots") or "[]")
            if not snapshots or now - float(raw.get("sla_snapshot_at") or 0) >= SNAPSHOT_SECONDS:
                fields["sla_snapshots"] = json.dumps((snapshots + [x])[-SNAPSHOTS_KEPT:])
                fields["sla_snapshot_at"] = now
            pipe.hset(store.keys.job(work.job_id), mapping=fields)
        pipe.execute()
    return len(due)


def ahead_growth(before: str | None, before_at: str | None, ahead_seconds: float, *, now: float) -> float:
    """Seconds of work ahead added per second since the last pass (`before` seconds ahead at `before_at`,
    hash fields as stored); 0 on a job's first pass."""
    if not before or not before_at or now - float(before_at) <= 0:
        return 0.0
    return (ahead_seconds - float(before)) / (now - float(before_at))


def learn_from(store: Store, ended: Sequence[dict[str, str]]) -> int:
    """Update the weights with the snapshots of jobs that ended (raw hash fields: `status`, `deadline`,
    `finished_at`, `sla_snapshots`): a job missed its deadline unless it succeeded by it; a cancelled one
    teaches nothing. Returns how many jobs were learnt from."""
    learnt, count = weights(store), 0
    for fields in ended:
        snapshots = json.loads(fields.get("sla_snapshots") or "[]")
        if not snapshots or not fields.get("deadline") or fields.get("status") == "cancelled":
            continue
        met = fields.get("status") == "succeeded" and float(fields.get("finished_at") or "inf") <= float(
            fields["deadline"])
        learnt = sla_predictor.update(learnt, snapshots, missed=not met)
        count += 1
    if count:
        with translate_redis_errors():
            store.client.hset(store.keys.sla_model, mapping={"weights": json.dumps(learnt), "updated_at": time.time()})
            store.client.hincrby(store.keys.sla_model, "jobs", count)
    return count
