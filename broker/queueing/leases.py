"""Leases: a batch taken from a ready queue into its in-flight set, kept alive, given back or finished.

Late binding: a worker's slot forms its batch when it leases (`lease_batch`), not when work is
submitted. Every state change is one Lua script, so an item is at every instant either waiting
(ready set), leased (in-flight set with a deadline) or gone because its work is recorded. Time is
passed in (`now`) so tests advance it. A lease that is not kept alive expires, and the reaper pass
(`broker/queueing/reaping.py`) returns it to its queue.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from broker.state.replies import LeaseReply
from broker.state.store import Store, translate_redis_errors
from broker.tenants.batch_shares import BatchShares


@dataclass(frozen=True)
class LeasedItem:
    """One item a worker now holds until its lease runs out (or it is acknowledged, finished or given back)."""

    item_id: str
    model_ref: str
    payload: dict[str, Any]
    attempts: int
    inputs: str | None = field(default=None, compare=False, repr=False)
    """An online request's packed inputs (`requests.load_inputs` reads them), as its lease read them
    from its hash: '' when the hash had expired; None when not read with the lease (then read apart)."""


class StaleTicket(Exception):
    """The drain task's ticket was replaced (its worker was taken for dead); the task must stop.

    Internal control flow between `lease_batch` and the drain loop, not a `SitsError`.
    """


@dataclass(frozen=True)
class LeaseOptions:
    """What one lease may take: the options table of `lease_batch.lua`, field for field.

    Job chunks (and finalize steps) are leased in queue order, up to `max_chunks`; online requests of
    one shape bucket are merged up to `max_items` requests, `max_rows` rows and `max_tokens` tokens.
    The head request always goes, even past the row and token limits (it must run somewhere), unless
    `head_must_fit`. The script's header says each field in full.
    """

    max_items: int
    """Most requests in a batch (and, unless `max_chunks` says otherwise, most chunks)."""
    max_rows: int | None = None
    """Most rows of a batch of requests (None: `max_items`)."""
    max_tokens: int = 0
    """Most (padded) tokens of a batch of requests (0: no limit)."""
    max_chunks: int | None = None
    """Most items when the head is a job chunk or finalize step (None: `max_items`)."""
    merge_rows: int = 0
    """A run unit's rows (`broker.jobs.granularity`): a head chunk takes further chunks along only while
    their rows together stay within it, and no finalize step (0: no such limit, `max_chunks` alone)."""
    requests_only: bool = False
    """Lease only online requests: a chunk at the head stays, and nothing is leased."""
    carry_chunk: bool = False
    """A batch of requests with rows to spare also takes the first job chunk among the candidates, last."""
    head_must_fit: bool = False
    """The head request too must fit the row and token limits, else nothing (a batch cut to a memory hole)."""
    batch_limit: tuple[int, int] | None = None
    """(rows, tokens; 0 tokens: no limit): a batch of requests formed under the limits above goes only
    if it stays within these too, else nothing (all or nothing: the head of the priority order runs now
    only if the batch that waits for it fits the free memory)."""
    preferred_sizes: tuple[int, ...] = ()
    """A batch of requests that takes no chunk along is cut to the largest of these its rows reach."""
    tenants: Mapping[str, Any] | None = None
    """The fair-share order ({order, held, window, only}: `sits_worker.tenancy.fair_share`): the batch
    is formed by the tenants' order, a held tenant's work left waiting; the ranked tenants' work is read from
    their own indexes however deep it waits, the others' within the first `window` waiting items."""
    classes: Mapping[str, Any] | None = None
    """A degraded worker's classes ({ranks, demote, window}: `broker.failures.degrade.lease_classes`):
    items rank by the class of their level first, a paused class's left waiting."""
    shares: BatchShares | None = None
    """A batch's rows by the tenants' shares (`broker.tenants.batch_shares`): the first ranked tenant present
    on the model fills first, every other at most its share's part of that tenant's rows; nothing
    (`LeaseStatus.HELD_FOR_SHARE`) while that tenant is present with nothing waiting. The leased requests'
    tenants stay present while the batch runs (`BatchShares.in_flight_for`)."""

    def to_lua(self, request_prefix: str) -> dict[str, Any]:
        """The JSON-ready table the script reads; `request_prefix` names request hashes (their inputs
        come back with each leased request)."""
        table: dict[str, Any] = {
            "max_items": self.max_items, "max_rows": self.max_rows or self.max_items, "max_tokens": self.max_tokens,
            "max_chunks": self.max_chunks or self.max_items, "merge_rows": self.merge_rows,
            "requests_only": self.requests_only,
            "carry_chunk": self.carry_chunk, "head_must_fit": self.head_must_fit,
            "preferred_sizes": [int(size) for size in self.preferred_sizes], "request_prefix": request_prefix,
        }
        if self.batch_limit is not None:
            table["batch_limit"] = {"rows": self.batch_limit[0], "tokens": self.batch_limit[1]}
        if self.tenants is not None:
            table["tenants"] = dict(self.tenants)
        if self.classes is not None:
            table["classes"] = dict(self.classes)
        if self.shares is not None:
            table["shares"] = self.shares.to_lua()
        return table


class LeaseStatus(StrEnum):
    """How a lease ended (a replaced ticket raises `StaleTicket` instead)."""

    LEASED = "leased"
    NOTHING = "nothing"
    """Nothing leased: the queue is empty, its head is not for this lease, or the batch does not fit."""
    ONLY_PAUSED = "only_paused"
    """Nothing leased, and the items within reach were all of a paused class (not a held tenant's)."""
    HELD_FOR_SHARE = "held_for_share"
    """Nothing leased: the tenant the batch's rows are shared by is present with nothing waiting this instant."""
    AT_SLOT_CAP = "at_slot_cap"
    """Nothing leased: the waiting chunks within reach are of jobs that hold their slot cap (`max_slots`)."""


@dataclass(frozen=True)
class LeaseResult:
    """What one lease took, and what it learnt beside."""

    status: LeaseStatus
    items: list[LeasedItem]
    absent: list[str] = field(default_factory=list)
    """The ranked tenants a fair scan found no item of: their indexes are empty, or (a queue not indexed
    yet) the scan read every item within reach. The caller may leave them out of its next orders a moment."""
    expired: int = 0
    """Online requests past their `reject` timeout the lease found waiting and left there: a lease never
    takes one, nor counts it as its tenant's work. The caller fails them (`broker.online.timeouts`)."""
    held_by: str = ""
    """With `LeaseStatus.HELD_FOR_SHARE`, the tenant the lease was held for (the share split's anchor): the
    slot's wait for it is charged to it (`sits_worker.tenancy.usage_meter.UsageMeter.charge`)."""


def lease_batch(store: Store, model_ref: str, options: LeaseOptions, *, now: float, lease_seconds: float,
                ticket: str = "") -> LeaseResult:
    """Lease the best waiting batch of `model_ref` under `options`, until `now + lease_seconds`; under
    `ticket` when given (StaleTicket when it was replaced). One script call (`lease_batch.lua`). An online
    request past its `reject` timeout by `now` is never leased (`LeaseResult.expired` counts those seen)."""
    keys = store.keys
    with translate_redis_errors():
        reply = store.scripts.lease_batch(
            keys=[keys.tickets, keys.ready(model_ref), keys.inflight(model_ref), keys.items, keys.attempts,
                  keys.doorbell, keys.waiting_requests(model_ref), keys.tenants_served(model_ref)],
            args=[ticket, now, now + lease_seconds, json.dumps(options.to_lua(keys.request("")))],
        )
    count = int(reply[0])
    if count == LeaseReply.STALE_TICKET:
        raise StaleTicket(ticket)
    if count == LeaseReply.ONLY_PAUSED:
        status, count = LeaseStatus.ONLY_PAUSED, 0
    elif count == LeaseReply.HELD_FOR_SHARE:
        status, count = LeaseStatus.HELD_FOR_SHARE, 0
    elif count == LeaseReply.AT_SLOT_CAP:
        status, count = LeaseStatus.AT_SLOT_CAP, 0
    else:
        status = LeaseStatus.LEASED if count > 0 else LeaseStatus.NOTHING
    expired, held_by, *absent = reply[1 + LEASED_FIELDS * count:]
    return LeaseResult(status, _leased([count, *reply[1:1 + LEASED_FIELDS * count]], model_ref, ticket),
                       [str(name) for name in absent], int(expired), str(held_by))


def lease_riders(
    store: Store,
    model_ref: str,
    bucket: str,
    *,
    now: float,
    lease_seconds: float,
    max_items: int,
    max_rows: int,
    max_tokens: int = 0,
    window: int = 256,
    ticket: str = "",
    lowest_level: int = 0,
    tenants: dict[str, Any] | None = None,
    shares: BatchShares | None = None,
) -> list[LeasedItem]:
    """Lease online requests of `model_ref` in shape `bucket`, best first, to ride along in a job
    chunk's next mini-batch: found among the first `window` waiting items even behind job chunks,
    up to `max_items` requests, `max_rows` rows and `max_tokens` tokens (0: no token limit), none
    submitted below priority level `lowest_level` (a degraded worker's paused class). With `tenants`
    ({order, held}: `sits_worker.tenancy.fair_share`), the requests of tenants in `order` go first, in its
    order, and a held tenant's do not ride. With `shares`, the riders' rows are split as a batch of
    requests' are (`LeaseOptions.shares`): a tenant over its share cannot fill the rows the chunk leaves.
    A request past its `reject` timeout does not ride (its failure comes from `broker.online.timeouts`)."""
    keys = store.keys
    with translate_redis_errors():
        reply = store.scripts.lease_riders(
            keys=[keys.tickets, keys.ready(model_ref), keys.inflight(model_ref), keys.items, keys.attempts,
                  keys.waiting_requests(model_ref), keys.tenants_served(model_ref)],
            args=[ticket, now, now + lease_seconds, bucket, max_items, max_rows, max_tokens, window, lowest_level,
                  json.dumps(tenants) if tenants is not None else "", keys.request(""),
                  json.dumps(shares.to_lua()) if shares is not None else ""],
        )
    return _leased(reply, model_ref, ticket)


LEASED_FIELDS = 4
"""Reply fields of each leased item (`lib.lua`'s `append_leased`): id, payload, lease count, inputs."""


def decode_payload(payload: str | bytes | None) -> dict[str, Any]:
    """An item's payload JSON as a dict ({} for none). orjson first, as a lease decodes one per item; the
    standard library's for a payload orjson refuses (NaN or Infinity, which `json.dumps` writes). orjson
    reads an integer past 64 bits as a float: payloads hold none."""
    if not payload:
        return {}
    try:
        decoded: dict[str, Any] = orjson.loads(payload)
    except orjson.JSONDecodeError:
        decoded = json.loads(payload)
    return decoded


def _leased(reply: list[Any], model_ref: str, ticket: str) -> list[LeasedItem]:
    """The items of a lease script's reply (`LeaseReply.STALE_TICKET`: the ticket was replaced)."""
    count = int(reply[0])
    if count == LeaseReply.STALE_TICKET:
        raise StaleTicket(ticket)
    items = []
    for i in range(count):
        item_id, payload, attempts, inputs = reply[1 + LEASED_FIELDS * i : 1 + LEASED_FIELDS * (i + 1)]
        items.append(LeasedItem(item_id, model_ref, decode_payload(payload), int(attempts),
                                inputs=inputs))
    return items


@dataclass
class LeaseNotes:
    """What several leases told beside their items, gathered by a caller that makes them in turn."""

    absent: list[str] = field(default_factory=list)
    """The ranked tenants a fair scan that read every item within reach found no item of."""
    paused: bool = False
    """Nothing was leased because the items within reach were all of a paused class."""
    held_for_share: bool = False
    """A lease was held back for a present tenant's next requests (`LeaseStatus.HELD_FOR_SHARE`)."""
    held_by: tuple[str, str] | None = None
    """(Model ref, tenant) of the first such lease: the tenant it was held for (`LeaseResult.held_by`)."""
    at_slot_cap: bool = False
    """A lease found only chunks of jobs holding their slot cap (`LeaseStatus.AT_SLOT_CAP`)."""

    def add(self, result: LeaseResult, model_ref: str = "") -> None:
        """Take in what `result`, a lease of `model_ref`, told."""
        self.absent.extend(result.absent)
        if result.status is LeaseStatus.ONLY_PAUSED:
            self.paused = True
        if result.status is LeaseStatus.AT_SLOT_CAP:
            self.at_slot_cap = True
        if result.status is LeaseStatus.HELD_FOR_SHARE:
            self.held_for_share = True
            if result.held_by and self.held_by is None:
                self.held_by = (model_ref, result.held_by)


def finish_item(
    store: Store,
    item: LeasedItem,
    job_id: str,
    *,
    now: float,
    job_status: str = "",
    error: str = "",
    job_fields: dict[str, str] | None = None,
) -> None:
    """Remove `item` for good; optionally move its job to a final status (kept if already final, but
    'succeeded', a finalize step's published manifest, replaces a cancel or failure that came late)."""
    keys = store.keys
    with translate_redis_errors():
        store.scripts.finish_item(
            keys=[
                keys.inflight(item.model_ref),
                keys.ready(item.model_ref),
                keys.items,
                keys.attempts,
                keys.dead,
                keys.job(job_id),
                keys.job_counts,
                keys.counters,
                keys.latency_buckets,
                keys.jobs_due,
            ],
            args=[item.item_id, job_status, error, now, json.dumps(job_fields or {}), job_id],
        )


def extend_lease(store: Store, item: LeasedItem, ticket: str, *, now: float, lease_seconds: float) -> None:
    """Keep a long chunk's lease (and its ticket) alive; a lease already reaped stays reaped."""
    extend_leases(store, [item], ticket, now=now, lease_seconds=lease_seconds)


def extend_leases(store: Store, items: Sequence[LeasedItem], ticket: str, *, now: float,
                  lease_seconds: float) -> None:
    """Keep the leases of `items` (and `ticket`) alive, in one call (`extend_leases.lua`): reaped ones stay
    reaped, and one parked for a retry keeps its backoff's deadline."""
    keys = store.keys
    item_keys = [key for item in items for key in (keys.inflight(item.model_ref), keys.retrying(item.model_ref))]
    with translate_redis_errors():
        store.scripts.extend_leases(keys=[keys.tickets, *item_keys],
                                    args=[now + lease_seconds, now, ticket, *(item.item_id for item in items)])


def return_unrun(store: Store, items: Sequence[LeasedItem]) -> int:
    """Put leased items that never ran back in their queue at once, their attempt not counted (the
    worker could not run them now, through no fault of theirs); returns how many went back. Items
    no longer in flight are left alone. Meant for right after the lease: an item whose lease ran out
    and was leased again elsewhere would be taken from its new holder."""
    returned = 0
    with translate_redis_errors():
        for model_ref in sorted({item.model_ref for item in items}):
            keys = store.keys
            returned += int(store.scripts.return_items(
                keys=[keys.inflight(model_ref), keys.ready(model_ref), keys.items, keys.attempts, keys.doorbell,
                      keys.waiting_requests(model_ref)],
                args=[item.item_id for item in items if item.model_ref == model_ref]))
    return returned


def expire_lease_now(store: Store, item: LeasedItem) -> None:
    """Give a leased item back for a retry at the next reaper pass (its attempt stays counted)."""
    with translate_redis_errors():
        store.client.zadd(store.keys.inflight(item.model_ref), {item.item_id: 0}, xx=True)
