"""Leases: a batch taken from a ready queue into its in-flight set, kept alive, given back or finished.

Late binding: a worker's slot forms its batch when it leases (`lease_batch`), not when work is
submitted. Every state change is one Lua script, so an item is at every instant either waiting
(ready set), leased (in-flight set with a deadline) or gone because its work is recorded. Time is
passed in (`now`) so tests advance it. A lease that is not kept alive expires, and the reaper pass
(`broker/queueing/reaping.py`) returns it to its queue.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from broker.state.store import Store, translate_redis_errors


@dataclass(frozen=True)
class LeasedItem:
    """One item a worker now holds until `lease_deadline`."""

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


def lease_batch(
    store: Store,
    model_ref: str,
    *,
    now: float,
    lease_seconds: float,
    max_items: int,
    ticket: str = "",
    max_rows: int | None = None,
    max_tokens: int = 0,
    max_chunks: int | None = None,
    requests_only: bool = False,
    carry_chunk: bool = False,
    head_within_limits: bool = False,
    whole_within: tuple[int, int] | None = None,
    preferred_sizes: tuple[int, ...] = (),
    tenants: dict[str, Any] | None = None,
    classes: dict[str, Any] | None = None,
    notes: LeaseNotes | None = None,
) -> list[LeasedItem]:
    """Lease the best waiting batch of `model_ref`; [] when its queue is empty.

    Job chunks (and finalize steps) are leased in queue order, up to `max_chunks` (default
    `max_items`); online requests of one shape bucket are merged up to `max_items` requests,
    `max_rows` rows and `max_tokens` tokens (0: no token limit). With `requests_only`, [] too
    when the queue's head is not an online request. With `carry_chunk`, a batch of requests that
    leaves rows empty also takes the first job chunk among the candidates, as its last item.
    The head request always goes, even past the row and token limits (it must run somewhere),
    unless `head_within_limits`: then [] when it does not fit them (a batch cut to a memory hole).
    With `whole_within` (rows, tokens; 0 tokens: no limit), a batch of requests formed under the
    limits above is leased only if it stays within those too, else [] (all or nothing: the head of
    the priority order runs now only if the batch that waits for it fits the free memory).
    With `preferred_sizes`, a batch of requests that takes no chunk along is cut to the largest of
    them its rows reach (Triton's preferred batch sizes; the head request always stays).
    With `tenants` ({order, held, window}: `sits_worker.tenancy.fair_share`), the batch is formed from the
    first `window` waiting items by their tenants' fair-share order, a held tenant's left waiting;
    the ranked tenants such a lease found no item of, having read every item within reach, are added
    to `notes.absent` when given. With `classes` ({ranks, demote, window}: `broker.failures.degrade.lease_classes`),
    items rank by the class of their priority level first, a paused class's left waiting; `notes.paused`
    tells that nothing was leased because paused items were all there was within reach.
    """
    keys = store.keys
    options: dict[str, Any] = {
        "max_items": max_items, "max_rows": max_rows or max_items, "max_tokens": max_tokens,
        "max_chunks": max_chunks or max_items, "requests_only": bool(requests_only),
        "carry_chunk": bool(carry_chunk), "head_must_fit": bool(head_within_limits),
        "preferred_sizes": [int(size) for size in preferred_sizes], "request_prefix": keys.request(""),
    }
    if whole_within is not None:
        options["batch_limit"] = {"rows": whole_within[0], "tokens": whole_within[1]}
    if tenants is not None:
        options["tenants"] = tenants
    if classes is not None:
        options["classes"] = classes
    with translate_redis_errors():
        reply = store.scripts.lease_batch(
            keys=[keys.tickets, keys.ready(model_ref), keys.inflight(model_ref), keys.items, keys.attempts,
                  keys.doorbell, keys.waiting_requests(model_ref)],
            args=[ticket, now, now + lease_seconds, json.dumps(options)],
        )
    count = int(reply[0])
    if count == -2:
        if notes is not None:
            notes.paused = True
        reply = [0, *reply[1:]]
        count = 0
    if notes is not None and count >= 0:
        notes.absent.extend(str(name) for name in reply[1 + LEASED_FIELDS * count:])
    return _leased(reply, model_ref, ticket)


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
) -> list[LeasedItem]:
    """Lease online requests of `model_ref` in shape `bucket`, best first, to ride along in a job
    chunk's next mini-batch: found among the first `window` waiting items even behind job chunks,
    up to `max_items` requests, `max_rows` rows and `max_tokens` tokens (0: no token limit), none
    submitted below priority level `lowest_level` (a degraded worker's paused class). With `tenants`
    ({order, held}: `sits_worker.tenancy.fair_share`), the requests of tenants in `order` go first, in its
    order, and a held tenant's do not ride."""
    keys = store.keys
    with translate_redis_errors():
        reply = store.scripts.lease_riders(
            keys=[keys.tickets, keys.ready(model_ref), keys.inflight(model_ref), keys.items, keys.attempts,
                  keys.waiting_requests(model_ref)],
            args=[ticket, now, now + lease_seconds, bucket, max_items, max_rows, max_tokens, window, lowest_level,
                  json.dumps(tenants) if tenants is not None else "", keys.request("")],
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
    """The items of a lease script's reply ({-1}: the ticket was replaced)."""
    count = int(reply[0])
    if count < 0:
        raise StaleTicket(ticket)
    items = []
    for i in range(count):
        item_id, payload, attempts, inputs = reply[1 + LEASED_FIELDS * i : 1 + LEASED_FIELDS * (i + 1)]
        items.append(LeasedItem(item_id, model_ref, decode_payload(payload), int(attempts),
                                inputs=inputs))
    return items


@dataclass
class LeaseNotes:
    """What a lease tells beside its items (`lease_batch`)."""

    absent: list[str] = field(default_factory=list)
    """The ranked tenants a fair scan that read every item within reach found no item of."""
    paused: bool = False
    """Nothing was leased because the items within reach were all of a paused class."""


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
