"""The drain loop behind a batch ticket, and the reaper pass each worker's reaper thread runs.

A ticket is a circulating Celery task (DESIGN.md, "Dispatch"): it leases the
best waiting batch across models, runs it, and goes on until no queue has
work for `ticket_linger` and its process has no chunk commit pending (it
waits on the doorbell meanwhile, then retires, atomically with a last check)
or its time slice is used (then it re-queues itself so other Celery tasks
get the thread).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from broker.errors import RunFailed
from broker.failures import retries
from broker.failures.retry_policy import retry_delays
from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.memory import reservation
from broker.online import requests
from broker.online import timeouts as request_timeouts
from broker.queueing import policy, queues
from broker.queueing.queues import StaleTicket
from broker.queueing.wakeup import SendTicket, wake_workers
from broker.sla import admission as deadline_admission
from broker.state.store import Store
from sits_worker.between_minibatches import BetweenBatches
from sits_worker.context import WorkerContext
from sits_worker.execution import process_item
from sits_worker.leasing import admitted, batch_cost, lease
from sits_worker.request_runs import run_requests

log = logging.getLogger(__name__)

_DOORBELL_SLICE_SECONDS = 0.25
"""A lingering ticket looks at the queues at least this often, rung or not (a safety net: every
enqueue path rings the doorbell)."""


COMPANY_POLL_SECONDS = 0.001
"""How often a head request's batch is looked at again while it waits for company (`max_queue_delay`)."""

HELD_POLL_SECONDS = 0.01
"""How often a slot looks again while a tenant is held back (its usage decays by the milliseconds)."""

PAUSED_POLL_SECONDS = 0.1
"""How long a slot that found only paused work (a degraded worker's P2) waits for an enqueue to ring
before it looks again: new work wakes it at once, and a step back is seen within this."""

PASS_ON_SECONDS = 1.0
"""How often at most a paused slot passes on a ring it was woken by and could not use (only paused work
again): the enqueue meant it for a slot that may serve it, a calm worker's, which waits on the same list."""


def drain(ctx: WorkerContext, ticket: str) -> str:
    """Serve batches under `ticket`; returns 'released', 'stale' or 'yield' (re-queue the ticket)."""
    settings = ctx.settings.scheduler
    slice_ends = time.monotonic() + settings.ticket_time_slice
    idle_since: float | None = None
    touched_at = float("-inf")  # when this loop last marked its ticket seen while lingering
    paused_ring = PausedRing()
    try:
        while True:
            # (before the snapshot: a request announced after it is the chunk leased below's to look for; one
            # before is in the snapshot, and where the snapshot holds none the lease passed none over, on this
            # model or another: only then does the chunk start from this count)
            bell_mark = ctx.request_bell.count()
            looked = _snapshot_after_psa(ctx)
            snapshot = _without_open_breakers(ctx, looked)
            heads = snapshot.heads
            if not heads:
                idle_since = time.monotonic() if idle_since is None else idle_since
                linger_left = settings.ticket_linger - (time.monotonic() - idle_since)
                # Pending commits may still queue work (a job's last ack queues its finalize step)
                # without topping tickets up: the ticket stays until they are done. So does work this
                # worker's open breakers bar (the queues hold it, so the ticket cannot be released):
                # the slot waits on the doorbell, not on a loop of looks, until a breaker half-opens.
                barred_only = bool(looked.heads)
                if linger_left > 0 or ctx.commits.pending() or barred_only:
                    touch = time.monotonic() - touched_at > settings.ticket_timeout / 4
                    touched_at = time.monotonic() if touch else touched_at
                    queues.wait_for_doorbell(ctx.store, ticket, now=time.time(), touch=touch,
                                             timeout=min(linger_left, _DOORBELL_SLICE_SECONDS)
                                             if linger_left > 0 else _DOORBELL_SLICE_SECONDS)
                    if barred_only and time.monotonic() >= slice_ends:
                        return "yield"
                elif queues.release_ticket(ctx.store, ticket):
                    return "released"
                elif time.monotonic() >= slice_ends:  # (work came in since the snapshot: look again, within
                    return "yield"  # the slice, so that no state this loop misreads can hold it for ever)
                continue
            idle_since = None
            # A slot that outpaces the disk leases no chunk until a commit is done (requests go on).
            room = ctx.commits.has_room()
            leased: list[queues.LeasedItem] = []
            now = time.time()
            order = policy.model_order(heads, ctx.settings.scheduler.policy, ctx.last_served)
            allowed, hold = reservation.admit_and_hold(
                order, lambda ref: batch_cost(ctx, ref), ctx.ledger, now=now,
                backfill=ctx.settings.scheduler.policy == "graph-aware-backfill", head_items=snapshot.head_items)
            notes = queues.LeaseNotes()
            try:
                leased, admission = _lease_admitted(ctx, allowed, ticket, requests_only=not room, notes=notes,
                                                    waiting_requests=snapshot.waiting_requests)
            finally:
                if hold is not None and not leased:  # nothing to run (or the lease failed): free the hold
                    ctx.ledger.release(hold, now=time.time())
            if leased or room:  # (a slot without commit room that leases nothing waits for the disk)
                reservation.count_lease(ctx.ledger, allowed, admission if leased else None)
            ran = False
            if leased and admission is not None:
                with admitted(ctx, leased, admission, hold=hold) as runnable:
                    if runnable.items:
                        _run_leased(ctx, runnable.items, ticket, runnable.handle,
                                    bell_mark if not any(snapshot.waiting_requests.values()) else None)
                        ran = True
            if not ran and not room and all(map(jobs.is_chunk_item_id, snapshot.head_items.values())):
                _wait_for_room(ctx, bell_mark)  # only chunks wait: wait for the disk, or a request
            elif not ran and notes.paused:  # every lease found only paused work: wait for new work
                paused_ring.wait(ctx.store, ticket)
            elif not ran:  # memory is reserved by running batches, another slot took the work, or the
                # waiting work is a held tenant's (past its limit: it waits for its usage to decay); a
                # degraded worker's leases weigh a long window: it looks again less often
                degraded = bool(allowed) and ctx.memory_watch.lease_classes() is not None
                time.sleep(HELD_POLL_SECONDS if ctx.fair_share.holding or degraded else 0.001)
            if not notes.paused or ran:
                paused_ring.woken = False
            if time.monotonic() >= slice_ends:
                return "yield"
    except StaleTicket:
        return "stale"


class PausedRing:
    """A paused slot's waits on the doorbell, and the rings it passes on.

    An enqueue rings once for one idle slot. A degraded worker's slot that takes the ring and finds only
    paused work again would keep it from a calm worker's slot that could serve it, so it rings again for
    the next waiter (Redis serves blocked pops in the order they blocked), at most once every
    `PASS_ON_SECONDS`: where every worker is degraded, the rings go round slowly and stop."""

    def __init__(self) -> None:
        self.woken = False  # the last wait ended by a ring, and no lease since ran anything
        self._passed_at = float("-inf")

    def wait(self, store: Store, ticket: str) -> None:
        """Wait up to `PAUSED_POLL_SECONDS` for a ring, first passing on the one the last wait took."""
        if self.woken and time.monotonic() - self._passed_at >= PASS_ON_SECONDS:
            self._passed_at = time.monotonic()
            queues.ring_doorbell(store)
        self.woken = queues.wait_for_doorbell(store, ticket, now=time.time(), timeout=PAUSED_POLL_SECONDS,
                                              touch=False)


def _lease_admitted(ctx: WorkerContext, allowed: list[reservation.Admission], ticket: str, *,
                    requests_only: bool = False, notes: queues.LeaseNotes,
                    waiting_requests: Mapping[str, int] | None = None,
                    ) -> tuple[list[queues.LeasedItem], reservation.Admission | None]:
    """Lease the first admitted model's batch that has work, with its admission; ([], None) when none
    has any now (with `requests_only`: none headed by an online request). `notes.paused` ends true only
    when every lease found nothing but paused work. Where online requests wait (`waiting_requests`, by
    model, as the snapshot counted them), those of a tenant returning after fair share took it for absent
    are looked for first (`FairShare.returning_option`)."""
    waited: set[str] = set()  # (a whole admission and a backfill behind it may name one model)
    paused = bool(allowed)
    for admission in allowed:
        model_ref = admission.model
        if model_ref not in waited and ctx.memory_watch.lease_classes() is None:
            _wait_for_company(ctx, model_ref)  # (a degraded worker ranks by class: the queue's head may not lead)
            waited.add(model_ref)
        returning = ctx.fair_share.returning_option(model_ref) if (waiting_requests or {}).get(model_ref) else None
        if returning is not None:
            leased = lease(ctx, model_ref, ticket, admission=admission, within_cut=admission.cut, requests_only=True,
                           tenants=returning)
            if leased:
                ctx.last_served = model_ref
                return leased, admission
            ctx.fair_share.note_returning_missed(model_ref)
        # A batch cut to free memory (a backfill, or beside the head) takes no chunk along and no
        # item that does not fit the cut: it must fit the hole and end in time.
        carry = ctx.settings.scheduler.merge_requests_into_jobs and not admission.cut
        said = queues.LeaseNotes()
        leased = lease(ctx, model_ref, ticket, admission=admission, carry_chunk=carry, within_cut=admission.cut,
                       requests_only=requests_only, notes=said)
        if leased:
            ctx.last_served = model_ref
            return leased, admission
        paused = paused and said.paused
    notes.paused = paused
    return [], None


def _run_leased(ctx: WorkerContext, leased: list[queues.LeasedItem], ticket: str, reservation: int | None,
                bell_mark: int | None = None) -> None:
    """Run what one lease returned, under its memory `reservation`: a batch of requests, a job chunk
    or finalize step, or requests with a chunk they took along (they ride in its first mini-batch).
    `bell_mark`: the request bell's count before the lease (`BetweenBatches`)."""
    online = [item for item in leased if item.payload.get("kind") == "request"]
    offline = [item for item in leased if item.payload.get("kind") != "request"]
    if not offline:
        run_requests(ctx, online, ticket)
        return
    [item] = offline  # leases take one job chunk (or finalize step) at a time
    between = BetweenBatches(ctx, item, ticket, carried=online, reservation=reservation, bell_mark=bell_mark)
    try:
        process_item(ctx, item, between)
    finally:
        between.finish()


COMMIT_WAIT_SECONDS = 0.05
"""The longest a slot without commit room waits for it before it looks at the queues again."""
MIN_ROOM_STEP_SECONDS = 0.001
"""The shortest step between two looks at the bell while waiting for commit room (a 0 look interval
would spin)."""


def _wait_for_room(ctx: WorkerContext, bell_mark: int | None) -> None:
    """Wait up to `COMMIT_WAIT_SECONDS` for room to queue a chunk's commit, but only until an online request
    is announced since `bell_mark` (the request bell's count before this loop's snapshot): a slot waiting
    for the disk serves requests, and a returning tenant's request must not wait for another tenant's
    fsync. The bell is looked at every half look interval (`FairShare.look_interval`); without a count
    (the bell not listening) the wait is the whole time, as a look would be."""
    ends = time.monotonic() + COMMIT_WAIT_SECONDS
    step = max(MIN_ROOM_STEP_SECONDS, ctx.fair_share.look_interval(ctx.settings.scheduler.yield_check_interval) / 2)
    while (left := ends - time.monotonic()) > 0:
        if ctx.commits.wait_for_room(timeout=min(left, step) if bell_mark is not None else left):
            return
        if bell_mark is not None and (ctx.request_bell.count() != bell_mark or ctx.request_bell.unread()):
            return


def _wait_for_company(ctx: WorkerContext, model_ref: str) -> None:
    """Triton's dynamic batcher: let the head request's batch grow until it has the rows of a full
    or a preferred batch, or the head has waited `max_queue_delay` (the lease then cuts it to the
    largest preferred size it reaches). Without a delay it costs no round trip."""
    batching = ctx.batching(model_ref)
    if not batching.max_queue_delay:
        return
    window = 2 * batching.max_batch_size  # as far as lease_batch.lua looks for the batch
    while True:
        company = queues.head_company(ctx.store, model_ref, now=time.time(), window=window,
                                      enough=batching.enough_rows)
        if company is None or batching.wait_over(*company):  # (None: a job chunk heads, or nothing waits)
            return
        left = batching.max_queue_delay - company[1]
        if left <= COMPANY_POLL_SECONDS:
            time.sleep(left)  # the delay is up after it: no look is needed to know that
            return
        time.sleep(COMPANY_POLL_SECONDS)


def _without_open_breakers(ctx: WorkerContext, snapshot: queues.QueueSnapshot) -> queues.QueueSnapshot:
    """The snapshot without the models whose breaker on this worker bars a lease now (`broker/failures/breaker.py`):
    to this worker their queues look empty, so its slots wait on the doorbell instead of spinning on
    work only other workers may take (or this one, once the breaker half-opens)."""
    now = time.time()
    barred = [ref for ref in snapshot.heads if not ctx.breakers.may_lease(ref, now=now)]
    if not barred:
        return snapshot
    heads = {ref: score for ref, score in snapshot.heads.items() if ref not in barred}
    head_items = {ref: item for ref, item in snapshot.head_items.items() if ref not in barred}
    return dataclasses.replace(snapshot, heads=heads, head_items=head_items)


def _snapshot_after_psa(ctx: WorkerContext) -> queues.QueueSnapshot:
    """The queue heads to choose the next batch from, after PSA jumps of items near their deadline."""
    snapshot = ctx.queue_watcher.snapshot()
    if not snapshot.earliest_deadlines:
        return snapshot
    jumped = policy.psa_pass(
        ctx.store, snapshot,
        lambda ref: ctx.settings.online.batching_for(ref.partition("@")[0]).queue_capacity,
        default=policy.default_ordering(ctx.settings.scheduler.policy), now=time.time())
    return ctx.queue_watcher.snapshot() if jumped else snapshot


def reap(ctx: WorkerContext, send: SendTicket, *, now: float) -> dict[str, int]:
    """One reaper pass: expired leases back to their queue (retries whose backoff passed, and lost
    leases, recorded as `worker_lost` on their job or request), poison items fail their job, requests past
    their timeout rejected or delayed, lost tickets replaced, older model versions' empty queues
    pruned, stalled job fills and stops completed (run by `reaper.Reaper`, on a thread of its own)."""
    settings = ctx.settings
    lost_policy = settings.retry_policy("worker_lost")
    max_attempts = lost_policy.attempts or settings.jobs.max_attempts
    result = queues.reap_expired_leases(ctx.store, now=now, max_attempts=max_attempts,
                                        lost_delays=retry_delays(lost_policy, ctx.jitter.random))
    lost_error = "its lease expired: the worker running it died, froze or lost Redis"
    if result.lost:
        retries.note_lost(ctx.store, result.lost, now=now, error=lost_error)
    if result.dead_items:
        retries.note_lost(ctx.store, [(ref, item_id, payload, None) for ref, item_id, payload in result.dead_items],
                          now=now, error=lost_error, retried=False)
    weights, ordering = policy.get_policy(ctx.store, default=policy.default_ordering(settings.scheduler.policy))
    timed_out = request_timeouts.expire_all(ctx.store, now=now, weights=weights, ordering=ordering,
                                            keep_seconds=settings.online.result_ttl)
    for model_ref, item_id, payload in result.dead_items:
        if payload.get("kind") == "request":
            item = queues.LeasedItem(item_id, model_ref, payload, max_attempts)
            error = f"the request failed {max_attempts} times (its workers died or errored)"
            failed = requests.RequestResult(item, error=error, code=RunFailed.code)
            requests.complete_requests(ctx.store, [failed], now=now, keep_seconds=settings.online.result_ttl,
                                       batch_size=1, worker="reaper")
            queues.finish_item(ctx.store, item, "", now=now)  # also leaves the dead set
            continue
        job_id = payload.get("job", "")
        last_error = job_progress.last_error(ctx.store, job_id) or "the worker died"
        error = f"{item_id} failed {max_attempts} times; last error: {last_error}"
        if job_id:
            job_stops.stop_job(ctx.store, job_id, status="failed", error=error, now=now, dead_item=item_id)
        else:
            item = queues.LeasedItem(item_id, model_ref, payload, max_attempts)
            queues.finish_item(ctx.store, item, job_id, now=now)
    # Lost tickets before the fills and stops below, which may take many calls (a stop of 100,000 chunks, 800).
    lost = queues.expire_lost_tickets(ctx.store, now=now, ticket_timeout=settings.scheduler.ticket_timeout)
    job_lists.index_job_owners(ctx.store)  # jobs stored before the owner indexes, a page per pass
    job_lists.count_old_jobs(ctx.store)  # and before the per-status job counts
    queues.prune_old_queues(ctx.store)  # older model versions' drained queues, read before every batch choice
    deadline_admission.reaper_pass(settings, ctx.store, now=now)  # deadline jobs' risks; ended jobs out of the index
    stalled = job_fills.stalled_fills(ctx.store, now=now)
    if stalled:
        for job_id in stalled:
            log.warning("job %s: its items stopped being queued part-way (%d more queued now)", job_id,
                        job_fills.refill_job(ctx.store, job_id, now=now, weights=weights, ordering=ordering))
    for job_id in job_stops.stalled_stops(ctx.store, now=now):
        log.warning("job %s: its stop was cut short part-way; the reaper took up its calls (%s)", job_id,
                    job_stops.finish_stop(ctx.store, job_id, now=now))
    sent = 0
    if queues.queue_heads(ctx.store):  # (after the fills: what they queued needs tickets too)
        sent = wake_workers(ctx.store, send, now=now, heartbeat_timeout=settings.scheduler.worker_heartbeat_timeout)
    if result.returned or result.dead_items or lost or timed_out.rejected or timed_out.delayed:
        log.info("reaper: %d leases returned, %d items dead, %d requests timed out (%d delayed), %d tickets "
                 "lost, %d sent", result.returned, len(result.dead_items), len(timed_out.rejected),
                 len(timed_out.delayed), lost, sent)
    return {"returned": result.returned, "dead": len(result.dead_items), "tickets_lost": lost, "tickets_sent": sent,
            "timed_out": len(timed_out.rejected), "delayed": len(timed_out.delayed)}
