"""How a job's sliced calls are cut: the items one call takes, and when a series cut short is stalled.

A job's fill (`broker/jobs/fills.py`) and its stop (`broker/jobs/stops.py`) touch every chunk of the
job, so each runs as a series of script calls of at most `ENQUEUE_SLICE` items, each call telling its
script where in the series it stands (`slice_call`). Callers read `ENQUEUE_SLICE` at call
time, so that tests and benchmarks may change it.
"""

from __future__ import annotations

ENQUEUE_SLICE = 128
"""Items one enqueue or stop call handles at most: at most about 4 ms of Redis time (p99, measured on 2
cores with 100,000 items queued: benchmarks/job_slices.py), so that a job of 100,000 chunks never holds
Redis, and every online request, for seconds (one call took 4-7 s)."""
FILL_STALLED_SECONDS = 30.0
"""A job still filling (or stopping) whose last enqueue (or stop) call is this old lost its caller; a reaper
pass completes the fill (or the stop)."""


def slice_call(number: int, count: int, *, continued: bool) -> str:
    """What call `number` of `count` of a sliced fill or stop says of itself to its script: '' (the only one),
    'first' (more follow), 'more' or 'last'; with `continued` (taken up by a reaper pass) none is the first."""
    taken_up, more_follow = number > 0 or continued, number < count - 1
    return ("more" if taken_up else "first") if more_follow else ("last" if taken_up else "")
