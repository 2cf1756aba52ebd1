"""Stopping a job: cancel or fail it, take its waiting items out, and complete a stop whose caller died.

A stop takes out every item the job may have queued, in calls of `job_slices.ENQUEUE_SLICE` items, so
that a job of 100,000 chunks never holds Redis for seconds. While more calls are to come the job is in
`keys.jobs_stopping`, and a reaper pass completes a stop whose caller died (`stalled_stops`,
`finish_stop`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

from broker.jobs import slices as job_slices
from broker.jobs.records import chunk_item_id, finalize_item_id, job_not_found
from broker.jobs.views import JobStopView
from broker.state.store import Store, translate_redis_errors

STOP_STATUSES = ("cancelled", "failed")
"""The statuses `stop_job` gives."""


def stopped_status(store: Store, job_id: str) -> str | None:
    """The job's status when it was stopped (one of `STOP_STATUSES`), else None: a running chunk looks
    now and then, so that the chunk of a cancelled job stops at its next mini-batch."""
    with translate_redis_errors():
        status = store.client.hget(store.keys.job(job_id), "status")
    return status if status in STOP_STATUSES else None


def _job_item_ids(job_id: str, chunks_total: int) -> list[str]:
    """Every item id a job may have queued: its chunks' and its finalize step's."""
    return [chunk_item_id(job_id, i) for i in range(chunks_total)] + [finalize_item_id(job_id)]


def stop_job(store: Store, job_id: str, *, status: str, error: str, now: float, dead_item: str = "") -> str:
    """Cancel or fail a job and take its waiting items out; returns the job's status afterwards.

    With `dead_item`, the stop happens only while that item is still in the dead set, so a
    resume that took it back in the meantime wins ('skipped'). A stop of a job that already has
    `status` takes the items out again, and any earlier stop still going on over (a second DELETE).
    While more calls are to come the job is in `keys.jobs_stopping` (a reaper pass completes the stop
    if this caller dies: `stalled_stops`, `finish_stop`).
    """
    with translate_redis_errors():
        job = JobStopView.of(store.client.hmget(store.keys.job(job_id), JobStopView.names()))
    if job.model_ref is None:
        raise job_not_found(job_id)
    before, stop_id = int(job.chunks_total or 0), secrets.token_hex(6)
    reply = _take_items_out(store, job_id, job.model_ref, _job_item_ids(job_id, before), status=status,
                            error=error, now=now, stop_id=stop_id, dead_item=dead_item)
    # A chunk split as it ran between the read above and the stop queued a new chunk (`cuts.split_chunk`;
    # none is split once the job is stopped): it goes too.
    with translate_redis_errors():
        after = int(store.client.hget(store.keys.job(job_id), "chunks_total") or 0)
    if after > before:
        _take_items_out(store, job_id, job.model_ref, [chunk_item_id(job_id, index) for index in range(before, after)],
                        status=status, error=error, now=now, stop_id=stop_id, continued=True)
    return reply


def _take_items_out(store: Store, job_id: str, model_ref: str, item_ids: Sequence[str], *, status: str, error: str,
                    now: float, stop_id: str, dead_item: str = "", continued: bool = False) -> str:
    """The calls of one stop (`stop_id`), `job_slices.ENQUEUE_SLICE` items each: the first stops the job, later
    ones (all, with `continued`: a stop taken up again) take items out while the job has `status` and `stop_id`.
    Returns the first call's reply."""
    keys = store.keys
    stop_keys = [keys.job(job_id), keys.ready(model_ref), keys.inflight(model_ref), keys.items, keys.attempts,
                 keys.dead, keys.job_counts, keys.jobs_stopping, keys.counters, keys.latency_buckets, keys.jobs_due]
    slices = [item_ids[start:start + job_slices.ENQUEUE_SLICE]
              for start in range(0, len(item_ids), job_slices.ENQUEUE_SLICE)] or [[]]
    first = ""
    for number, group in enumerate(slices):
        with translate_redis_errors():
            result = str(store.scripts.stop_job(
                keys=stop_keys,
                args=[status, error, now, dead_item if number == 0 else "",
                      job_slices.slice_call(number, len(slices), continued=continued), stop_id, job_id, time.time(),
                      *group],
            ))
        if result == "already":  # stopped with this status by a stop that finished: nothing left to take out
            return status
        first = first or result
        if result != status:  # finished, skipped or gone (first call); resumed or taken over since
            break
    return first


def stalled_stops(store: Store, *, now: float) -> list[str]:
    """Jobs whose stop ended part-way: its last call is `job_slices.FILL_STALLED_SECONDS` old (the API process, or the
    reaper pass, stopping them died between two calls). `finish_stop` completes each."""
    with translate_redis_errors():
        return list(store.client.zrangebyscore(store.keys.jobs_stopping, "-inf", now - job_slices.FILL_STALLED_SECONDS))


def finish_stop(store: Store, job_id: str, *, now: float) -> str:
    """Take out every item a stalled stop left in the queue, in slices as its caller would have, each call
    only while the job still has the stop's status and id (`stop_id`; a job stopped before it was recorded
    has none): a job resumed since keeps what the resume queued, a stop that took this one over is left to
    its own caller. Idempotent; the job leaves the stopping index. Returns the first call's reply (the stop's
    status, 'superseded', or the job's status when it is not stopped)."""
    with translate_redis_errors():
        job = JobStopView.of(store.client.hmget(store.keys.job(job_id), JobStopView.names()))
    model_ref, chunks_total, status, stop_id = job.model_ref, job.chunks_total, job.status, job.stop_id
    if model_ref is None:  # gone: nothing of it to take out
        with translate_redis_errors():
            store.client.zrem(store.keys.jobs_stopping, job_id)
        return ""
    # not stopped (resumed or finished since): one call with no status and no items only ends the entry
    stopped = status if status in STOP_STATUSES else ""
    item_ids = _job_item_ids(job_id, int(chunks_total or 0)) if stopped else []
    return _take_items_out(store, job_id, model_ref, item_ids, status=stopped, error="", now=now,
                           stop_id=stop_id or "", continued=True)
