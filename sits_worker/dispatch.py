"""The drain loop behind a batch ticket, and the reaper pass behind the beat task.

A ticket is a circulating Celery task (DESIGN.md, "Dispatch"): it leases the
best waiting batch across models, runs it, and goes on until no queue has
work for `ticket_linger` (it waits on the doorbell meanwhile, then retires,
atomically with a last check) or its time slice is used (then it re-queues
itself so other Celery tasks get the thread).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from broker import jobs, policy, queues, requests, reservation
from broker.queues import StaleTicket
from broker.wakeup import SendTicket, wake_workers
from sits_worker.context import WorkerContext
from sits_worker.execution import process_item
from sits_worker.online import run_requests

log = logging.getLogger(__name__)

_DOORBELL_SLICE_SECONDS = 0.25
"""A lingering ticket looks at the queues at least this often, rung or not (a safety net: every
enqueue path rings the doorbell)."""


def drain(ctx: WorkerContext, ticket: str) -> str:
    """Serve batches under `ticket`; returns 'released', 'stale' or 'yield' (re-queue the ticket)."""
    settings = ctx.settings.scheduler
    slice_ends = time.monotonic() + settings.ticket_time_slice
    idle_since: float | None = None
    touched_at = float("-inf")  # when this loop last marked its ticket seen while lingering
    try:
        while True:
            heads = _heads_after_psa(ctx)
            if not heads:
                idle_since = time.monotonic() if idle_since is None else idle_since
                linger_left = settings.ticket_linger - (time.monotonic() - idle_since)
                if linger_left > 0:
                    touch = time.monotonic() - touched_at > settings.ticket_timeout / 4
                    touched_at = time.monotonic() if touch else touched_at
                    queues.wait_for_doorbell(ctx.store, ticket, now=time.time(), touch=touch,
                                             timeout=min(linger_left, _DOORBELL_SLICE_SECONDS))
                elif queues.release_ticket(ctx.store, ticket):
                    return "released"
                continue
            idle_since = None
            leased = []
            now = time.time()
            order = policy.model_order(heads, ctx.settings.scheduler.policy, ctx.last_served)
            allowed = reservation.admit(order, lambda ref: _batch_cost(ctx, ref), ctx.ledger, now=now,
                                        backfill=ctx.settings.scheduler.policy == "graph-aware-backfill")
            for admission in allowed:
                model_ref = admission.model
                batching = ctx.settings.online.batching_for(model_ref.partition("@")[0])
                if batching.max_queue_delay:
                    _wait_for_company(ctx, model_ref, batching.max_batch_size, batching.max_queue_delay)
                leased = _lease(ctx, model_ref, ticket, admission=admission)
                if leased:
                    ctx.last_served = model_ref
                    break
            if not leased:
                time.sleep(0.001)  # memory is reserved by running batches, or another slot took the work
            else:
                with _reserved(ctx, leased):
                    if leased[0].payload.get("kind") == "request":
                        run_requests(ctx, leased)
                    else:
                        for item in leased:
                            process_item(ctx, item, _between_batches(ctx, item, ticket))
            if time.monotonic() >= slice_ends:
                return "yield"
    except StaleTicket:
        return "stale"


def _lease(ctx: WorkerContext, model_ref: str, ticket: str, *, requests_only: bool = False,
           admission: reservation.Admission | None = None) -> list[queues.LeasedItem]:
    """Lease `model_ref`'s best batch under its batching settings (one job chunk at a time), cut to
    the rows and tokens of its `admission` when given."""
    batching = ctx.settings.online.batching_for(model_ref.partition("@")[0])
    max_rows = admission.max_rows if admission else batching.max_batch_size
    max_tokens = admission.max_tokens if admission else batching.max_batch_tokens
    return queues.lease_batch(ctx.store, model_ref, now=time.time(), lease_seconds=ctx.settings.scheduler.lease_timeout,
                              max_items=batching.max_batch_size, max_rows=max_rows, max_tokens=max_tokens,
                              max_chunks=1, ticket=ticket, requests_only=requests_only)


def _between_batches(ctx: WorkerContext, item: queues.LeasedItem, ticket: str) -> Callable[[], None]:
    """What a job's chunk calls between its mini-batches: keep its lease alive, and let urgent online
    work through.

    At most every `scheduler.yield_check_interval`, the queue heads are read; if an online request
    waits that the order would serve before this chunk (its score beats the chunk's), one batch of
    such requests runs right here, on this stream slot, before the chunk's next mini-batch. So an
    offline job yields between batches without giving its chunk back, and a request never waits
    for a whole chunk (a FIFO order never lets a later request pass the chunk).
    """
    keep_alive = _keep_alive(ctx, item, ticket, ctx.settings.scheduler.lease_timeout)
    chunk_score = item.payload.get("score")
    interval = ctx.settings.scheduler.yield_check_interval
    next_look = time.monotonic() + interval

    def between() -> None:
        nonlocal next_look
        keep_alive()
        if not isinstance(chunk_score, int | float) or time.monotonic() < next_look:
            return
        served = _serve_one_urgent_batch(ctx, float(chunk_score), ticket)
        next_look = time.monotonic() if served else time.monotonic() + interval  # look again next time

    return between


def _serve_one_urgent_batch(ctx: WorkerContext, chunk_score: float, ticket: str) -> bool:
    """Run one batch of the best waiting online requests that outrank `chunk_score`; False if none."""
    heads = ctx.queue_watcher.snapshot().heads
    for model_ref, score in sorted(heads.items(), key=lambda head: head[1]):
        if score >= chunk_score:
            return False
        leased = _lease(ctx, model_ref, ticket, requests_only=True)
        if leased:
            with _reserved(ctx, leased):
                run_requests(ctx, leased)
            return True
    return False


def _batch_cost(ctx: WorkerContext, model_ref: str) -> reservation.BatchCost:
    """What a batch of `model_ref` costs by its profile, within its batching limits."""
    batching = ctx.settings.online.batching_for(model_ref.partition("@")[0])
    return reservation.BatchCost.of(ctx.model(model_ref), max_rows=batching.max_batch_size,
                                    max_tokens=batching.max_batch_tokens)


@contextlib.contextmanager
def _reserved(ctx: WorkerContext, leased: list[queues.LeasedItem]) -> Iterator[None]:
    """Hold the batch's memory reservation (by its real rows and tokens) while it runs."""
    cost = _batch_cost(ctx, leased[0].model_ref)
    rows = sum(int(item.payload.get("rows") or ctx.settings.jobs.batch_size) for item in leased)
    # The worker pads token requests to their length class: the padded tokens are what runs.
    tokens = sum(int(item.payload.get("padded_tokens") or item.payload.get("tokens") or 0) for item in leased) or None
    handle = ctx.ledger.reserve(cost.need_bytes(rows=rows, tokens=tokens), now=time.time(),
                                expected_seconds=cost.seconds(rows=rows, tokens=tokens))
    try:
        yield
    finally:
        ctx.ledger.release(handle, now=time.time())


def _wait_for_company(ctx: WorkerContext, model_ref: str, max_batch_size: int, max_queue_delay: float) -> None:
    """Triton's max_queue_delay: let a short queue of requests grow until its head has waited that long."""
    while True:
        waiting = queues.head_wait(ctx.store, model_ref, now=time.time())
        if waiting is None or waiting[0] >= max_batch_size or waiting[1] >= max_queue_delay:
            return
        time.sleep(min(max_queue_delay - waiting[1], 0.001))


def _heads_after_psa(ctx: WorkerContext) -> dict[str, float]:
    """The queue heads to choose the next batch from, after PSA jumps of items near their deadline."""
    snapshot = ctx.queue_watcher.snapshot()
    if not snapshot.earliest_deadlines:
        return snapshot.heads
    jumped = policy.psa_pass(
        ctx.store, snapshot,
        lambda ref: ctx.settings.online.batching_for(ref.partition("@")[0]).queue_capacity,
        default=policy.default_ordering(ctx.settings.scheduler.policy), now=time.time())
    return ctx.queue_watcher.snapshot().heads if jumped else snapshot.heads


def _keep_alive(ctx: WorkerContext, item: queues.LeasedItem, ticket: str, lease_seconds: float) -> Callable[[], None]:
    """A callback, called between mini-batches, that extends the item's lease and touches the ticket."""
    last = time.monotonic()

    def keep_alive() -> None:
        nonlocal last
        if time.monotonic() - last >= lease_seconds / 4:
            last = time.monotonic()
            queues.extend_lease(ctx.store, item, ticket, now=time.time(), lease_seconds=lease_seconds)

    return keep_alive


def reap(ctx: WorkerContext, send: SendTicket, *, now: float) -> dict[str, int]:
    """One reaper pass: expired leases back to their queue, poison items fail their job, lost tickets replaced."""
    settings = ctx.settings
    result = queues.reap_expired_leases(ctx.store, now=now, max_attempts=settings.jobs.max_attempts)
    for model_ref, item_id, payload in result.dead_items:
        if payload.get("kind") == "request":
            item = queues.LeasedItem(item_id, model_ref, payload, settings.jobs.max_attempts)
            error = f"the request failed {settings.jobs.max_attempts} times (its workers died or errored)"
            requests.complete_requests(ctx.store, [requests.RequestResult(item, error=error)], now=now,
                                       keep_seconds=settings.online.result_ttl, batch_size=1, worker="reaper")
            queues.finish_item(ctx.store, item, "", now=now)  # also leaves the dead set
            continue
        job_id = payload.get("job", "")
        last_error = jobs.last_error(ctx.store, job_id) or "the worker died"
        error = f"{item_id} failed {settings.jobs.max_attempts} times; last error: {last_error}"
        if job_id:
            jobs.stop_job(ctx.store, job_id, status="failed", error=error, now=now, dead_item=item_id)
        else:
            item = queues.LeasedItem(item_id, model_ref, payload, settings.jobs.max_attempts)
            queues.finish_item(ctx.store, item, job_id, now=now)
    lost = queues.expire_lost_tickets(ctx.store, now=now, ticket_timeout=settings.scheduler.ticket_timeout)
    sent = 0
    if queues.queue_heads(ctx.store):
        sent = wake_workers(ctx.store, send, now=now, heartbeat_timeout=settings.scheduler.worker_heartbeat_timeout)
    if result.returned or result.dead_items or lost:
        log.info("reaper: %d leases returned, %d items dead, %d tickets lost, %d sent",
                 result.returned, len(result.dead_items), lost, sent)
    return {"returned": result.returned, "dead": len(result.dead_items), "tickets_lost": lost, "tickets_sent": sent}
