"""Each worker process's reaper thread: the reaper pass never waits for a free stream slot.

The pass (`reap`: expired leases back to their queue, poison items failed, lost tickets
replaced, stalled job fills completed, the owner-index backfill) used to be a Celery beat task. It
ran on the worker's threads pool, whose threads are the stream slots, so while every stream of
every worker ran a long batch, a dead worker's expired leases waited for one of those batches to
end. So every worker process runs the pass on a thread of its own, started at `worker_ready` beside
the heartbeat, like the lease keeper's thread; its Redis commands go on a connection of its own
(`broker.state.store.Store` holds one per thread).

With several workers, one pass per `scheduler.reap_interval` is enough: a worker passes only while
it holds the turn (`workers.take_reaper_turn`), which it renews at each tick and which lasts
`TURN_INTERVALS` intervals, so another worker takes over once its holder has stopped ticking. The
turn only saves work: every step of the pass is idempotent (an expired lease is returned once, an
index entry added once, a job counted once), so a pass that outlasts its interval may run beside
the next, as two beat tasks could before. A worker does its first pass soon after it starts, at a
random point of its first interval (at most `FIRST_PASS_WITHIN_SECONDS` in), so that workers
started together do not all ask at once. A pass that fails (Redis away, or a bug) is logged and
tried again at the next interval: the thread never dies of it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from broker.errors import RunFailed, SitsError
from broker.failures import retries
from broker.failures.retry_policy import retry_delays
from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.jobs import progress as job_progress
from broker.jobs import retention as job_retention
from broker.jobs import stops as job_stops
from broker.online import requests
from broker.online import timeouts as request_timeouts
from broker.queueing import leases, policy, queues, reaping, tenant_index, tickets, workers
from broker.queueing.wakeup import SendTicket, wake_workers
from broker.sla import admission as deadline_admission
from broker.state.store import Store
from sits_worker.serving.context import WorkerContext

log = logging.getLogger(__name__)

TURN_INTERVALS = 2.5
"""How many intervals the turn lasts after its holder's last tick: a holder late by a GIL wait or a
long pass keeps it, and a dead or frozen one hands it over within about two intervals."""

FIRST_PASS_WITHIN_SECONDS = 1.0
"""A worker's first pass comes at a random point within this (or its interval, if shorter)."""

MIN_INTERVAL_SECONDS = 0.05
"""The shortest interval the thread ticks at (as `scheduler.reap_interval` allows)."""


class Reaper:
    """Runs `run_pass(now)` every `interval` seconds on a thread of its own, each time this worker
    (`holder`) takes the reaper turn."""

    def __init__(self, store: Store, holder: str, interval: float, run_pass: Callable[[float], object]) -> None:
        self._store, self._holder = store, holder
        self._interval = max(interval, MIN_INTERVAL_SECONDS)
        self._run_pass = run_pass
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, now: float) -> bool:
        """One pass unless another worker holds the turn; returns whether it ran. Errors
        (`ConnectionLost` when Redis is away) pass up to the caller."""
        if not workers.take_reaper_turn(self._store, self._holder, hold_seconds=TURN_INTERVALS * self._interval):
            return False
        self._run_pass(now)
        return True

    def start(self, first_delay: float | None = None) -> None:
        """Start the thread; its first pass comes after `first_delay` seconds (default: a random point
        of the first interval, at most `FIRST_PASS_WITHIN_SECONDS` in)."""
        if self.running:
            return
        if first_delay is None:
            first_delay = random.uniform(0.0, min(self._interval, FIRST_PASS_WITHIN_SECONDS))
        self._stop.clear()
        self._thread = threading.Thread(target=self._pass_forever, args=(first_delay,), name="sits-reaper",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread, waiting up to `timeout` seconds for a pass in progress to end; True once
        it has ended (a daemon thread: one still in a pass does not hold the process up)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    @property
    def running(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _pass_forever(self, first_delay: float) -> None:
        next_at = time.monotonic() + first_delay
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            try:
                self.run_once(time.time())
            except SitsError as err:  # Redis away: the next interval tries again
                log.warning("reaper pass failed, trying again in %.1f s: %s", self._interval, err)
            except Exception:  # a bug in one pass must not end recovery for the life of the worker
                log.exception("reaper pass failed, trying again in %.1f s", self._interval)
            # A pass that outlasted the interval is followed by the next at once, not by a burst.
            next_at = max(next_at + self._interval, time.monotonic())


def worker_reaper(ctx: WorkerContext, send: SendTicket, *, holder: str) -> Reaper:
    """The reaper of a worker process: the full pass (`reap`) over its context, every
    `scheduler.reap_interval`, under its name `holder`; `send` publishes a replacement ticket's task."""
    return Reaper(ctx.store, holder, ctx.settings.scheduler.reap_interval,
                  lambda now: reap(ctx, send, now=now))


def reap(ctx: WorkerContext, send: SendTicket, *, now: float) -> dict[str, int]:
    """One reaper pass: expired leases back to their queue (retries whose backoff passed, and lost
    leases, recorded as `worker_lost` on their job or request), poison items fail their job, requests past
    their timeout rejected or delayed, lost tickets replaced, older model versions' empty queues
    pruned, jobs ended more than `jobs.retention` ago forgotten, stalled job fills and stops completed, queued
    work stored before the queues' tenant indexes indexed a page at a time (run by `Reaper`, on a thread of its own)."""
    settings = ctx.settings
    lost_policy = settings.retry_policy("worker_lost")
    max_attempts = lost_policy.attempts or settings.jobs.max_attempts
    result = reaping.reap_expired_leases(ctx.store, now=now, max_attempts=max_attempts,
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
            item = leases.LeasedItem(item_id, model_ref, payload, max_attempts)
            error = f"the request failed {max_attempts} times (its workers died or errored)"
            failed = requests.RequestResult(item, error=error, code=RunFailed.code)
            requests.complete_requests(ctx.store, [failed], now=now, keep_seconds=settings.online.result_ttl,
                                       batch_size=1, worker="reaper")
            leases.finish_item(ctx.store, item, "", now=now)  # also leaves the dead set
            continue
        job_id = payload.get("job", "")
        last_error = job_progress.last_error(ctx.store, job_id) or "the worker died"
        error = f"{item_id} failed {max_attempts} times; last error: {last_error}"
        if job_id:
            job_stops.stop_job(ctx.store, job_id, status="failed", error=error, now=now, dead_item=item_id)
        else:
            item = leases.LeasedItem(item_id, model_ref, payload, max_attempts)
            leases.finish_item(ctx.store, item, job_id, now=now)
    # Lost tickets before the fills and stops below, which may take many calls (a stop of 100,000 chunks, 800).
    lost = tickets.expire_lost_tickets(ctx.store, now=now, ticket_timeout=settings.scheduler.ticket_timeout)
    job_lists.index_job_owners(ctx.store)  # jobs stored before the owner indexes, a page per pass
    job_lists.index_job_tenants(ctx.store)  # and before the tenant indexes
    job_lists.count_old_jobs(ctx.store)  # and before the per-status job counts
    tenant_index.index_waiting_items(ctx.store)  # waiting items queued before the queues' tenant indexes
    job_retention.forget_ended_jobs(ctx.store, now=now, retention=settings.jobs.retention)  # a page per pass
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
