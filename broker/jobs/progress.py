"""A job's progress as workers run it: an item started, a chunk acknowledged, the last attempt's error.

The job's `done` set holds the indexes of the chunks whose part files are written and acknowledged
(`ack_chunk`, idempotent): it is the checkpoint a resume reads (`done_chunks`), and `forget_chunks`
takes out chunks whose parts were lost, so that the resume runs them again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from broker.jobs import cuts
from broker.jobs import slices as job_slices
from broker.jobs.records import finalize_item_id, finalize_payload, get_job
from broker.queueing.leases import LeasedItem
from broker.state.replies import AckReply
from broker.state.store import Store, translate_redis_errors
from broker.tracing import spans


def start_item(store: Store, job_id: str, *, now: float, chunk: bool = False) -> str:
    """Mark the job running as a worker begins one of its items; returns its status after that.

    Anything but 'running' ('cancelled', 'failed', 'succeeded', or '' for a job that is gone)
    means the item must be dropped unrun. With `chunk` (a chunk's run begins), a running job's
    `chunk_started_at` becomes `now`: deadline admission reckons from it how long the job's running
    chunks still hold their slots (`admission.blocking`).
    """
    with translate_redis_errors():
        return str(store.scripts.start_item(keys=[store.keys.job(job_id), store.keys.job_counts],
                                            args=[now, "chunk" if chunk else ""]))


@spans.traced("sits.ack", lambda store, item, **_: {"sits.item_id": item.item_id, "sits.model_ref": item.model_ref})
def ack_chunk(store: Store, item: LeasedItem, *, now: float, worker: str, run_seconds: float = 0.0,
              beside: Mapping[str, float] | None = None) -> AckReply:
    """Record a chunk whose part files are written: drop its lease, checkpoint it, count `worker`, add
    `run_seconds` (how long its stream slot ran it) to the job's `busy_seconds` and to its model's chunk time
    histogram (`broker.monitoring.sla_metrics`), and its seconds `beside`
    each neighbour model version on the worker's other slots (or `alone`) to its `slot_mix`.

    Returns `SKIPPED` for a duplicate (or a job no longer active), `RECORDED`, or `LAST_CHUNK` when it
    was the job's last chunk and the finalize item was queued (and the doorbell rung, so a lingering drain
    task leases it at once). Idempotent: a re-run is counted once.
    """
    payload = item.payload
    job_id = payload["job"]
    keys = store.keys
    finalize = json.dumps({**finalize_payload(job_id, item.model_ref, payload["score"], payload.get("factors"),
                                              payload.get("tenant") or ""),
                           **spans.carried(payload)})  # (the job's trace goes on in its finalize step)
    with translate_redis_errors():
        reply = store.scripts.ack_chunk(
            keys=[keys.inflight(item.model_ref), keys.ready(item.model_ref), keys.items, keys.attempts,
                  keys.job(job_id), keys.job_done(job_id), keys.doorbell, keys.job_counts, keys.counters,
                  keys.queues, keys.queues_version, keys.latency_buckets],
            args=[item.item_id, payload["chunk"], payload["stop"] - payload["start"], now,
                  finalize_item_id(job_id), payload["score"], finalize, worker, item.model_ref,
                  repr(max(0.0, float(run_seconds))),
                  json.dumps({neighbour: round(seconds, 6) for neighbour, seconds in (beside or {}).items()
                              if seconds > 0})],
        )
    return AckReply(int(reply))


def last_error(store: Store, job_id: str) -> str | None:
    """The error of the job's latest failed attempt, if any (`broker/failures/retries.py` records it with each
    failure's class)."""
    with translate_redis_errors():
        return store.client.hget(store.keys.job(job_id), "last_error")


def done_chunks(store: Store, job_id: str) -> set[int]:
    """Indexes of the job's chunks whose parts are written and acknowledged."""
    with translate_redis_errors():
        return {int(index) for index in store.client.smembers(store.keys.job_done(job_id))}


def forget_chunks(store: Store, job_id: str, indexes: Sequence[int]) -> int:
    """Count chunks of a stopped job as not done (their parts were lost), so that a resume runs them
    again; a job not stopped is left alone. Returns how many were forgotten."""
    job = get_job(store, job_id, now=0.0)
    ranges = cuts.chunk_layout(store, job_id, rows_total=job.rows_total, chunk_size=job.chunk_size,
                               chunks_total=int(job.chunks_total))
    forgotten = 0
    for start in range(0, len(indexes), job_slices.ENQUEUE_SLICE):
        args = [value for index in indexes[start:start + job_slices.ENQUEUE_SLICE]
                for value in (index, ranges[index][1] - ranges[index][0])]
        with translate_redis_errors():
            forgotten += int(store.scripts.forget_chunks(keys=[store.keys.job(job_id), store.keys.job_done(job_id)],
                                                         args=args))
    return forgotten
