"""The drain loop behind a batch ticket: look at the queues, lease a batch, run it, or wait.

A ticket is a circulating Celery task (docs/concepts.md, "Ticket"): it leases the
best waiting batch across models, runs it, and goes on until no queue has
work for `ticket_linger` and its process has no chunk commit pending (it
waits on the doorbell meanwhile, then retires, atomically with a last check)
or its time slice is used (then it re-queues itself so other Celery tasks
get the thread). At a warm shutdown (`WorkerContext.stopping`) it leases
nothing more and re-queues its ticket after the batch it runs, for the
workers that stay.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from broker.jobs import records as jobs
from broker.jobs.granularity import ALONE
from broker.memory import reservation
from broker.queueing import leases, policy, queues, tickets
from broker.queueing.leases import StaleTicket
from broker.state.store import Store
from sits_worker.serving import drain_report, run_units
from sits_worker.serving.between_minibatches import BetweenBatches
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.drain_report import DrainReport
from sits_worker.serving.execution import process_item
from sits_worker.serving.leasing import admitted, batch_cost, lease, run_unit
from sits_worker.serving.request_runs import run_requests
from sits_worker.tenancy.usage_meter import Work

log = logging.getLogger(__name__)

_DOORBELL_SLICE_SECONDS = 0.25
"""A lingering ticket looks at the queues at least this often, rung or not (a safety net: every
enqueue path rings the doorbell)."""


COMPANY_POLL_SECONDS = 0.001
"""How often a head request's batch is looked at again while it waits for company (`max_queue_delay`)."""

SLOT_CAP_POLL_SECONDS = 0.1
"""How long a slot waits, unless new work rings, when the only waiting work is of jobs at their slot cap: the
slot that ends one of their chunks leases the next itself, so the others need not look often."""
HELD_POLL_SECONDS = 0.01
"""How often a slot looks again while a tenant is held back (its usage decays by the milliseconds)."""

PAUSED_POLL_SECONDS = 0.1
"""How long a slot that found only paused work (a degraded worker's P2) waits for an enqueue to ring
before it looks again: new work wakes it at once, and a step back is seen within this."""

PASS_ON_SECONDS = 1.0
"""How often at most a paused slot passes on a ring it was woken by and could not use (only paused work
again): the enqueue meant it for a slot that may serve it, a calm worker's, which waits on the same list."""


class Outcome(StrEnum):
    """How a drain under one ticket ended; the task re-sends the ticket after `YIELD`."""

    RELEASED = "released"
    """No queue had work: the ticket is retired, in one step with that check."""
    STALE = "stale"
    """Another copy of the ticket's message runs, or it was replaced: this one stops."""
    YIELD = "yield"
    """The time slice is over: re-queue the ticket, so other Celery work and other slots get a turn."""


@dataclass
class _Slice:
    """What one ticket's loop remembers between its looks at the queues."""

    ticket: str
    ends: float
    """`time.monotonic()` at which the ticket's time slice ends."""
    idle_since: float | None = None
    """When the looks started finding no work (the ticket lingers `ticket_linger` from then)."""
    touched_at: float = float("-inf")
    """When this loop last marked its ticket seen while lingering."""
    paused_ring: PausedRing = field(default_factory=lambda: PausedRing())

    def over(self) -> bool:
        """Whether the time slice has ended."""
        return time.monotonic() >= self.ends


def drain(ctx: WorkerContext, ticket: str, report: DrainReport | None = None) -> Outcome:
    """Serve batches under `ticket` until the queues are empty or its time slice ends: look at the
    queues, then either idle on the doorbell or lease a batch, run it and wait as its outcome says.
    What ran is noted in `report` (`drain_report`), its outcome once the loop ends."""
    report = report if report is not None else DrainReport()
    with drain_report.collecting(report):
        outcome = _drain(ctx, ticket)
    report.outcome = outcome.value
    return outcome


def _drain(ctx: WorkerContext, ticket: str) -> Outcome:
    state = _Slice(ticket, ends=time.monotonic() + ctx.settings.scheduler.ticket_time_slice)
    try:
        while True:
            if ctx.stopping.is_set():  # warm shutdown: the ticket goes on to the rest of the fleet
                return Outcome.YIELD
            # (before the snapshot: a request announced after it is the chunk leased below's to look for; one
            # before is in the snapshot, and where the snapshot holds none the lease passed none over, on this
            # model or another: only then does the chunk start from this count)
            bell_mark = ctx.request_bell.count()
            looked = _snapshot_after_psa(ctx)
            unbarred = _without_open_breakers(ctx, looked)
            snapshot = _without_capped_models(ctx, unbarred)
            if snapshot.heads:
                state.idle_since = None
                _lease_and_run(ctx, state, snapshot, bell_mark)
                outcome = Outcome.YIELD if state.over() else None
            elif unbarred.heads:  # only models at their streams cap wait: pass on the ring that woke this slot
                state.paused_ring.wait(ctx.store, state.ticket)
                outcome = Outcome.YIELD if state.over() else None
            else:
                outcome = _idle(ctx, state, barred_only=bool(looked.heads))
            if outcome is not None:
                return outcome
    except StaleTicket:
        return Outcome.STALE


def _idle(ctx: WorkerContext, state: _Slice, *, barred_only: bool) -> Outcome | None:
    """The step of a look that found no work it may lease: linger on the doorbell, or release the
    ticket; None to look again. `barred_only`: the queues hold work, all of it this worker's open
    breakers bar."""
    settings = ctx.settings.scheduler
    state.idle_since = time.monotonic() if state.idle_since is None else state.idle_since
    linger_left = settings.ticket_linger - (time.monotonic() - state.idle_since)
    # Pending commits may still queue work (a job's last ack queues its finalize step)
    # without topping tickets up: the ticket stays until they are done. So does work this
    # worker's open breakers bar (the queues hold it, so the ticket cannot be released):
    # the slot waits on the doorbell, not on a loop of looks, until a breaker half-opens.
    if linger_left > 0 or ctx.commits.pending() or barred_only:
        touch = time.monotonic() - state.touched_at > settings.ticket_timeout / 4
        state.touched_at = time.monotonic() if touch else state.touched_at
        tickets.wait_for_doorbell(ctx.store, state.ticket, now=time.time(), touch=touch,
                                 timeout=min(linger_left, _DOORBELL_SLICE_SECONDS)
                                 if linger_left > 0 else _DOORBELL_SLICE_SECONDS)
        return Outcome.YIELD if barred_only and state.over() else None
    if tickets.release_ticket(ctx.store, state.ticket):
        return Outcome.RELEASED
    # (work came in since the snapshot: look again, within the slice, so that no state this loop
    # misreads can hold it for ever)
    return Outcome.YIELD if state.over() else None


def _lease_and_run(ctx: WorkerContext, state: _Slice, snapshot: queues.QueueSnapshot, bell_mark: int | None) -> None:
    """The step of a look that found work: choose a model, lease its batch under a memory hold, run it;
    when nothing ran, wait as the reason says (`_wait_after_nothing_ran`)."""
    # A slot that outpaces the disk leases no chunk until a commit is done (requests go on).
    room = ctx.commits.has_room()
    leased: list[leases.LeasedItem] = []
    order = policy.model_order(snapshot.heads, ctx.settings.scheduler.policy, ctx.last_served)
    allowed, hold = reservation.admit_and_hold(
        order, lambda ref: batch_cost(ctx, ref), ctx.ledger, now=time.time(),
        backfill=ctx.settings.scheduler.policy == "graph-aware-backfill", head_items=snapshot.head_items)
    notes = leases.LeaseNotes()
    try:
        leased, admission = _lease_admitted(ctx, allowed, state.ticket, requests_only=not room, notes=notes,
                                            waiting_requests=snapshot.waiting_requests)
    finally:
        if hold is not None and not leased:  # nothing to run (or the lease failed): free the hold
            ctx.ledger.release(hold, now=time.time())
    try:
        _run_admitted(ctx, state, snapshot, bell_mark, leased, admission, hold, room=room, notes=notes,
                      allowed=allowed)
    finally:
        if leased:  # (the stream `_lease_admitted` took for the model)
            ctx.model_streams.leave(leased[0].model_ref)


def _run_admitted(ctx: WorkerContext, state: _Slice, snapshot: queues.QueueSnapshot, bell_mark: int | None,
                  leased: list[leases.LeasedItem], admission: reservation.Admission | None, hold: int | None, *,
                  room: bool, notes: leases.LeaseNotes, allowed: list[reservation.Admission]) -> None:
    """Run what was leased under its admission and memory hold, or wait as the look's notes say."""
    if leased or room:  # (a slot without commit room that leases nothing waits for the disk)
        reservation.count_lease(ctx.ledger, allowed, admission if leased else None)
    ran = False
    if leased and admission is not None:
        with admitted(ctx, leased, admission, hold=hold) as runnable:
            if runnable.items:
                _run_leased(ctx, runnable.items, state.ticket, runnable.handle,
                            bell_mark if not any(snapshot.waiting_requests.values()) else None)
                ran = True
    if not ran:
        _wait_after_nothing_ran(ctx, state, snapshot, bell_mark, room=room, notes=notes, allowed=allowed)
    if not notes.paused or ran:
        state.paused_ring.woken = False


def _wait_after_nothing_ran(ctx: WorkerContext, state: _Slice, snapshot: queues.QueueSnapshot, bell_mark: int | None,
                            *, room: bool, notes: leases.LeaseNotes,
                            allowed: list[reservation.Admission]) -> None:
    """A look found work but this slot ran none: wait for what stood in the way before looking again."""
    if not room and all(map(jobs.is_chunk_item_id, snapshot.head_items.values())):
        _wait_for_room(ctx, bell_mark)  # only chunks wait: wait for the disk, or a request
    elif notes.paused:  # every lease found only paused work: wait for new work
        state.paused_ring.wait(ctx.store, state.ticket)
    elif notes.held_for_share:  # the tenant the batch is shared by comes back in a moment: wait for its call
        started = time.monotonic()
        tickets.wait_for_doorbell(ctx.store, state.ticket, now=time.time(),
                                  timeout=ctx.settings.fair_share.present_for, touch=False)
        if notes.held_by is not None:  # (the slot waited for that tenant alone: the wait is its usage)
            model_ref, tenant = notes.held_by
            ctx.usage.charge(model_ref, [Work(tenant, "", 1)], time.monotonic() - started)
    elif notes.at_slot_cap:  # only capped jobs' chunks wait: one of theirs must end (its own slot goes on)
        tickets.wait_for_doorbell(ctx.store, state.ticket, now=time.time(), timeout=SLOT_CAP_POLL_SECONDS,
                                  touch=False)
    else:  # memory is reserved by running batches, another slot took the work, or the waiting work
        # is a held tenant's (past its limit: it waits for its usage to decay); a degraded worker's
        # leases weigh a long window: it looks again less often
        degraded = bool(allowed) and ctx.memory_watch.lease_classes() is not None
        time.sleep(HELD_POLL_SECONDS if ctx.fair_share.holding or degraded else 0.001)


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
            tickets.ring_doorbell(store)
        self.woken = tickets.wait_for_doorbell(store, ticket, now=time.time(), timeout=PAUSED_POLL_SECONDS,
                                              touch=False)


def _lease_admitted(ctx: WorkerContext, allowed: list[reservation.Admission], ticket: str, *,
                    requests_only: bool = False, notes: leases.LeaseNotes,
                    waiting_requests: Mapping[str, int] | None = None,
                    ) -> tuple[list[leases.LeasedItem], reservation.Admission | None]:
    """Lease the first admitted model's batch that has work, with its admission; ([], None) when none
    has any now (with `requests_only`: none headed by an online request). `notes.paused` ends true only
    when every lease found nothing but paused work, `notes.at_slot_cap` when every one found nothing but chunks of
    jobs at their slot cap. Where online requests wait (`waiting_requests`, by
    model, as the snapshot counted them), those of a tenant returning after fair share took it for absent
    are looked for first (`FairShare.returning_option`)."""
    waited: set[str] = set()  # (a whole admission and a backfill behind it may name one model)
    paused = capped = bool(allowed)
    for admission in allowed:
        model_ref = admission.model
        if model_ref not in waited and ctx.memory_watch.lease_classes() is None:
            _wait_for_company(ctx, model_ref)  # (a degraded worker ranks by class: the queue's head may not lead)
            waited.add(model_ref)
        returning = ctx.fair_share.returning_option(model_ref) if (waiting_requests or {}).get(model_ref) else None
        if returning is not None:
            leased = _lease_within_streams(ctx, model_ref, functools.partial(
                lease, ctx, model_ref, ticket, admission=admission, within_cut=admission.cut, requests_only=True,
                tenants=returning))
            if leased:
                ctx.last_served = model_ref
                return leased, admission
            ctx.fair_share.note_returning_missed(model_ref)
        # A batch cut to free memory (a backfill, or beside the head) takes no chunk along and no
        # item that does not fit the cut: it must fit the hole and end in time.
        carry = ctx.settings.scheduler.merge_requests_into_jobs and not admission.cut
        said = leases.LeaseNotes()
        unit = ALONE if requests_only or admission.cut else run_unit(ctx, model_ref)  # (a cut fits one chunk)
        leased = _lease_within_streams(ctx, model_ref, functools.partial(
            lease, ctx, model_ref, ticket, admission=admission, carry_chunk=carry, within_cut=admission.cut,
            requests_only=requests_only, notes=said, unit=unit))
        if leased:
            ctx.last_served = model_ref
            return leased, admission
        paused, capped = paused and said.paused, capped and said.at_slot_cap
        notes.held_for_share = notes.held_for_share or said.held_for_share
        notes.held_by = notes.held_by or said.held_by
    notes.paused, notes.at_slot_cap = paused, capped
    return [], None


def _lease_within_streams(ctx: WorkerContext, model_ref: str,
                          lease_batch: Callable[[], list[leases.LeasedItem]]) -> list[leases.LeasedItem]:
    """`lease_batch()` under one of the model's streams (`model_streams`), kept when it leased something (the
    caller gives it back when the batch ends); nothing when the model is at its cap."""
    if not ctx.model_streams.try_enter(model_ref, ctx.batching(model_ref).streams):
        return []
    leased: list[leases.LeasedItem] = []
    try:
        leased = lease_batch()
    finally:
        if not leased:
            ctx.model_streams.leave(model_ref)
    return leased


def _run_leased(ctx: WorkerContext, leased: list[leases.LeasedItem], ticket: str, reservation: int | None,
                bell_mark: int | None = None) -> None:
    """Run what one lease returned, under its memory `reservation`: a batch of requests, a job chunk
    or finalize step, requests with a chunk they took along (they ride in its first mini-batch), or a
    run unit of several chunks (`run_units`).
    `bell_mark`: the request bell's count before the lease (`BetweenBatches`)."""
    online = [item for item in leased if item.payload.get("kind") == "request"]
    offline = [item for item in leased if item.payload.get("kind") != "request"]
    if not offline:
        run_requests(ctx, online, ticket)
        return
    if len(offline) > 1:  # a run unit: chunks alone, no request along (a batch of requests takes one chunk)
        run_units.run_unit(ctx, offline, ticket, functools.partial(
            _run_alone, ctx, ticket=ticket, reservation=reservation, bell_mark=bell_mark, note=False))
        return
    _run_alone(ctx, offline[0], ticket=ticket, reservation=reservation, bell_mark=bell_mark, carried=online)


def _run_alone(ctx: WorkerContext, item: leases.LeasedItem, *, ticket: str, reservation: int | None,
               bell_mark: int | None, carried: Sequence[leases.LeasedItem] = (), note: bool = True) -> None:
    """Run one job chunk or finalize step, with the requests `carried` along riding in its first mini-batch;
    a chunk counted in the drain report unless the caller did (`note`)."""
    if note and item.payload.get("kind") == "chunk":
        drain_report.note_chunk()
    between = BetweenBatches(ctx, item, ticket, carried=carried, reservation=reservation, bell_mark=bell_mark)
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


def _without_capped_models(ctx: WorkerContext, snapshot: queues.QueueSnapshot) -> queues.QueueSnapshot:
    """The snapshot without the models this worker runs on as many slots as their batching's `streams`
    allows (`model_streams`): the slots that run them lease their next batches as they end."""
    capped = [ref for ref in snapshot.heads if ctx.model_streams.at_cap(ref, ctx.batching(ref).streams)]
    return _without(snapshot, capped)


def _without(snapshot: queues.QueueSnapshot, barred: list[str]) -> queues.QueueSnapshot:
    """The snapshot without the `barred` models' queues."""
    if not barred:
        return snapshot
    heads = {ref: score for ref, score in snapshot.heads.items() if ref not in barred}
    head_items = {ref: item for ref, item in snapshot.head_items.items() if ref not in barred}
    return dataclasses.replace(snapshot, heads=heads, head_items=head_items)


def _without_open_breakers(ctx: WorkerContext, snapshot: queues.QueueSnapshot) -> queues.QueueSnapshot:
    """The snapshot without the models whose breaker on this worker bars a lease now (`broker/failures/breaker.py`):
    to this worker their queues look empty, so its slots wait on the doorbell instead of spinning on
    work only other workers may take (or this one, once the breaker half-opens)."""
    now = time.time()
    return _without(snapshot, [ref for ref in snapshot.heads if not ctx.breakers.may_lease(ref, now=now)])


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
