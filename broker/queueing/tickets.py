"""Batch tickets and the doorbell: how workers are woken.

A bounded number of Celery "drain" tasks circulate, one per ticket (docs/concepts.md, "Ticket");
each one leases batches until no queue has work, then retires atomically with that check
(`release_ticket`), so an enqueue either is seen by a live ticket or tops up a new one. Idle slots
block on the doorbell, which every enqueue rings, so new work is leased without a Celery round trip.
"""

from __future__ import annotations

from broker.queueing.leases import StaleTicket
from broker.queueing.queues import queue_refs
from broker.state.replies import ReleaseReply
from broker.state.store import MIN_BLOCK_SECONDS, Store, translate_redis_errors


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
            released = ReleaseReply(int(store.scripts.release_ticket(
                keys=[keys.tickets, keys.queues_version, *(keys.ready(ref) for ref in refs)], args=[ticket, version])))
        if released is not ReleaseReply.SET_CHANGED:
            return released is ReleaseReply.RELEASED


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


def expire_lost_tickets(store: Store, *, now: float, ticket_timeout: float) -> int:
    """Drop tickets not seen for `ticket_timeout` (their worker died); the caller tops up replacements."""
    with translate_redis_errors():
        return int(store.client.zremrangebyscore(store.keys.tickets, "-inf", now - ticket_timeout))


def ticket_count(store: Store) -> int:
    """How many tickets circulate now."""
    with translate_redis_errors():
        return int(store.client.zcard(store.keys.tickets))
