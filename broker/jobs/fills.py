"""Queueing a job's chunk items: its creation, its resume, and completing a fill whose caller died.

A job's items are queued in calls of `job_slices.ENQUEUE_SLICE` (a fill), so that a job of 100,000
chunks never holds Redis for seconds. A resume re-queues exactly the chunks not in the job's `done`
set. While more calls are to come the job is in `keys.jobs_filling`, and a reaper pass completes a
fill whose caller died (`stalled_fills`, `refill_job`).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from broker.errors import Conflict
from broker.failures import retries
from broker.jobs import cuts
from broker.jobs import slices as job_slices
from broker.jobs.progress import done_chunks
from broker.jobs.records import (
    ACTIVE_STATUSES,
    JobSpec,
    chunk_item_id,
    chunk_ranges,
    finalize_item_id,
    finalize_payload,
    get_job,
    job_factors,
    job_order_time,
    job_record,
    order_time,
    stored_priority_cap,
)
from broker.queueing.scoring import Ordering, Weights, queue_key
from broker.state.replies import EnqueueReply
from broker.state.store import Store, translate_redis_errors
from broker.tracing import spans


def _item_args(job_id: str, model_ref: str, ranges: Sequence[tuple[int, int]], indexes: Sequence[int],
               score: float, factors: dict[str, Any], batch_size: int, tenant: str, owner: str,
               max_slots: int | None = None) -> list[Any]:
    args: list[Any] = []
    capped = {"max_slots": max_slots} if max_slots else {}  # (lease_batch.lua leases no more at once)
    traced = spans.traceparent_field()  # (the span queueing them: the job's trace, continued by their workers)
    for index in indexes:
        start, stop = ranges[index]
        payload = {"kind": "chunk", "job": job_id, "model_ref": model_ref, "chunk": index,
                   "start": start, "stop": stop, "batch_size": batch_size, "score": score, "factors": factors,
                   "tenant": tenant, "owner": owner, **capped, **traced}
        args += [chunk_item_id(job_id, index), score, json.dumps(payload), str(index)]
    return args


@spans.traced("sits.enqueue", lambda store, spec, **_: {"sits.job_id": spec.job_id, "sits.model_ref": spec.model_ref,
                                                       "sits.tenant": spec.tenant or spec.owner})
def create_job(store: Store, spec: JobSpec, *, now: float, weights: Weights | None = None,
               ordering: Ordering = "dynamic", deadline_horizon: float = 0.0) -> None:
    """Write the job hash and queue all its chunks in one atomic call (scored with `weights`; a job with
    a deadline ages from `deadline_horizon` before it, `scoring.deadline_order_time`, within what its
    tenant's `max_priority` allows, `records.job_order_time`)."""
    weights = weights or Weights()
    order_at = None if spec.deadline_at is None else job_order_time(
        spec.priority, spec.max_priority, now, spec.deadline_at, horizon=deadline_horizon, delta=weights.delta)
    ranges = chunk_ranges(spec.rows_total, spec.chunk_size)
    fields = {
        "id": spec.job_id,
        "model": spec.model_name,
        "model_version": spec.model_version,
        "model_ref": spec.model_ref,
        "input_batch": spec.input_batch,
        "input_format": spec.input_format,
        "input_checksum": spec.input_checksum,
        "input_options": json.dumps(spec.input_options or {}),
        "input_stat": json.dumps(spec.input_stat) if spec.input_stat else "",
        "output_dir": spec.output_dir,
        "output_names": json.dumps(list(spec.output_names)),
        "output_format": spec.output_format,
        "rows_total": spec.rows_total,
        "rows_done": 0,
        "chunks_total": len(ranges),
        "chunks_done": 0,
        "chunk_runs": 0,
        "chunk_size": spec.chunk_size,
        "batch_size": spec.batch_size,
        "priority": spec.priority,
        "owner": spec.owner,
        "tenant": spec.tenant or spec.owner,
        "status": "queued",
        "error": "",
        "created_at": now,
        "checkpoint_ts": now,
        "deadline": spec.deadline_at if spec.deadline_at is not None else "",
        "predicted_finish": spec.predicted_finish if spec.predicted_finish is not None else "",
        "at_risk": "1" if spec.at_risk else "",
        "order_at": order_at if order_at is not None else "",
        "priority_cap": spec.max_priority,
        "max_slots": spec.max_slots or "",
    }
    factors = job_factors(spec.priority, now, order_at, spec.max_priority)
    score = queue_key(factors, weights, ordering)
    _enqueue(store, spec.job_id, spec.model_ref, fields, "create", now,
             _item_args(spec.job_id, spec.model_ref, ranges, range(len(ranges)), score, factors.to_dict(),
                        spec.batch_size, spec.tenant or spec.owner, spec.owner, spec.max_slots), owner=spec.owner,
             tenant=(spec.tenant or spec.owner) if spec.owner else "")  # (a job without an owner is the admins' alone)
    _mark_active(store, spec.job_id, score, spec.deadline_at)


@spans.traced("sits.enqueue", lambda store, job_id, **_: {"sits.job_id": job_id})
def resume_job(store: Store, job_id: str, *, now: float, weights: Weights | None = None,
               ordering: Ordering = "dynamic", input_stat: dict[str, int] | None = None,
               deadline_horizon: float = 0.0, max_priority: int | None = None) -> int:
    """Re-queue every chunk not yet done (and the finalize step if all are); returns items queued.
    `input_stat` replaces the input file's recorded identity (its checksum was found unchanged).
    `max_priority` is its tenant's cap as it stands now (None: the one the job recorded).

    Chunks still leased by a previous run are taken back: after a crash their
    holders are gone, and if one is not, its duplicate run rewrites the same
    bytes and its ack is counted once.
    """
    job = get_job(store, job_id, now=now)
    if job.status == "succeeded":
        raise Conflict(f"job {job_id} already succeeded; its outputs are in {job.output_dir}")
    done = done_chunks(store, job_id)
    ranges = cuts.chunk_layout(store, job_id, rows_total=job.rows_total, chunk_size=job.chunk_size,
                               chunks_total=int(job.chunks_total))
    missing = [index for index in range(len(ranges)) if index not in done]
    weights = weights or Weights()
    if max_priority is None:
        with translate_redis_errors():
            max_priority = stored_priority_cap(store.client.hget(store.keys.job(job_id), "priority_cap"))
    order_at = order_time(job, now, deadline_horizon, max_priority=max_priority, delta=weights.delta)
    factors = job_factors(job.priority, now, order_at, max_priority)
    score = queue_key(factors, weights, ordering)
    model_ref = job.model_ref
    item_args = _item_args(job_id, model_ref, ranges, missing, score, factors.to_dict(), int(job.batch_size),
                           job.tenant or "", job.owner or "", job.max_slots)
    if not missing:
        finalize = {**finalize_payload(job_id, model_ref, score, factors.to_dict(), job.tenant or ""),
                    **spans.traceparent_field()}
        item_args = [finalize_item_id(job_id), score, json.dumps(finalize), ""]
    fields: dict[str, Any] = {"status": "queued", "error": "", "finished_at": "", "resumed_at": now,
                              "rows_at_resume": job.rows_done, "order_at": order_at if order_at is not None else "",
                              "priority_cap": max_priority}
    if input_stat:
        fields["input_stat"] = json.dumps(input_stat)
    retries.forget_item_counts(store, job_id)  # a resume starts its chunks on fresh attempts of every class
    added = _enqueue(store, job_id, model_ref, fields, "resume", now, item_args)
    _mark_active(store, job_id, score, job.deadline)
    return added


def _mark_active(store: Store, job_id: str, score: float, deadline: float | None) -> None:
    """Index the job among the active ones, at its chunks' score, for deadline admission, and with its
    deadline, if it has one, for /metrics (`keys.jobs_due`). (After its items are queued: a crash in
    between leaves a job that admission does not count, not one that counts without work.)"""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.zadd(store.keys.jobs_active, {job_id: score})
        if deadline is not None:
            pipe.zadd(store.keys.jobs_due, {job_id: deadline})
        pipe.execute()


def _enqueue(store: Store, job_id: str, model_ref: str, fields: dict[str, Any], mode: str, now: float,
             item_args: list[Any], owner: str = "", *, fill_id: str | None = None, tenant: str = "") -> int:
    """Queue a job's items in calls of `job_slices.ENQUEUE_SLICE`, the job's `fields` set by the first;
    a job's creation (given its `owner` and `tenant`) also adds it to their job indexes.

    While more calls are to come the job is in `keys.jobs_filling` (a reaper pass completes the fill if
    this caller dies: `stalled_fills`, `refill_job`; the first call records the fill's id and mode in the
    job); a later call adds nothing to a job stopped meanwhile, nor does any call with `fill_id` (a fill
    taken up again under its recorded id), and a later call of a fill that another took over only adds.
    'create' adds later slices in 'add' mode.
    Returns the items added; Conflict if 'create' finds the job there.
    """
    keys = store.keys
    job_keys = [keys.ready(model_ref), keys.items, keys.queues, keys.job(job_id), keys.jobs, keys.job_done(job_id),
                keys.inflight(model_ref), keys.dead, keys.attempts, keys.jobs_filling, keys.job_counts,
                keys.queues_version, keys.job_cuts(job_id), *([keys.owner_jobs(tenant, owner)] if owner else []),
                *([keys.jobs_of_tenant(tenant)] if tenant else [])]
    step = 4 * job_slices.ENQUEUE_SLICE  # four arguments an item
    slices = [item_args[start:start + step] for start in range(0, len(item_args), step)] or [[]]
    continued = fill_id is not None
    fill_id = secrets.token_hex(6) if fill_id is None else fill_id
    added = 0
    for number, group in enumerate(slices):
        fill = job_slices.slice_call(number, len(slices), continued=continued)
        with translate_redis_errors():
            reply = int(store.scripts.enqueue_items(
                keys=job_keys,
                args=[model_ref, job_id, json.dumps({k: str(v) for k, v in fields.items()}) if number == 0 else "{}",
                      mode if number == 0 or mode == "resume" else "add", now, fill, time.time(), fill_id, *group],
            ))
        if reply == EnqueueReply.JOB_EXISTS:
            raise Conflict(f"job {job_id} already exists")
        if reply == EnqueueReply.JOB_STOPPED:  # stopped meanwhile: what was queued is (being) taken out by the stop
            break
        added += reply
    return added


def stalled_fills(store: Store, *, now: float) -> list[str]:
    """Jobs whose fill stopped part-way: their last enqueue call is `job_slices.FILL_STALLED_SECONDS` old (the API
    process queueing them died between two calls). `refill_job` completes each."""
    with translate_redis_errors():
        return list(store.client.zrangebyscore(store.keys.jobs_filling, "-inf", now - job_slices.FILL_STALLED_SECONDS))


def refill_job(store: Store, job_id: str, *, now: float, weights: Weights | None = None,
               ordering: Ordering = "dynamic") -> int:
    """Queue every chunk of a stalled fill that is not done, queued, leased or dead, as the fill its first
    call recorded (`fill_id`, `fill_mode`): a resume's also takes back at once the chunks of the earlier
    run that are leased or dead and that its calls had not reached yet (only those: the script keeps every
    call idempotent), any other adds ('add', also for a fill recorded before the mode was). Should another
    fill begin after this reads the job, these calls only add, leaving that fill's record to its caller or
    a later pass. A job stopped or gone meanwhile only leaves the filling index. Returns the items added."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.job(job_id))
    job = job_record(raw, now=now) if raw else None
    if job is None or job.status not in ACTIVE_STATUSES:
        with translate_redis_errors():
            store.client.zrem(store.keys.jobs_filling, job_id)
        return 0
    mode = "resume" if raw.get("fill_mode") == "resume" else "add"
    done = done_chunks(store, job_id)
    ranges = cuts.chunk_layout(store, job_id, rows_total=job.rows_total, chunk_size=job.chunk_size,
                               chunks_total=int(job.chunks_total))
    # a resume's first call scored its chunks as enqueued at the resume (`resume_job`)
    factors = job_factors(job.priority, (mode == "resume" and job.resumed_at) or job.created_at,
                          job.order_at, stored_priority_cap(raw.get("priority_cap")))
    item_args = _item_args(job_id, job.model_ref, ranges, [i for i in range(len(ranges)) if i not in done],
                           queue_key(factors, weights or Weights(), ordering), factors.to_dict(),
                           int(job.batch_size), job.tenant or "", job.owner or "", job.max_slots)
    return _enqueue(store, job_id, job.model_ref, {}, mode, now, item_args, fill_id=raw.get("fill_id") or "")
