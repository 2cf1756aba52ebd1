"""Deadline admission: at submit, predict when a job with a deadline would finish, and refuse (or flag)
one that cannot make it; and, on each reaper pass, score the running deadline jobs' risk.

`broker/sla/figures.py` reads what the prediction needs from Redis: the active jobs ahead
(`keys.jobs_active`), their models' speed, the live workers and the calibrations. This module places
the new job among them with the pure arithmetic of `broker/jobs/finish_prediction.py` (`predict`),
searches the earliest deadline it could meet, and words a refusal that says what to do (`check_job`).
Every active job counts, with or without a deadline: what is queued ahead of a new job in score order
runs before it. Online requests are not counted: on a fleet that also serves them, the margin
(`sla.admission_margin`) has to cover their share.

The reaper's part (`reaper_pass`) scores the active deadline jobs with the violation predictor
(`score_deadline_jobs`), or else drops ended jobs from the active index a page at a time
(`prune_active_jobs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from broker.errors import DeadlineInfeasible
from broker.jobs.finish_prediction import Verdict, Work, admit, work_seconds
from broker.jobs.records import ACTIVE_STATUSES
from broker.models.model_record import ModelRecord
from broker.sla import watch as sla_watch
from broker.sla.figures import Figures, Settings, drop_ended, live_fleet, model_speed, read_figures
from broker.state.store import Store, translate_redis_errors

JOB_LATENCY_SECONDS = 0.15
"""A job's time besides its chunks' slot time: the rest of its submit, the first lease, the final merge's
queue item: 0.1-0.2 s measured on the 2-core reference machine."""


REFINE_STEPS = 8
"""How many times the earliest feasible deadline is recomputed at its own queue position (a later
deadline may sort the job behind more work)."""
PAST_A_DEADLINE_SECONDS = 60.0
"""A refused job's earliest deadline is a whole minute: where the job would push an accepted job past that job's
deadline, the earliest lies just past it, and the accepted job may be another tenant's, whose deadline a
refusal must not tell to the second (a tenant probing deadlines would read them off)."""


@dataclass(frozen=True)
class Prediction:
    """Admission's answer for a new job."""

    verdict: Verdict
    estimate: str
    workers: int
    rows_ahead_seconds: float
    """Seconds of the active work ahead of the job, shared by the fleet's slots."""
    own_seconds: float


def blocking(running: list[Work], score: float, slots: int, *, now: float) -> tuple[float, int]:
    """How long, and on how many slots, chunks of work behind `score` that are running may hold the slots:
    a chunk runs to its end once started, so what is left of a whole chunk of the slowest of those jobs
    (`Work.chunk_seconds`), less the time since its latest chunk began, on as many slots as their chunks
    can fill.

    Each running chunk of a job is taken to be a whole one begun with its latest (`Work.chunk_started_at`):
    its other chunks began earlier. A job whose chunk start is not known holds a whole chunk. What the plan
    cannot see is a chunk running slower than its calibration says (beside a heavy neighbour, or yielding
    to online work): the margin covers that. The start is the worker's clock and `now` the caller's, so
    hosts must keep time alike (NTP).
    """
    behind = [work for work in running if work.score > score]
    if not behind:
        return 0.0, 0
    longest = max(_chunk_left(work, now) for work in behind)
    return longest, min(slots, sum(min(work.chunks, slots) for work in behind))


def _chunk_left(work: Work, now: float) -> float:
    """Seconds left of a running job's chunk: a whole chunk less the time since its latest one began (never
    more than a whole chunk, should the worker's clock run ahead of the caller's)."""
    chunk = work.chunk_seconds if work.chunk_seconds is not None else work.seconds / max(1, work.chunks)
    if work.chunk_started_at is None:
        return chunk
    return min(chunk, max(0.0, chunk - (now - work.chunk_started_at)))


def _earliest_feasible(refused: Verdict, verdict_at: Any, asked: float) -> float:
    """The earliest whole-minute deadline after `asked` that `verdict_at` accepts (`PAST_A_DEADLINE_SECONDS`),
    from what `refused` says: its own predicted finish with the margin, or just past the deadline of the job it
    would tip over (served earliest deadline first, it then goes behind that job). Infinite when none is found
    in `REFINE_STEPS` tries (no live worker, or work keeps arriving ahead)."""
    candidate = refused
    for _ in range(REFINE_STEPS):
        if not math.isfinite(candidate.earliest_deadline):
            return math.inf
        past = 0.0 if candidate.tipped_deadline is None else candidate.tipped_deadline + 1.0
        nxt = max(candidate.earliest_deadline, past, asked + 1.0)
        asked = PAST_A_DEADLINE_SECONDS * math.ceil(nxt / PAST_A_DEADLINE_SECONDS)
        candidate = verdict_at(asked)
        if candidate.feasible:
            return asked
    return math.inf


def predict(settings: Settings, figures: Figures, *, job_id: str, record: ModelRecord, rows: int, chunks: int,
            batch_size: int, deadline_at: float, score_for: Any, now: float,
            max_slots: int | None = None) -> Prediction:
    """Admission's verdict for a job of `rows` rows in `chunks` chunks with `deadline_at`; `score_for(deadline)`
    is its queue score with that deadline (its deadline moves it in the queue, `scoring.deadline_order_time`).

    When the deadline cannot be met, the earliest one that can is searched from the predicted finish:
    a later deadline may put the job behind more work, so each candidate is checked at its own position.
    """
    speed = model_speed(record, batch_size)
    own = work_seconds(rows, seconds_per_row=speed.seconds_per_row, chunks=chunks) * figures.calibration(
        record.version)
    margin = settings.sla.admission_margin

    def verdict_at(deadline: float) -> Verdict:
        score = float(score_for(deadline))
        fleet = figures.plan_fleet(*blocking(figures.running, score, figures.fleet.slots, now=now),
                                   job_latency_seconds=JOB_LATENCY_SECONDS)
        return admit(Work(job_id, score, own, deadline, max(1, chunks), record.version, max_slots=max_slots),
                     figures.active, fleet,
                     now=now, margin=margin, margin_floor=settings.sla.admission_margin_floor)

    verdict = verdict_at(deadline_at)
    if not verdict.feasible:
        verdict = Verdict(verdict.predicted_finish, False, _earliest_feasible(verdict, verdict_at, deadline_at),
                          verdict.reason, verdict.tipped_deadline)
    ahead_score = float(score_for(deadline_at))
    ahead = sum(work.seconds for work in figures.active
                if (work.score, work.job_id) < (ahead_score, job_id)) / max(1, figures.fleet.slots)
    return Prediction(verdict, speed.estimate, figures.fleet.workers, ahead, own)


def check_job(settings: Settings, store: Store, *, job_id: str, record: ModelRecord, rows: int, chunks: int,
              batch_size: int, deadline_at: float, score_for: Any, now: float,
              max_slots: int | None = None) -> tuple[float, bool]:
    """Admit a job with a deadline under its model's `sla.admission`: (its predicted finish, whether it is
    at risk). `reject` raises DeadlineInfeasible when it cannot make it; `flag` accepts it at risk; `off`
    predicts nothing (NaN, not at risk)."""
    mode = settings.sla.admission_for(record.name)
    if mode == "off":
        return math.nan, False
    if deadline_at <= now:
        raise DeadlineInfeasible(f"the deadline {_when(deadline_at)} has passed (it is {_when(now)}); give a time "
                                 "in the future, or deadline_s", predicted_finish=None, earliest_deadline=None)
    figures = read_figures(settings, store, now=now)
    prediction = predict(settings, figures, job_id=job_id, record=record, rows=rows, chunks=chunks,
                         batch_size=batch_size, deadline_at=deadline_at, score_for=score_for, now=now,
                         max_slots=max_slots)
    verdict = prediction.verdict
    if verdict.feasible or mode == "flag":
        return verdict.predicted_finish, not verdict.feasible
    raise DeadlineInfeasible(refusal(prediction, deadline_at=deadline_at, rows=rows, now=now),
                             predicted_finish=round(verdict.predicted_finish, 3) if math.isfinite(
                                 verdict.predicted_finish) else None,
                             earliest_deadline=verdict.earliest_deadline if math.isfinite(
                                 verdict.earliest_deadline) else None)


def refusal(prediction: Prediction, *, deadline_at: float, rows: int, now: float) -> str:
    """What a refused job is told: the deadline, the predicted finish and why, the earliest deadline."""
    verdict = prediction.verdict
    if prediction.workers < 1:
        return (f"cannot finish before {_when(deadline_at)}: no live worker to run it; start one "
                "(`sitsctl worker`) and submit again, or submit without a deadline")
    why = (f"{prediction.rows_ahead_seconds:,.1f} s of work ahead and {prediction.own_seconds:,.1f} s of its own "
           f"({rows:,} rows) on {prediction.workers} worker{'s' if prediction.workers != 1 else ''}")
    earliest = verdict.earliest_deadline
    advice = (f"earliest feasible deadline {_when(earliest)} (in {_span(earliest - now)}: "
              f"deadline_s {math.ceil(earliest - now)})"
              if math.isfinite(earliest) else "no feasible deadline was found; try again when the queue is shorter")
    predicted = _when(verdict.predicted_finish)
    return f"cannot finish before {_when(deadline_at)}: predicted {predicted} ({why}); {advice}"


def _span(seconds: float) -> str:
    """A duration as sitsctl takes it: 45s, 14m, 1h05m."""
    whole = math.ceil(seconds)
    if whole < 120:
        return f"{whole}s"
    minutes = math.ceil(whole / 60)
    return f"{minutes}m" if minutes < 120 else f"{minutes // 60}h{minutes % 60:02d}m"


def _when(unix: float) -> str:
    """A time as RFC 3339 in UTC, to the second."""
    if not math.isfinite(unix):
        return "never"
    return datetime.fromtimestamp(unix, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


PRUNE_PAGE = 500
"""Entries of `keys.jobs_active` a reaper pass checks (the lowest scores: the oldest work first)."""


def prune_active_jobs(settings: Settings, store: Store, *, now: float) -> int:
    """Drop jobs that ended from the front of `keys.jobs_active`, a page per reaper pass (`drop_ended`), so
    that the index stays the size of the active work, and finished jobs calibrate their models, even
    where no deadline job is submitted to read them. Returns how many were dropped."""
    with translate_redis_errors():
        job_ids = store.client.zrange(store.keys.jobs_active, 0, PRUNE_PAGE - 1)
        if not job_ids:
            return 0
        pipe = store.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(store.keys.job(job_id), "status")
        statuses = pipe.execute()
    ended = [job_id for job_id, status in zip(job_ids, statuses, strict=True) if status not in ACTIVE_STATUSES]
    return drop_ended(store, ended, live_fleet(settings, store, now=now)) if ended else 0


def score_deadline_jobs(settings: Settings, store: Store, *, now: float) -> int:
    """A reaper pass's scoring of the active jobs with a deadline by the violation predictor
    (`sla_watch.score_active`), on admission's view of the work ahead of each. Returns how many."""
    figures = read_figures(settings, store, now=now)
    return sla_watch.score_active(store, figures.active, workers=figures.fleet.workers, now=now,
                                  fleet=figures.plan_fleet())


def reaper_pass(settings: Settings, store: Store, *, now: float) -> int:
    """A reaper pass's part: with jobs with a deadline active (`keys.jobs_due`), score them with the
    violation predictor (`score_deadline_jobs`, whose read drops every ended job from the active index);
    without any, only a page of that pruning (`prune_active_jobs`), so a fleet without deadlines pays
    no full read of the active jobs each pass. Returns the jobs scored or dropped."""
    with translate_redis_errors():
        due = store.client.zcard(store.keys.jobs_due)
    return score_deadline_jobs(settings, store, now=now) if due else prune_active_jobs(settings, store, now=now)
