"""Leasing a stream slot's next batch, and holding its memory reservation while it runs.

Shared by the drain loop (`drain_loop`) and by what a running job chunk does
between its mini-batches (`between_minibatches`): both lease batches of online requests
under a model's batching settings, and reserve their memory by the rows and
tokens that really run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.errors import SitsError
from broker.failures import breaker
from broker.jobs import chunking, granularity
from broker.jobs.chunking import FALLBACK_BATCH_ROWS
from broker.jobs.granularity import ALONE, RunUnit
from broker.memory import reservation
from broker.memory.ledger import Claim
from broker.online import timeouts as request_timeouts
from broker.online.batching import Batching
from broker.queueing import leases, policy
from broker.queueing.scoring import estimate_latency_ms
from broker.tenants.batch_shares import BatchShares, in_flight_bound
from sits_worker.model.padding import max_sequence, shape_bucket
from sits_worker.serving import batch_trace
from sits_worker.serving.context import WorkerContext

log = logging.getLogger(__name__)


def lease(ctx: WorkerContext, model_ref: str, ticket: str, *, requests_only: bool = False,
          admission: reservation.Admission | None = None, carry_chunk: bool = False,
          within_cut: bool = False, tenants: dict[str, Any] | None = None,
          notes: leases.LeaseNotes | None = None, unit: RunUnit = ALONE) -> list[leases.LeasedItem]:
    """Lease `model_ref`'s best batch under its batching settings (one job chunk at a time, and
    cut to a preferred batch size), within the rows and tokens of its `admission` when given;
    `carry_chunk`, `within_cut`: see `leases.lease_batch`; in the fair-share order of the tenants
    (`fair_share.FairShare.lease_option`), or as `tenants` says when given, a batch of requests split by
    their shares (`FairShare.batch_shares`), and by the priority classes
    of this worker's degrade step (`memory_watch.MemoryWatch.lease_classes`); `notes` as the lease told them;
    a chunk at the head takes others along within `unit` (`run_unit`).
    Nothing while this worker's breaker of the model is open, or half-open with its probe batch taken by
    another slot."""
    claim = ctx.breakers.claim(model_ref, now=time.time())
    if claim is None:
        return []
    batching = ctx.batching(model_ref)
    max_rows = admission.max_rows if admission else batching.max_batch_size
    max_tokens = admission.max_tokens if admission else batching.max_batch_tokens
    leased: list[leases.LeasedItem] = []
    try:
        leased = _lease_batch(ctx, model_ref, ticket, batching, max_rows, max_tokens, requests_only=requests_only,
                              admission=admission, carry_chunk=carry_chunk, within_cut=within_cut,
                              tenants=tenants, notes=notes if notes is not None else leases.LeaseNotes(), unit=unit)
    finally:
        if claim == "probe" and not leased:  # the probe got no batch: another slot may take it
            ctx.breakers.release_probe(model_ref)
    return leased


@batch_trace.traced_lease
def _lease_batch(ctx: WorkerContext, model_ref: str, ticket: str, batching: Batching, max_rows: int,
                 max_tokens: int, *, requests_only: bool, admission: reservation.Admission | None,
                 carry_chunk: bool, within_cut: bool, tenants: dict[str, Any] | None,
                 notes: leases.LeaseNotes, unit: RunUnit = ALONE) -> list[leases.LeasedItem]:
    """One lease script call; in the fair-share order unless `tenants` says otherwise, a batch's rows split
    by the tenants' shares whichever tenants it may take; the tenants it found no work of told to the fair
    share (`FairShare.note_absent`)."""
    if tenants is None:
        tenants = ctx.fair_share.lease_option(model_ref)
    shares = share_option(ctx, model_ref, rows=max_rows)
    options = leases.LeaseOptions(
        max_items=batching.max_batch_size, max_rows=max_rows, max_tokens=max_tokens, max_chunks=unit.max_chunks,
        merge_rows=unit.max_rows,
        requests_only=requests_only, carry_chunk=carry_chunk, head_must_fit=within_cut,
        batch_limit=admission.whole_within if admission else None,
        preferred_sizes=batching.preferred_batch_sizes, tenants=tenants, classes=ctx.memory_watch.lease_classes(),
        shares=shares)
    result = leases.lease_batch(ctx.store, model_ref, options, now=time.time(),
                                lease_seconds=ctx.settings.scheduler.lease_timeout, ticket=ticket)
    notes.add(result, model_ref)
    if result.absent:
        ctx.fair_share.note_absent(model_ref, result.absent)
    if result.expired:
        try:
            fail_timed_out(ctx, model_ref)
        except SitsError as err:  # (the batch leased stands; the reaper's next pass fails them)
            log.warning("could not fail the timed-out requests of %s now: %s", model_ref, err.message)
    return result.items


def run_unit(ctx: WorkerContext, model_ref: str) -> RunUnit:
    """The run unit a lease of `model_ref`'s job chunks may take (`granularity.choose_unit`): `jobs.unit_seconds`
    at the model's measured (or observed) rows/s for its best job batch, within `jobs.max_chunk_output_bytes`."""
    settings = ctx.settings.jobs
    if settings.merge_chunks <= 1:
        return ALONE
    record = ctx.model(model_ref)
    batch_rows = chunking.auto_batch_size(record)
    return granularity.choose_unit(
        batch_rows=batch_rows, rows_per_second=chunking.profiled_rows_per_second(record, batch_rows),
        unit_seconds=settings.unit_seconds, most_chunks=settings.merge_chunks,
        output_bytes_per_row=chunking.output_bytes_per_row(record), max_output_bytes=settings.max_chunk_output_bytes)


def fail_timed_out(ctx: WorkerContext, model_ref: str) -> None:
    """Fail `model_ref`'s requests whose `reject` timeout passed while they waited (`broker.online.timeouts`), now:
    a lease leaves them where they wait, and every look of every slot would find them again until the reaper's
    next pass."""
    weights, ordering = policy.get_policy(ctx.store, default=policy.default_ordering(ctx.settings.scheduler.policy))
    request_timeouts.expire_timed_out(ctx.store, model_ref, now=time.time(), weights=weights, ordering=ordering,
                                      keep_seconds=ctx.settings.online.result_ttl)


def feed_bucket(ctx: WorkerContext, model_ref: str, feed: Mapping[str, np.ndarray]) -> tuple[str, int | None]:
    """The shape bucket of a job's mini-batch (and its padded length), as the API buckets requests."""
    static = ctx.model(model_ref).static_profile
    return shape_bucket(feed, ctx.padding(model_ref), max_sequence(static))


@batch_trace.traced_lease
def lease_riders(ctx: WorkerContext, model_ref: str, feed: Mapping[str, np.ndarray],
                 ticket: str) -> list[leases.LeasedItem]:
    """Requests of `model_ref` that can ride in the job mini-batch `feed`: its shape bucket, up to the
    model's `max_batch_size` rows, and within `max_batch_tokens` together with the mini-batch; by the
    tenants' fair-share order, a held tenant's left waiting, their rows split by the tenants' shares."""
    if breaker.state_at(ctx.breakers.breaker(model_ref), now=time.time()) != breaker.CLOSED:
        return []  # (the chunk runs on: its own runs decide; no one else's work rides along meanwhile)
    batching = ctx.batching(model_ref)
    static = ctx.model(model_ref).static_profile
    bucket, padded = feed_bucket(ctx, model_ref, feed)
    mini_batch_rows = len(next(iter(feed.values())))
    max_tokens = 0
    if batching.max_batch_tokens and (padded or static.get("sequence_axis")):
        rows = mini_batch_rows
        axis = static.get("sequence_axis") or {}
        length = padded or (feed[axis["input"]].shape[axis["axis"]] if axis.get("input") in feed else 0)
        max_tokens = batching.max_batch_tokens - rows * length
        if max_tokens <= 0:
            return []  # the mini-batch alone fills the token budget
    return leases.lease_riders(ctx.store, model_ref, bucket, now=time.time(),
                               lease_seconds=ctx.settings.scheduler.lease_timeout,
                               max_items=batching.max_batch_size, max_rows=batching.max_batch_size,
                               max_tokens=max_tokens, window=4 * batching.max_batch_size, ticket=ticket,
                               lowest_level=ctx.memory_watch.lowest_level(),
                               tenants=ctx.fair_share.lease_option(model_ref),
                               shares=share_option(ctx, model_ref, rows=mini_batch_rows + batching.max_batch_size))


def share_option(ctx: WorkerContext, model_ref: str, *, rows: int) -> BatchShares | None:
    """The tenants' shares a lease of `model_ref` splits its requests by (`FairShare.batch_shares`), None without
    fair share; its leased requests keep their tenants present while a run of `rows` rows may last by the
    model's profile (`batch_shares.in_flight_bound`), so that another slot does not fill up with the other
    tenants' requests meanwhile."""
    shares = ctx.fair_share.batch_shares()
    if shares is None:
        return None
    run_seconds = estimate_latency_ms(ctx.model(model_ref), rows=max(rows, 1), tokens=None) / 1000
    return dataclasses.replace(shares, in_flight_for=in_flight_bound(run_seconds, ctx.streams))


def batch_cost(ctx: WorkerContext, model_ref: str) -> reservation.BatchCost:
    """What a batch of `model_ref` costs by its profile, within its batching limits."""
    batching = ctx.batching(model_ref)
    cost = reservation.BatchCost.of(ctx.model(model_ref), max_rows=batching.max_batch_size,
                                    max_tokens=batching.max_batch_tokens)
    return ctx.learnt_cost(model_ref, cost)


@dataclass(frozen=True)
class Reserved:
    """What a stream slot runs after `admitted`, and the reservation it holds for it (None: no
    device memory, e.g. a finalize step)."""

    items: list[leases.LeasedItem]
    handle: int | None


@contextlib.contextmanager
def admitted(ctx: WorkerContext, leased: Sequence[leases.LeasedItem], admission: reservation.Admission, *,
             hold: int | None) -> Iterator[Reserved]:
    """Reserve what a lease under `admission` runs, in place of the decision's `hold`, and yield the
    items to run with their reservation, released when the block ends.

    A job chunk is admitted by its own need, which the admission could not know (its mini-batches
    are its job's `batch_size`, not the model's online batch): if it does not fit the device's
    free memory now, or the cut of a backfill admission, it goes back to its queue at once, its
    attempt not counted, and a `ledger.Claim` makes later admissions count its job's real
    need while the job's chunks head the queue. Requests it came with run without it. The check
    and the swap happen under the ledger's `deciding` lock, so no other slot admits on the same
    memory meanwhile.
    """
    model_ref = leased[0].model_ref
    chunks = [item for item in leased if item.payload.get("kind") == "chunk"]
    ledger = ctx.ledger
    handle = None
    try:
        with ledger.deciding:
            need, seconds = batch_need(ctx, leased)
            if chunks and not (admission.allows_chunk(need, seconds) and ledger.fits(need, instead_of=hold)):
                leases.return_unrun(ctx.store, chunks)
                if leased[0] is chunks[0]:  # it heads its queue again
                    ledger.claim(model_ref, Claim(chunks[0].payload["job"], need, seconds))
                leased = [item for item in leased if item.payload.get("kind") != "chunk"]
                need, seconds = batch_need(ctx, leased) if leased else (0, 0.0)
            if any(item.payload.get("kind") != "finalize" for item in leased):  # a merge needs no device memory
                handle = ledger.reserve(need, now=time.time(), expected_seconds=seconds)
    finally:
        if hold is not None:  # whatever happened, the hold gives way (the real one is in, or none)
            ledger.release(hold, now=time.time())
    try:
        yield Reserved(list(leased), handle)
    finally:
        if handle is not None:
            ledger.release(handle, now=time.time())


def batch_need(ctx: WorkerContext, leased: Sequence[leases.LeasedItem]) -> tuple[int, float]:
    """(Bytes, expected seconds) of what one lease runs: requests by their rows and tokens (a token
    model's), a chunk by the rows of its largest run, held until its last mini-batch (its expected
    end is the time of all its rows)."""
    cost = batch_cost(ctx, leased[0].model_ref)
    request_rows, request_tokens, chunk_batch, chunk_rows = 0, 0, 0, 0
    for item in leased:
        if item.payload.get("kind") == "request":
            request_rows += int(item.payload.get("rows") or 1)
            request_tokens += int(item.payload.get("padded_tokens") or item.payload.get("tokens") or 0)
        elif item.payload.get("kind") == "chunk":  # a finalize step needs no device memory
            # (a run unit's chunks run one mini-batch at a time, shared or each alone: its largest)
            riders = cost.max_rows if ctx.settings.scheduler.merge_requests_into_jobs else 0
            chunk_batch = max(chunk_batch, int(item.payload.get("batch_size") or FALLBACK_BATCH_ROWS) + riders)
            chunk_rows += int(item.payload.get("stop", 0)) - int(item.payload.get("start", 0))
    tokens = request_tokens or None
    return (cost.need_bytes(rows=request_rows, tokens=tokens) + cost.need_bytes(rows=chunk_batch),
            cost.seconds(rows=request_rows, tokens=tokens) + cost.seconds(rows=chunk_rows))
