"""Deadlines of offline jobs at the API's edge: read the one a submit gives, and admit the job against it.

`POST /v1/jobs` takes `deadline` (an RFC 3339 time) or `deadline_s` (seconds from now). A job with one
is checked by deadline admission (`broker/sla/admission.py`) under its model's `sla.admission` before
anything is queued, and queued to age from near its deadline (`scoring.deadline_order_time`).
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime

from broker.config.settings import Settings
from broker.errors import BadInput
from broker.jobs import records as jobs
from broker.models.model_record import ModelRecord
from broker.queueing import scoring
from broker.sla import admission
from broker.state.store import Store
from sits_api.schemas import JobSubmission

MAX_DEADLINE_SECONDS = 366 * 86_400.0
"""The furthest a `deadline` may lie ahead: as far as `deadline_s` may."""
DEADLINE_PAST_SECONDS = 86_400.0
"""How far before now a `deadline` may lie (a clock a little behind, or a deadline just passed: admission
refuses it with its reasons); further back it is a mistake, and a date near year 1 fails date arithmetic."""


def deadline_at(body: JobSubmission, *, now: float) -> float | None:
    """The job's deadline in unix seconds, from `deadline` (RFC 3339) or `deadline_s`; None without one."""
    if body.deadline_s is not None:
        return now + body.deadline_s
    if body.deadline is None:
        return None
    try:
        moment = datetime.fromisoformat(body.deadline)
    except ValueError:
        raise BadInput(f"deadline {body.deadline!r} is not an RFC 3339 time; write it as 2026-12-01T10:42:00Z "
                       "or with an offset (+01:00), or give deadline_s in seconds from now") from None
    if moment.tzinfo is None:
        raise BadInput(f"deadline {body.deadline!r} has no time zone; add Z (UTC) or an offset such as +01:00")
    due = moment.timestamp()
    if not now - DEADLINE_PAST_SECONDS <= due <= now + MAX_DEADLINE_SECONDS:  # (year 1 made dates fail later)
        raise BadInput(f"deadline {body.deadline!r} is more than a day before now or more than 366 days after it; "
                       "give a time within them, or leave the deadline out")
    return due


def admitted(settings: Settings, store: Store, spec: jobs.JobSpec, model: ModelRecord, *,
              weights: scoring.Weights, ordering: scoring.Ordering, now: float) -> jobs.JobSpec:
    """`spec` with its predicted finish and risk flag, once deadline admission let it in (it raises
    DeadlineInfeasible otherwise: `broker/sla/admission.py`)."""
    due = float(spec.deadline_at or 0.0)  # (set: only jobs with a deadline come here)
    horizon = settings.sla.deadline_horizon

    def score_for(deadline: float) -> float:
        order_at = jobs.job_order_time(spec.priority, spec.max_priority, now, deadline, horizon=horizon,
                                       delta=weights.delta)
        return scoring.queue_key(jobs.job_factors(spec.priority, now, order_at, spec.max_priority), weights, ordering)

    finish, at_risk = admission.check_job(
        settings, store, job_id=spec.job_id, record=model, rows=spec.rows_total,
        chunks=len(jobs.chunk_ranges(spec.rows_total, spec.chunk_size)), batch_size=spec.batch_size,
        deadline_at=due, score_for=score_for, now=now, max_slots=spec.max_slots)
    return dataclasses.replace(spec, predicted_finish=round(finish, 3) if math.isfinite(finish) else None,
                               at_risk=at_risk)
