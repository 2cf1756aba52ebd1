"""What a running job chunk does before each of its mini-batches.

A chunk holds its stream slot for many mini-batches, so between them it
keeps its lease alive and lets online work in (DESIGN.md, "Scheduling
concepts": an offline job yields between batches when urgent work waits, and
offline rows share batches with online requests):

- requests of the chunk's own model and shape bucket *ride along*: they join
  the next mini-batch, one `session.run` for the job's rows and theirs
  (`scheduler.merge_requests_into_jobs`);
- one batch of other online requests that outrank the chunk runs on this
  slot before the next mini-batch (a FIFO order never lets a later request
  pass the chunk), or of a tenant that ranks above the chunk's tenant in the
  fair-share order: it takes its share back here, not after the chunk;
- requests leased together with the chunk (a batch of requests that took a
  waiting chunk to fill its empty rows) ride in its first mini-batch.

Looking costs a Redis round trip, so a chunk looks only when the worker's request bell
(`request_bell.py`) counted an announcement since its last look, or `scheduler.yield_check_interval`
has passed without one (a quiet look: what a publish cannot tell). Looks that follow announcements come
at most every half of the smallest `preemption_target` of a tenant with a share
(`fair_share.FairShare.look_interval`; `yield_check_interval` without one): a stream of requests the
chunk cannot serve costs it a look per interval, not one per mini-batch. A quiet look does not count
against that interval, so a request announced just after one is looked at at the next boundary. The
chunk's lease saw what the bell had counted before it (the drain loop passes that count in; a tenant
fair share had taken for absent is leased first there), and it counts as a look after an announcement
unless a tenant's preemption target shortened the interval. Once a second the chunk also reads its job's
status: the chunk of a job cancelled (or failed) meanwhile stops there, as `Cancelled`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager

import numpy as np

from broker import job_stops, queues
from broker.errors import Cancelled, RetryableError
from broker.queues import LeasedItem, StaleTicket
from sits_worker.context import WorkerContext
from sits_worker.leasing import batch_cost, batch_need, feed_bucket, lease, lease_riders
from sits_worker.request_runs import give_back, run_requests

log = logging.getLogger(__name__)

STOP_CHECK_SECONDS = 1.0
"""How often a running chunk reads whether its job was stopped: a round trip a second costs nothing
measurable, and a cancelled job's chunk frees its slot within about this."""


class BetweenBatches:
    """Called by `execution.run_chunk` with each mini-batch's feed before it runs; returns the
    requests that ride in it."""

    def __init__(self, ctx: WorkerContext, item: LeasedItem, ticket: str,
                 carried: Sequence[LeasedItem] = (), reservation: int | None = None,
                 bell_mark: int | None = None) -> None:
        """`bell_mark` is the request bell's count read before `item` was leased (`RequestBell.count`;
        None: not known): the lease saw what was announced until then."""
        self._ctx, self._item, self._ticket, self._reservation = ctx, item, ticket, reservation
        self._lease_seconds = ctx.settings.scheduler.lease_timeout
        self._extended_at = time.monotonic()
        score = item.payload.get("score")
        self._chunk_score = float(score) if isinstance(score, int | float) else None
        self._interval = ctx.fair_share.look_interval(ctx.settings.scheduler.yield_check_interval)
        self._quiet_interval = ctx.settings.scheduler.yield_check_interval
        self._next_look = time.monotonic() + (self._interval if self._interval >= self._quiet_interval else 0.0)
        """The earliest a look after an announcement may come: the last such look plus the interval. The
        lease counts as one (a long `yield_check_interval` keeps a chunk on its slot), unless a tenant's
        preemption target shortened the interval: then a request announced after the lease is looked at
        at the next boundary."""
        self._looked_at = time.monotonic()
        self._bell_mark = bell_mark
        """The bell's count at the last look (the lease's, at first; None: not known, look)."""
        self._carried = list(carried)
        self._stale = False
        self._stop_checked_at = time.monotonic()

    def __call__(self, feed: Mapping[str, np.ndarray]) -> list[LeasedItem]:
        self.keep_alive()
        self._stop_if_job_stopped()
        if self._carried:
            if self._carried[0].payload.get("bucket") == feed_bucket(self._ctx, self._item.model_ref, feed)[0]:
                carried, self._carried = self._carried, []
                return carried
            # another shape: they run as their own batch, first (the chunk's lease held meanwhile)
            with self._ctx.lease_keeper.holding([self._item]):
                run_requests(self._ctx, self._carried, self._ticket)
            self._carried = []
        prompted = None if self._stale else self._look_prompted()
        if prompted is None:
            return []
        try:
            snapshot = self._ctx.queue_watcher.snapshot()
            # Urgent work first: if it fails, no rider has been leased yet to be stranded.
            with self._ctx.lease_keeper.holding([self._item]):  # an urgent batch may outlast the lease
                served = self._chunk_score is not None and _serve_one_urgent_batch(
                    self._ctx, snapshot, self._chunk_score, self._ticket, self._reservation,
                    str(self._item.payload.get("tenant") or ""))
            riders = []
            # (riders are online requests: none to look for when none waits in the chunk's queue)
            if self._ctx.settings.scheduler.merge_requests_into_jobs and (
                    served or snapshot.waiting_requests.get(self._item.model_ref, 0) > 0):
                riders = lease_riders(self._ctx, self._item.model_ref, feed, self._ticket)
        except StaleTicket:
            # This drain task's ticket was replaced (taken for lost): finish the chunk, which is still
            # ours, and let the next lease of the drain loop end the task.
            self._stale = True
            return []
        if served or riders:  # more may wait (and may have been announced already): the next look goes ahead
            self._next_look, self._bell_mark = 0.0, None
        elif prompted == "announced":
            self._next_look = time.monotonic() + self._interval
        return riders

    def _look_prompted(self) -> str | None:
        """Why this boundary looks: 'announced' (an online request was announced since the last look, or
        one waits unread on the bell's socket, or the bell cannot tell, and the interval since the last
        such look has passed), 'quiet'
        (`yield_check_interval` has passed without an announcement); None: no look now. Only an
        'announced' look holds the next one back by the interval."""
        now, bell = time.monotonic(), self._ctx.request_bell
        mark = bell.mark()
        announced = mark is None or mark != self._bell_mark
        if not announced and now >= self._next_look:
            announced = bell.unread()  # (a poll at each boundary: only where it could prompt a look)
        if announced:
            if now < self._next_look:
                return None
            prompted = "announced"
        elif now - self._looked_at >= self._quiet_interval:
            prompted = "quiet"
        else:
            return None
        self._bell_mark, self._looked_at = mark, now
        return prompted

    def _stop_if_job_stopped(self) -> None:
        """Raise `Cancelled` when the chunk's job was stopped since it was leased (looked at once a second)."""
        if time.monotonic() - self._stop_checked_at < STOP_CHECK_SECONDS:
            return
        self._stop_checked_at = time.monotonic()
        job_id = str(self._item.payload.get("job") or "")
        try:
            status = job_stops.stopped_status(self._ctx.store, job_id) if job_id else None
        except RetryableError as err:  # (a Redis blip: the chunk goes on, and looks again in a second)
            log.warning("could not read the status of job %s between mini-batches: %s", job_id, err)
            return
        if status is not None:
            raise Cancelled(f"job {job_id} was {status} while its chunk {self._item.item_id} ran; the chunk stopped "
                            "before its next mini-batch")

    def keep_alive(self) -> None:
        """Extend the item's lease (and touch the ticket) when a quarter of the lease has passed since
        the last extension; cheap otherwise, so long work without mini-batches (a job's finalize merge)
        calls it as often as it likes."""
        if time.monotonic() - self._extended_at >= self._lease_seconds / 4:
            self._extended_at = time.monotonic()
            queues.extend_lease(self._ctx.store, self._item, self._ticket, now=time.time(),
                                lease_seconds=self._lease_seconds)

    def running(self) -> AbstractContextManager[None]:
        """Hold the chunk's lease and the ticket in the worker's lease keeper while a mini-batch runs:
        one `session.run` longer than the lease (a large batch of a slow model on a CPU) would lose
        them mid-run, since `__call__` extends them only between mini-batches. Costs a lock and a
        dict entry; no Redis call unless the run passes a quarter of the lease."""
        return self._ctx.lease_keeper.holding([self._item], self._ticket)

    def finish(self) -> None:
        """Settle carried requests the chunk never reached (it was dropped, failed or had no rows): run
        them, or give them back to their queue if even that fails."""
        carried, self._carried = self._carried, []
        if not carried:
            return
        try:
            run_requests(self._ctx, carried, self._ticket)
        except Exception as err:
            give_back(self._ctx, carried, err)
            raise


def _serve_one_urgent_batch(ctx: WorkerContext, snapshot: queues.QueueSnapshot, chunk_score: float, ticket: str,
                            chunk_reservation: int | None, chunk_tenant: str = "") -> bool:
    """Run one batch of the best waiting online requests that outrank `chunk_score`, or of a tenant that
    ranks above the chunk's tenant in the fair-share order (it takes its share back at this boundary);
    False if none. `snapshot` is the queues as this look read them (a model none of whose waiting items
    is an online request is passed over without a lease).

    The batch runs instead of the chunk's next mini-batch, so it may use the chunk's reservation
    and the free memory (`MemoryLedger.room_in_place_of`): it is leased cut to that room (nothing
    is leased when its first request does not fit, so nothing is leased and returned every look),
    and reserved by its real need; should that no longer fit, it goes back to its queue unrun.
    """
    reclaim = ctx.fair_share.reclaim_option(chunk_tenant)
    for model_ref, score in sorted(snapshot.heads.items(), key=lambda head: head[1]):
        outranks = score < chunk_score
        if not outranks and reclaim is None:
            return False
        if not snapshot.waiting_requests.get(model_ref, 0):
            continue  # only online requests run here: none waits for this model
        room = ctx.ledger.room_in_place_of(chunk_reservation)
        cut = None if room is None else batch_cost(ctx, model_ref).within(model_ref, room, math.inf)
        if room is not None and cut is None:
            continue  # not one request of this model fits beside the others now
        leased = lease(ctx, model_ref, ticket, requests_only=True, admission=cut, within_cut=cut is not None,
                       tenants=None if outranks else reclaim)
        if not leased:
            continue
        handle = None
        try:
            need, seconds = batch_need(ctx, leased)
            with ctx.ledger.deciding:
                handle = ctx.ledger.reserve_in_place_of(chunk_reservation, need, now=time.time(),
                                                        expected_seconds=seconds)
            if handle is None:
                queues.return_unrun(ctx.store, leased)
                continue
            run_requests(ctx, leased, ticket)
            return True
        except BaseException:
            if handle is None:  # not run: back to the queue (a run that failed settled its own requests)
                queues.return_unrun(ctx.store, leased)
            raise
        finally:
            if handle is not None:
                ctx.ledger.release(handle, now=time.time())
    return False

