"""Waking workers: keep one batch ticket circulating per live stream slot.

The caller passes `send`, which publishes one Celery drain task for a ticket
id; the broker itself never imports Celery.
"""

from __future__ import annotations

from collections.abc import Callable

from broker.queueing import tickets, workers
from broker.state.store import Store

SendTicket = Callable[[str], None]


def ticket_target(store: Store, *, now: float, heartbeat_timeout: float) -> int:
    """How many tickets should circulate: one per live stream slot, at least one."""
    return max(1, workers.live_stream_slots(store, now=now, timeout=heartbeat_timeout))


def wake_workers(store: Store, send: SendTicket, *, now: float, heartbeat_timeout: float) -> int:
    """Top tickets up to the target and send one drain task per new ticket; returns how many were sent."""
    target = ticket_target(store, now=now, heartbeat_timeout=heartbeat_timeout)
    new = tickets.top_up_tickets(store, now=now, target=target)
    for ticket in new:
        send(ticket)
    return len(new)
