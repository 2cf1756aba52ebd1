"""The SLA figures of `/metrics`: latency histograms, deadlines met and missed, admission refusals, and
the risk of the active jobs with a deadline.

The scripts that complete requests, acknowledge job chunks and end jobs count each observation into
its bucket (`keys.latency_buckets`, `lib.lua` `observe_latency`) in the call they already make, so a
histogram costs a few HINCRBYs a batch and a scrape reads it whole in one HGETALL. Buckets are kept one
by one and made cumulative here (`broker.monitoring.histograms`). Deadline outcomes and refusals are
running totals in `keys.counters`.

A job's risk is what `GET /v1/jobs/<id>` reports (`jobs.with_rates`), for at most `RISK_JOBS` active
jobs: those with the soonest deadlines (`keys.jobs_due`).
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.jobs import records as jobs
from broker.monitoring.histograms import Histogram, decode
from broker.state.store import Store, translate_redis_errors

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0, 600.0)
"""Upper bounds in seconds of the histograms' buckets, from a small model's 1 ms run to a job's 10
minutes (`lib.lua` lists the same); +Inf holds what is past the last."""

PRIORITY_CLASSES = (("express", 12), ("high", 8), ("normal", 4), ("low", 0))
"""A histogram's priority class and the lowest priority level in it, of the level as submitted (a PSA
jump does not move a request to another class). Four classes keep the series few."""

RISK_JOBS = 200
"""Most active jobs with a deadline a scrape reads, soonest deadline first."""

AT_RISK = 0.5
"""A job whose risk reaches this is predicted to miss its deadline (`finish_prediction.sla_risk`)."""

_RISK_FIELDS = ("status", "model_ref", "rows_total", "rows_done", "started_at", "finished_at", "resumed_at",
                "rows_at_resume", "predicted_finish", "sla_risk_model", "sla_risk_at")


def priority_class(level: int) -> str:
    """The class of a priority level (`PRIORITY_CLASSES`)."""
    return next(name for name, lowest in PRIORITY_CLASSES if level >= lowest)


def decode_histograms(raw: dict[str, str]) -> dict[tuple[str, str, str], Histogram]:
    """The `keys.latency_buckets` hash as (model ref, what, priority class) -> `Histogram` (in seconds)."""
    histograms = {}
    for series, histogram in decode(raw, len(LATENCY_BUCKETS) + 1, sum_scale=1e9).items():
        model_ref, what, klass = series.rsplit("|", 2)
        histograms[(model_ref, what, klass)] = histogram
    return histograms


def count_admission_refusal(store: Store, model_ref: str) -> None:
    """Count a job refused by deadline admission (`admission.check_job`) for /metrics."""
    with translate_redis_errors():
        store.client.hincrby(store.keys.counters, f"admission_rejected:{model_ref}", 1)


@dataclass(frozen=True)
class ModelRisk:
    """The active jobs with a deadline of one model version, as their risk goes."""

    jobs: int
    at_risk: int
    """Of them, those predicted to miss it (risk at least `AT_RISK`)."""
    highest: float
    """The highest risk among them; a job with no prediction yet (admission `off`, not started) counts 0."""


def read_job_risks(store: Store, *, now: float) -> dict[str, ModelRisk]:
    """Model ref -> `ModelRisk` of the `RISK_JOBS` active jobs with the soonest deadlines, in two round
    trips (one when there is none)."""
    with translate_redis_errors():
        due = store.client.zrange(store.keys.jobs_due, 0, RISK_JOBS - 1, withscores=True)
        if not due:
            return {}
        pipe = store.client.pipeline(transaction=False)
        for job_id, _ in due:
            pipe.hmget(store.keys.job(job_id), _RISK_FIELDS)
        rows = pipe.execute()
    risks: dict[str, list[float]] = {}
    for (_, deadline), row in zip(due, rows, strict=True):
        fields = dict(zip(_RISK_FIELDS, row, strict=True))
        if fields["status"] not in jobs.ACTIVE_STATUSES or not fields["model_ref"]:
            continue  # it ended between the two reads
        risk = job_risk(fields, deadline=deadline, now=now)
        risks.setdefault(fields["model_ref"], []).append(0.0 if risk is None else risk)
    return {ref: ModelRisk(len(values), sum(value >= AT_RISK for value in values), max(values))
            for ref, values in risks.items()}


def job_risk(fields: dict[str, str | None], *, deadline: float, now: float) -> float | None:
    """An active job's risk of missing `deadline` from its hash `fields` (`_RISK_FIELDS`), as the jobs API
    reckons it: the violation predictor's when fresh, else from its own rate once it runs and from
    admission's prediction until then."""
    def number(name: str) -> float | None:
        text = fields.get(name)
        return float(text) if text else None

    job = {"status": fields["status"], "rows_total": int(number("rows_total") or 0),
           "rows_done": int(number("rows_done") or 0), "started_at": number("started_at"),
           "finished_at": number("finished_at"), "resumed_at": number("resumed_at"),
           "rows_at_resume": number("rows_at_resume"), "predicted_finish": number("predicted_finish"),
           "sla_risk_model": number("sla_risk_model"), "sla_risk_at": number("sla_risk_at"), "deadline": deadline}
    return jobs.with_rates(job, now=now)["sla_risk"]
