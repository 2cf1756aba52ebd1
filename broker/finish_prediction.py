"""When would a job finish? The pure arithmetic behind deadline admission and a job's `predicted_finish`.

SITS serves waiting work in queue-score order (`broker/scoring.py`), and a worker's device runs one
mini-batch at a time whatever model it belongs to. So a job's finish is predicted as a serial
schedule over the fleet: the device time of every active job ahead of it in score order, then its
own, shared by the live workers, from `now`. Each job's device time is its remaining rows at its
model's measured seconds per row (at the job's batch size), plus a fixed cost per chunk (lease,
part file, fsync, ack). A chunk runs to its end once started, so work that arrives ahead of running
chunks still waits for one of them: `blocking_seconds`.

Nothing here reads Redis or the clock: `broker/admission.py` gathers the figures and passes `now`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK_OVERHEAD_SECONDS = 0.005
"""A chunk's fixed cost besides its rows (lease, input read set-up, part file fsync, ack): about 4 ms on
the 2-core reference machine (docs/benchmarks.md), rounded up."""


@dataclass(frozen=True)
class Work:
    """One job's remaining work as the predictor sees it."""

    job_id: str
    score: float
    """Its chunks' queue score: lower is served first."""
    seconds: float
    """Device seconds its remaining rows need on one worker."""
    deadline_at: float | None = None


@dataclass(frozen=True)
class Fleet:
    """What runs the work: how many workers share it, and how long a running chunk can hold them."""

    workers: int
    blocking_seconds: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """What admission decides for a job with a deadline."""

    predicted_finish: float
    feasible: bool
    earliest_deadline: float
    """The earliest deadline that would be accepted now (`predicted_finish` with the margin, where the
    job's own deadline does not move it ahead of other work)."""
    reason: str = ""
    """Why it is infeasible: its own finish, another job it would push past its deadline, or no worker."""
    tipped_deadline: float | None = None
    """The deadline of the accepted job this one would push past it, when that is the reason."""


def work_seconds(rows: int, *, seconds_per_row: float, chunks: int) -> float:
    """Device seconds for `rows` rows in `chunks` chunks at `seconds_per_row`."""
    return max(0, rows) * seconds_per_row + max(0, chunks) * CHUNK_OVERHEAD_SECONDS


def finishes(ordered: Sequence[Work], fleet: Fleet, *, now: float) -> list[float]:
    """The predicted finish of each job of `ordered` (already in score order), served one after another
    by `fleet.workers` workers sharing the load evenly. Infinite without a live worker."""
    if fleet.workers < 1:
        return [math.inf] * len(ordered)
    done, out = now + (fleet.blocking_seconds if ordered else 0.0), []
    for work in ordered:
        done += work.seconds / fleet.workers
        out.append(done)
    return out


def admit(new: Work, active: Sequence[Work], fleet: Fleet, *, now: float, margin: float) -> Verdict:
    """Whether `new` (with a deadline) can finish by it, and would push no accepted job past its own.

    `margin` is a share of the predicted time from now kept in hand for what the prediction misses
    (a 0.1 margin accepts a job predicted to need 100 s only with a deadline 110 s away). A job
    already predicted to miss its deadline does not make the newcomer infeasible: only one the
    newcomer would tip over does.
    """
    if new.deadline_at is None:
        raise ValueError(f"job {new.job_id} has no deadline to admit it against")
    before = _finish_by_job(active, fleet, now=now)
    after = _finish_by_job([*active, new], fleet, now=now)
    finish = after[new.job_id]
    if math.isinf(finish):
        return Verdict(finish, False, math.inf, "no live worker can run it")
    needed = _with_margin(finish, now=now, margin=margin)
    if needed > new.deadline_at:
        return Verdict(finish, False, needed, "its own work and the work ahead of it")
    for work in active:
        if work.deadline_at is None:
            continue
        was, now_would = before[work.job_id], after[work.job_id]
        if was <= work.deadline_at < now_would:
            return Verdict(finish, False, needed, f"job {work.job_id} would then miss its deadline",
                           work.deadline_at)
    return Verdict(finish, True, needed)


def _finish_by_job(works: Sequence[Work], fleet: Fleet, *, now: float) -> dict[str, float]:
    ordered = sorted(works, key=lambda work: (work.score, work.job_id))
    return dict(zip([work.job_id for work in ordered], finishes(ordered, fleet, now=now), strict=True))


def _with_margin(finish: float, *, now: float, margin: float) -> float:
    return now + (finish - now) * (1 + margin)


def sla_risk(predicted_finish: float | None, deadline_at: float | None, *, now: float,
             spread: float = 0.15) -> float | None:
    """How likely the job misses its deadline, 0 to 1, from its predicted finish alone: 0.5 when it is
    predicted to finish exactly on time, towards 1 as the prediction passes the deadline. The
    prediction's error is taken to grow with the time left (`spread` of it, at least a second): 6 s
    late on a prediction of a minute is as sure a miss as 6 minutes late on one of an hour, and 6 s
    late on an hour is nearly even."""
    if deadline_at is None or predicted_finish is None:
        return None
    if math.isinf(predicted_finish):
        return 1.0
    scale = max(1.0, spread * max(predicted_finish - now, 0.0))
    lateness = (predicted_finish - deadline_at) / scale
    return round(1 / (1 + math.exp(-max(-30.0, min(30.0, lateness * 3)))), 4)


CALIBRATION_WEIGHT = 0.3
"""How much one finished job moves its model's calibration (an exponentially weighted mean)."""
CALIBRATION_BOUNDS = (0.5, 10.0)
"""A calibration stays within these: one job slowed by a flood of other work says little about the next."""


def recalibrated(factor: float, *, real: float, predicted: float) -> float:
    """A model's calibration `factor` after one of its jobs ran `real` seconds (first lease to finish) where
    its profile foresaw `predicted`: its predicted device time is multiplied by the result, so a fleet
    slower than its profiles (per-chunk costs, streams that share cores, online traffic, other
    processes) is learnt."""
    if predicted <= 0 or real <= 0:
        return factor
    low, high = CALIBRATION_BOUNDS
    observed = min(high, max(low, real / predicted))
    return round((1 - CALIBRATION_WEIGHT) * factor + CALIBRATION_WEIGHT * observed, 4)
