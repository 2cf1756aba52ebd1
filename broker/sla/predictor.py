"""The SLA violation predictor: the probability that a running job misses its deadline, from live figures,
by a logistic model small enough to learn online. Pure functions; `broker/sla/watch.py` feeds them.

Features, each scaled to about -3..3 (`features`):

- `lateness`: how far past its deadline the job is predicted to finish, over the time it was given
  (negative when it is predicted early): the plain rule's figure, on the finish `sla_watch` passes in
  (a running job's own rate's; a queued one's the later of admission's and the plan's);
- `plan`: the same for the plan's finish (the job and the work now ahead of it on the live slots);
- `pace`: log2 of the rows per second it needs from now over the rows per second it gets;
- `elapsed`: the share of its time (submit to deadline) already gone;
- `progress`: the share of its rows done;
- `ahead`: the device time queued ahead of it, over the time it has left;
- `growth`: how fast that work ahead grows (seconds of it added per second since the last pass):
  near 1, work arrives ahead of the job as fast as the fleet serves it;
- `retries`: chunk runs beyond one per chunk done, per chunk done (failures and lost leases);
- `workers`: 1 / (1 + live workers): a fleet that shrinks raises it.

The model starts as the plain rule (`PRIOR`: lateness alone, 0.5 on time) and learns from every job
that ends (`update`: one step of gradient descent on the log-loss per recorded snapshot of its life,
labelled missed or met). A few hundred numbers per job, no framework.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

FEATURES = ("lateness", "plan", "pace", "elapsed", "progress", "ahead", "growth", "retries", "workers")

PRIOR = {"bias": 0.0, "lateness": 6.0, "plan": 0.0, "pace": 0.0, "elapsed": 0.0, "progress": 0.0, "ahead": 0.0,
         "growth": 0.0, "retries": 0.0, "workers": 0.0}
"""The weights before any job ended: the plain rule (predicted finish against the deadline) made smooth."""

LEARNING_RATE = 0.1
L2 = 0.001
"""Weight decay per step, towards the prior: a burst of one kind of job does not erase what was learnt."""


@dataclass(frozen=True)
class Live:
    """One active job with a deadline, as the watcher reads it at `now`."""

    created_at: float
    deadline: float
    predicted_finish: float | None
    rows_total: int
    rows_done: int
    rows_per_second: float
    ahead_seconds: float
    chunks_done: int
    chunk_runs: int
    workers: int
    ahead_growth: float = 0.0
    """Seconds of work ahead added per second since the job was last scored (negative as it drains)."""
    planned_finish: float | None = None
    """The plan's finish: the job and the work now ahead of it on the live slots (None: not planned)."""


def features(job: Live, *, now: float) -> dict[str, float]:
    """The job's features at `now` (see the module's docstring), each clipped to [-3, 3]."""
    given = max(1.0, job.deadline - job.created_at)
    left = job.deadline - now
    remaining = max(0, job.rows_total - job.rows_done)
    finish = job.predicted_finish if job.predicted_finish is not None else math.inf
    planned = job.planned_finish if job.planned_finish is not None else finish
    needed = remaining / max(left, 0.1)
    pace = math.log2(max(needed, 1e-3) / max(job.rows_per_second, 1e-3)) if remaining else -3.0
    values = {
        "lateness": (finish - job.deadline) / given if math.isfinite(finish) else 3.0,
        "plan": (planned - job.deadline) / given if math.isfinite(planned) else 3.0,
        "pace": pace / 3,
        "elapsed": (now - job.created_at) / given,
        "progress": job.rows_done / job.rows_total if job.rows_total else 1.0,
        "ahead": job.ahead_seconds / max(left, 0.1) / 3,
        "growth": job.ahead_growth,
        "retries": max(0, job.chunk_runs - job.chunks_done) / max(1, job.chunks_done),
        "workers": 1.0 / (1 + max(0, job.workers)),
    }
    return {name: max(-3.0, min(3.0, value)) for name, value in values.items()}


def risk(weights: Mapping[str, float], x: Mapping[str, float]) -> float:
    """The predicted probability of a miss, 0 to 1."""
    z = weights.get("bias", 0.0) + sum(weights.get(name, 0.0) * x.get(name, 0.0) for name in FEATURES)
    return 1 / (1 + math.exp(-max(-30.0, min(30.0, z))))


def update(weights: Mapping[str, float], snapshots: Sequence[Mapping[str, float]], *, missed: bool) -> dict[str, float]:
    """The weights after a job ended (`missed` its deadline or not), one gradient step per snapshot of its
    features, each step decaying the weights a little towards `PRIOR`."""
    learnt = {**PRIOR, **weights}
    label = 1.0 if missed else 0.0
    for x in snapshots:
        error = risk(learnt, x) - label
        learnt["bias"] -= LEARNING_RATE * (error + L2 * (learnt["bias"] - PRIOR["bias"]))
        for name in FEATURES:
            gradient = error * x.get(name, 0.0) + L2 * (learnt[name] - PRIOR[name])
            learnt[name] -= LEARNING_RATE * gradient
    return {name: round(value, 6) for name, value in learnt.items()}


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve (the chance a missed job's score is above a met one's; ties count half);
    NaN without both kinds."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not positives or not negatives:
        return math.nan
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))
