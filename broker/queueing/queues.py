"""Queue operations: lease batches (late binding), acknowledge, reap expired leases, batch tickets.

Every state change is one Lua script, so an item is at every instant either
waiting (ready set), leased (in-flight set with a deadline) or gone because
its work is recorded. Time is passed in (`now`) so tests advance it.

Batch tickets are how workers are woken (docs/architecture.md, "The life of a job"): a bounded
number of Celery "drain" tasks circulate; each one leases batches until no
queue has work, then retires atomically with that check (`release_ticket`),
so an enqueue either is seen by a live ticket or tops up a new one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from broker.models.registry import split_model_ref
from broker.state.store import MIN_BLOCK_SECONDS, Store, translate_redis_errors


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


def queue_heads(store: Store) -> dict[str, float]:
    """Model ref -> score of its best waiting item, for every queue with waiting work (a one-off read;
    drain loops keep a `QueueWatcher`)."""
    return QueueWatcher(store).snapshot().heads


@dataclass
class LeaseNotes:
    """What a lease tells beside its items (`lease_batch`)."""

    absent: list[str] = field(default_factory=list)
    """The ranked tenants a fair scan that read every item within reach found no item of."""
    paused: bool = False
    """Nothing was leased because the items within reach were all of a paused class."""


@dataclass(frozen=True)
class QueueSnapshot:
    """What a drain loop looks at before it chooses its next batch, read in one round trip."""

    heads: dict[str, float]
    """Model ref -> score of its best waiting item, for every queue with waiting work."""
    earliest_deadlines: dict[str, float]
    """Model ref -> the earliest deadline among its waiting items that have one (the PSA index)."""
    raw_policy: str
    """The live policy JSON ('' for the defaults)."""
    head_items: dict[str, str] = field(default_factory=dict)
    """Model ref -> id of its best waiting item (the one `heads` scores)."""
    waiting_requests: dict[str, int] = field(default_factory=dict)
    """Model ref -> how many online requests wait in its queue (`keys.waiting_requests`), for every
    queue with waiting work."""
    unclaimed_rings: bool = False
    """The doorbell held rings since the last snapshot (which empties it): no drain loop was blocked on it
    when they came, so no slot of the fleet sat idle then (an idle one would have taken the ring at once)."""


def queue_refs(store: Store) -> tuple[list[str], str]:
    """The model refs in the set of queues, sorted, and the set's version ('' before it had one), read
    atomically: a call that gets that version back knows it was given every ref."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=True)
        pipe.smembers(store.keys.queues)
        pipe.get(store.keys.queues_version)
        members, version = pipe.execute()
    return sorted(members), version or ""


class QueueWatcher:
    """Reads `QueueSnapshot`s for one process's drain loops.

    The set of model refs with a queue changes seldom (a model's first item, a pruned older
    version), so it is kept between reads and re-read only when its version, read in the same
    round trip as the queue heads, says it changed.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._known: tuple[list[str], str | None] = ([], None)
        """(The refs, the set's version they were read at: None before the first read), one value,
        so that the drain threads sharing the watcher never pair one read's refs with another's version."""

    def snapshot(self) -> QueueSnapshot:
        """Every queue's head, earliest deadline, and the live policy, as of one instant (one script
        call: as a pipeline of commands it cost a quarter more client CPU)."""
        keys = self._store.keys
        rung = False  # (a read again for a new set of refs finds the doorbell emptied by the first)
        with translate_redis_errors():
            while True:
                refs, known_version = self._known
                per_ref = [key for ref in refs
                           for key in (keys.ready(ref), keys.deadlines(ref), keys.waiting_requests(ref))]
                version, raw_policy, unclaimed, *firsts = self._store.scripts.queue_snapshot(
                    keys=[keys.queues_version, keys.policy, keys.doorbell, *per_ref])
                rung = rung or bool(unclaimed)
                if version == known_version:
                    break
                self._known = queue_refs(self._store)
        heads, head_items, deadlines, waiting = {}, {}, {}, {}
        for ref, head_item, head_score, earliest, requests in zip(refs, firsts[0::4], firsts[1::4], firsts[2::4],
                                                                  firsts[3::4], strict=True):
            if head_item:
                heads[ref], head_items[ref], waiting[ref] = float(head_score), head_item, int(requests)
            if earliest:
                deadlines[ref] = float(earliest)
        return QueueSnapshot(heads=heads, earliest_deadlines=deadlines, raw_policy=raw_policy,
                             head_items=head_items, waiting_requests=waiting, unclaimed_rings=rung)


def head_company(store: Store, model_ref: str, *, now: float, window: int,
                 enough: int) -> tuple[int, float] | None:
    """(Rows that could join the head's batch, seconds the head has waited) when the head of
    `model_ref`'s queue is an online request, else None: the rows of the requests of its shape
    bucket among the first `window` waiting items, its own included, counted until they reach
    `enough` (`head_company.lua`)."""
    with translate_redis_errors():
        reply = store.scripts.head_company(keys=[store.keys.ready(model_ref), store.keys.items],
                                           args=[window, enough])
    if not reply:
        return None
    rows, enqueued_at = reply
    return int(rows), now - float(enqueued_at)


def queue_depths(store: Store, *, with_requests: bool = False) -> dict[str, dict[str, int]]:
    """Model ref -> {"ready": n, "inflight": n} for every known queue; `with_requests` adds "requests":
    the online requests among the ready items (`keys.waiting_requests`, what `max_queue_size` counts)."""
    names = ("ready", "inflight", "requests") if with_requests else ("ready", "inflight")
    with translate_redis_errors():
        refs = sorted(store.client.smembers(store.keys.queues))
        pipe = store.client.pipeline(transaction=False)
        for ref in refs:
            pipe.zcard(store.keys.ready(ref))
            pipe.zcard(store.keys.inflight(ref))
            if with_requests:
                pipe.zcard(store.keys.waiting_requests(ref))
        counts = pipe.execute()
    step = len(names)
    return {ref: dict(zip(names, counts[step * i:step * (i + 1)], strict=True)) for i, ref in enumerate(refs)}


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


@dataclass(frozen=True)
class ReapResult:
    """What one reaper pass did."""

    returned: int
    dead_items: list[tuple[str, str, dict[str, Any]]]
    """(model ref, item id, payload) of items that used up their attempts."""
    lost: list[tuple[str, str, dict[str, Any], float | None]] = field(default_factory=list)
    """(model ref, item id, payload, when it is queued again: None for now) of the leases that
    expired because their worker was lost (not those parked for a retry, nor those gone dead)."""


def reap_expired_leases(store: Store, *, now: float, max_attempts: int, limit: int = 1000,
                        lost_delays: Sequence[float] = ()) -> ReapResult:
    """Return every expired lease to its queue, or to the dead set after `max_attempts` lost leases;
    items parked for a retry whose backoff has passed go back too (`reap_leases.lua`). `lost_delays`:
    the wait after the n-th lost lease of an item before it is queued again (none: at once)."""
    keys = store.keys
    returned = 0
    lost: list[tuple[str, str, dict[str, Any], float | None]] = []
    with translate_redis_errors():
        for ref in sorted(store.client.smembers(keys.queues)):
            back, _, *lost_pairs = store.scripts.reap_leases(
                keys=[keys.inflight(ref), keys.ready(ref), keys.items, keys.attempts, keys.dead,
                      keys.waiting_requests(ref), keys.retrying(ref)],
                args=[now, max_attempts, limit, json.dumps([float(delay) for delay in lost_delays])],
            )
            returned += int(back)
            if lost_pairs:
                payloads = store.client.hmget(keys.items, lost_pairs[0::2])
                lost += [(ref, item_id, decode_payload(payload), float(at) if at else None)
                         for item_id, at, payload in zip(lost_pairs[0::2], lost_pairs[1::2], payloads, strict=True)]
        dead_ids = store.client.zrange(keys.dead, 0, limit - 1)
        dead_items = []
        for item_id in dead_ids:
            payload = store.client.hget(keys.items, item_id)
            decoded = decode_payload(payload)
            dead_items.append((decoded.get("model_ref", ""), item_id, decoded))
    return ReapResult(returned=returned, dead_items=dead_items, lost=lost)


def top_up_tickets(store: Store, *, now: float, target: int) -> list[str]:
    """Ring the doorbell, then create tickets until `target` circulate; returns the new ids, each to be
    sent as a drain task."""
    with translate_redis_errors():
        new = store.scripts.top_up_tickets(keys=[store.keys.tickets, store.keys.ticket_seq, store.keys.doorbell],
                                           args=[now, target])
    return [str(ticket) for ticket in new]


def release_ticket(store: Store, ticket: str) -> bool:
    """Retire `ticket` if no queue has waiting work; False means work waits and draining goes on."""
    keys = store.keys
    while True:
        refs, version = queue_refs(store)
        with translate_redis_errors():
            released = int(store.scripts.release_ticket(
                keys=[keys.tickets, keys.queues_version, *(keys.ready(ref) for ref in refs)], args=[ticket, version]))
        if released >= 0:
            return released == 1


def prune_old_queues(store: Store) -> list[str]:
    """Take every empty queue of a model version that is not its model's latest out of the set of
    queues (a reaper pass calls it); returns the refs taken out. Whatever queues an item for one of
    them again puts it back. The latest version's queue stays, however empty: its set entry would
    come and go with every idle spell, and every drain loop would read the set again each time."""
    with translate_redis_errors():
        refs = store.client.smembers(store.keys.queues)
        latest = store.client.hgetall(store.keys.model_latest)
        pruned = []
        for ref in sorted(refs):
            name, version = split_model_ref(ref)
            if version is None or version == latest.get(name):
                continue
            if store.scripts.prune_queue(keys=[store.keys.queues, store.keys.queues_version, store.keys.ready(ref),
                                               store.keys.inflight(ref)], args=[ref]):
                pruned.append(ref)
    return pruned


def wait_for_doorbell(store: Store, ticket: str, *, now: float, timeout: float, touch: bool = True) -> bool:
    """Block up to `timeout` seconds until an enqueue rings the doorbell (True) while `ticket` lingers.

    A lingering ticket keeps its drain task alive for a moment after the queues ran dry, so the next
    request is leased at once instead of waiting for a fresh Celery task (a publish on the API side
    and a delivery on the worker side, the largest per-request costs before). With `touch` the
    ticket is marked seen first, so the reaper does not take it for lost (StaleTicket when it was
    replaced meanwhile); the caller touches now and then, not on every wait.
    """
    with translate_redis_errors():
        if touch:
            pipe = store.client.pipeline(transaction=False)
            pipe.zscore(store.keys.tickets, ticket)
            pipe.zadd(store.keys.tickets, {ticket: now}, xx=True)
            seen, _ = pipe.execute()
            if seen is None:
                raise StaleTicket(ticket)
        return store.client.blpop([store.keys.doorbell], timeout=max(timeout, MIN_BLOCK_SECONDS)) is not None


def ring_doorbell(store: Store) -> None:
    """Ring the doorbell once, as an enqueue does (`lib.lua`: at most 64 rings are kept)."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.lpush(store.keys.doorbell, "1")
        pipe.ltrim(store.keys.doorbell, 0, 63)
        pipe.execute()


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


def expire_lost_tickets(store: Store, *, now: float, ticket_timeout: float) -> int:
    """Drop tickets not seen for `ticket_timeout` (their worker died); the caller tops up replacements."""
    with translate_redis_errors():
        return int(store.client.zremrangebyscore(store.keys.tickets, "-inf", now - ticket_timeout))


def ticket_count(store: Store) -> int:
    """How many tickets circulate now."""
    with translate_redis_errors():
        return int(store.client.zcard(store.keys.tickets))
