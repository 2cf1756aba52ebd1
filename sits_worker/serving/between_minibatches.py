"""What a running job chunk does before each of its mini-batches.

A chunk holds its stream slot for many mini-batches, so between them it
keeps its lease alive and lets online work in (docs/scheduling.md, "Jobs
and online requests together": an offline job yields between batches when urgent work waits, and
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

The look need not wait for the boundary. While a mini-batch runs, the bell's thread takes it after an
announcement (`RequestBell.calling`): the snapshot and the urgent batch's lease overlap the mini-batch,
and the batch runs as soon as it ends (about 0.7 ms less wait, measured on a 2-core host). That early
look leases only when no slot of the fleet could take the request sooner: the snapshot found the
doorbell's rings untaken (an idle drain loop blocked on it would have taken them), and this mini-batch
should end within the look interval (as long as the last one ran). So a request it takes waits for a
device at most that interval longer than it might have elsewhere. Riders wait for the boundary, which
knows the next mini-batch's shape.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from broker.errors import Cancelled, RetryableError
from broker.jobs import stops as job_stops
from broker.queueing import leases, queues
from broker.queueing.leases import LeasedItem, StaleTicket
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.leasing import batch_cost, batch_need, feed_bucket, lease, lease_riders
from sits_worker.serving.request_runs import give_back, run_requests

log = logging.getLogger(__name__)

STOP_CHECK_SECONDS = 1.0
"""How often a running chunk reads whether its job was stopped: a round trip a second costs nothing
measurable, and a cancelled job's chunk frees its slot within about this."""


@dataclass
class _EarlyLook:
    """A look the bell's thread took while a mini-batch ran, for the next boundary to act on."""

    mark: int | None
    """The bell's count it looked after."""
    at: float
    """`time.monotonic()` when it looked."""
    snapshot: queues.QueueSnapshot
    leased: list[LeasedItem]
    """The urgent batch it leased (empty: none waits that outranks the chunk)."""
    held: contextlib.ExitStack
    """Keeps the batch's leases alive in the lease keeper until it runs."""


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
        self._tenant = str(item.payload.get("tenant") or "")
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
        self._early_lock = threading.Lock()
        """Held by an early look while it runs: the boundary waits for it, and takes its result."""
        self._early: _EarlyLook | None = None
        self._running_since: float | None = None
        """`time.monotonic()` when the running mini-batch started; None between mini-batches."""
        self._early_tried: float | None = None
        """The `_running_since` of the mini-batch an early look was last tried in (one try a mini-batch)."""
        self._minibatch_seconds: float | None = None
        """How long the last mini-batch ran (None before the first ended)."""

    def __call__(self, feed: Mapping[str, np.ndarray]) -> list[LeasedItem]:
        self.keep_alive()
        self._stop_if_job_stopped()
        if self._carried:
            if self._carried[0].payload.get("bucket") == feed_bucket(self._ctx, self._item.model_ref, feed)[0]:
                carried, self._carried = self._carried, []
                return carried
            # another shape: they run as their own batch, first (the chunk's lease held meanwhile); if that
            # fails they are given back here, not run again by `finish`
            carried, self._carried = self._carried, []
            try:
                with self._ctx.lease_keeper.holding([self._item]):
                    run_requests(self._ctx, carried, self._ticket)
            except Exception as err:
                give_back(self._ctx, carried, err)
                raise
        early = self._take_early()
        prompted = "announced" if early is not None else None if self._stale else self._look_prompted()
        if prompted is None:
            return []
        try:
            if early is not None:  # (the look was taken while the last mini-batch ran)
                self._bell_mark, self._looked_at = early.mark, early.at
                snapshot, served = early.snapshot, self._run_early(early)
            else:
                snapshot = self._ctx.queue_watcher.snapshot()
                # Urgent work first: if it fails, no rider has been leased yet to be stranded.
                with self._ctx.lease_keeper.holding([self._item]):  # an urgent batch may outlast the lease
                    served = self._chunk_score is not None and _serve_one_urgent_batch(
                        self._ctx, snapshot, self._chunk_score, self._ticket, self._reservation, self._tenant)
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
            self._next_look = (early.at if early is not None else time.monotonic()) + self._interval
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
            leases.extend_lease(self._ctx.store, self._item, self._ticket, now=time.time(),
                                lease_seconds=self._lease_seconds)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Held while a mini-batch runs: the chunk's lease and the ticket are held in the worker's lease
        keeper (one `session.run` longer than the lease, a large batch of a slow model on a CPU, would
        lose them mid-run, since `__call__` extends them only between mini-batches; a lock and a dict
        entry, no Redis call unless the run passes a quarter of the lease), and the bell may take the
        next boundary's look meanwhile (`_look_early`)."""
        with self._ctx.lease_keeper.holding([self._item], self._ticket), \
                self._ctx.request_bell.calling(self._look_early):
            self._running_since = started = time.monotonic()
            try:
                yield
            finally:
                self._running_since = None
                self._minibatch_seconds = time.monotonic() - started

    def _look_early(self) -> bool:
        """The next boundary's look, taken on the bell's thread after an announcement while a mini-batch
        runs, where it is due and no other slot could take the request sooner (module docstring); True
        when it leased a batch. Once a mini-batch; errors are left to the boundary's own look."""
        if not self._early_lock.acquire(blocking=False):
            return False
        try:
            if not self._early_due():
                return False
            self._early_tried = self._running_since
            mark, at = self._ctx.request_bell.count(), time.monotonic()
            snapshot = self._ctx.queue_watcher.snapshot()
            if not snapshot.unclaimed_rings:
                return False  # an idle slot took the ring and leases the request: the boundary looks as before
            assert self._chunk_score is not None  # (`_early_due`)
            batches = _urgent_batches(self._ctx, snapshot, self._chunk_score, self._ticket, self._reservation,
                                      self._tenant)
            leased = next(batches, [])
            batches.close()
            held = contextlib.ExitStack()
            try:
                held.enter_context(self._ctx.lease_keeper.holding(leased))
            except BaseException:
                leases.return_unrun(self._ctx.store, leased)
                raise
            self._early = _EarlyLook(mark, at, snapshot, leased, held)
            return bool(leased)
        except StaleTicket:
            self._stale = True
            return False
        except Exception as err:  # (a Redis blip: the boundary looks itself)
            log.warning("a look while a mini-batch ran failed: %s; the chunk looks at its next boundary", err)
            return False
        finally:
            self._early_lock.release()

    def _early_due(self) -> bool:
        """Whether a look may be taken now, while a mini-batch runs: one is due (the look interval passed
        since the last), none was taken during this mini-batch, and it should end within the interval."""
        now, started, lasts = time.monotonic(), self._running_since, self._minibatch_seconds
        if self._stale or self._chunk_score is None or self._early is not None or started is None or lasts is None:
            return False
        if self._early_tried == started:
            return False
        return now >= self._next_look and started + lasts - now <= self._interval

    def _take_early(self) -> _EarlyLook | None:
        """The early look taken since the last boundary, once (waiting for one under way)."""
        with self._early_lock:
            early, self._early = self._early, None
        return early

    def _run_early(self, early: _EarlyLook) -> bool:
        """Run the early look's urgent batch in place of the next mini-batch; False without one, or when it
        went back to its queue for want of memory."""
        with early.held:
            if not early.leased:
                return False
            with self._ctx.lease_keeper.holding([self._item]):  # an urgent batch may outlast the lease
                return _run_in_place(self._ctx, early.leased, self._ticket, self._reservation)

    def run_early(self) -> None:
        """Run what an early look leased during the mini-batch just ended, where no boundary follows it at
        once (after a chunk's last mini-batch, between the pieces of a chunk read apart): in place of a
        mini-batch, as a boundary would."""
        early = self._take_early()
        if early is not None and self._run_early(early):
            self._next_look, self._bell_mark = 0.0, None  # (more may wait: the next boundary looks)

    def finish(self) -> None:
        """Settle requests the chunk never reached (it was dropped, failed or had no rows, or an early look
        leased them after its last boundary): run them, or give them back to their queue if even that
        fails (what was not tried goes back unrun)."""
        early = self._take_early()
        carried, self._carried = self._carried, []
        if carried:
            try:
                run_requests(self._ctx, carried, self._ticket)
            except Exception as err:
                give_back(self._ctx, carried, err)
                if early is not None:  # (not tried: back unrun, no attempt counted)
                    with early.held:
                        if early.leased:
                            leases.return_unrun(self._ctx.store, early.leased)
                raise
        if early is not None:
            self._run_early(early)


def _serve_one_urgent_batch(ctx: WorkerContext, snapshot: queues.QueueSnapshot, chunk_score: float, ticket: str,
                            chunk_reservation: int | None, chunk_tenant: str = "") -> bool:
    """Run one batch of the best waiting online requests that outrank `chunk_score`, or of a tenant that
    ranks above the chunk's tenant in the fair-share order (it takes its share back at this boundary);
    False if none (`_urgent_batches`), in place of the chunk's next mini-batch (`_run_in_place`)."""
    batches = _urgent_batches(ctx, snapshot, chunk_score, ticket, chunk_reservation, chunk_tenant)
    try:
        return any(_run_in_place(ctx, leased, ticket, chunk_reservation) for leased in batches)
    finally:
        batches.close()


def _urgent_batches(ctx: WorkerContext, snapshot: queues.QueueSnapshot, chunk_score: float, ticket: str,
                    chunk_reservation: int | None, chunk_tenant: str) -> Generator[list[LeasedItem], None, None]:
    """Lease, model by model in the order of their heads, the batches of online requests that may run
    before the chunk's next mini-batch: each leased only as the caller asks for the next (one is run,
    or goes back, before another is leased). `snapshot` is the queues as this look read them (a model
    none of whose waiting items is an online request is passed over without a lease).

    A batch runs instead of the chunk's next mini-batch, so it may use the chunk's reservation and the
    free memory (`MemoryLedger.room_in_place_of`): it is leased cut to that room (nothing is leased when
    its first request does not fit, so nothing is leased and returned every look)."""
    reclaim = ctx.fair_share.reclaim_option(chunk_tenant)
    for model_ref, score in sorted(snapshot.heads.items(), key=lambda head: head[1]):
        outranks = score < chunk_score
        if not outranks and reclaim is None:
            return
        if not snapshot.waiting_requests.get(model_ref, 0):
            continue  # only online requests run here: none waits for this model
        room = ctx.ledger.room_in_place_of(chunk_reservation)
        cut = None if room is None else batch_cost(ctx, model_ref).within(model_ref, room, math.inf)
        if room is not None and cut is None:
            continue  # not one request of this model fits beside the others now
        leased = lease(ctx, model_ref, ticket, requests_only=True, admission=cut, within_cut=cut is not None,
                       tenants=None if outranks else reclaim)
        if leased:
            yield leased


def _run_in_place(ctx: WorkerContext, leased: list[LeasedItem], ticket: str, chunk_reservation: int | None) -> bool:
    """Run a leased urgent batch reserved by its real need in place of the chunk's reservation; False when
    that no longer fits (it goes back to its queue unrun)."""
    handle = None
    try:
        need, seconds = batch_need(ctx, leased)
        with ctx.ledger.deciding:
            handle = ctx.ledger.reserve_in_place_of(chunk_reservation, need, now=time.time(),
                                                    expected_seconds=seconds)
        if handle is None:
            leases.return_unrun(ctx.store, leased)
            return False
        run_requests(ctx, leased, ticket)
        return True
    except BaseException:
        if handle is None:  # not run: back to the queue (a run that failed settled its own requests)
            leases.return_unrun(ctx.store, leased)
        raise
    finally:
        if handle is not None:
            ctx.ledger.release(handle, now=time.time())
