"""Sending work to the workers: Celery tasks by name, never by importing the worker package."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import kombu.exceptions
from celery import Celery

from broker.config.settings import Settings
from broker.errors import ConnectionLost, SitsError, StoreFull
from broker.failures.breaker import BreakerView
from broker.queueing import tickets, workers
from broker.state.sentinel import celery_broker
from broker.state.store import Store, out_of_memory

log = logging.getLogger(__name__)


class Dispatcher:
    """A light Celery client that publishes SITS tasks by name."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        broker_url, transport_options = celery_broker(settings.redis.url, settings.redis.sentinel_master,
                                                      sentinel_auth=settings.redis.sentinel_auth)
        self._celery = Celery("sits-api", broker=broker_url)
        self._queue = settings.redis.task_queue
        self._celery.conf.update(task_default_queue=self._queue, broker_connection_retry_on_startup=True,
                                 task_send_sent_event=True, task_ignore_result=True,
                                 broker_transport_options=transport_options)
        self._slots, self._slots_read_at = 0, float("-inf")
        self.breakers = BreakerView(store, settings.breaker, settings.scheduler.worker_heartbeat_timeout)
        """Fails a request fast when its model's breakers are open on every live worker."""

    def send(self, name: str, *args: Any, queue: str | None = None) -> None:
        """Publish task `name` with `args` (to the workers' queue, or `queue`); a Redis that refuses the message
        is a retryable error (503): StoreFull at maxmemory, else ConnectionLost."""
        try:
            self._celery.send_task(name, args=list(args), queue=queue or self._queue)
        except kombu.exceptions.OperationalError as err:
            if out_of_memory(err):
                raise StoreFull(f"Redis is full (it reached maxmemory): task {name} could not be sent; retry once "
                                "finished jobs and results have expired, or give Redis more memory") from err
            raise ConnectionLost(f"task {name} could not be sent to the workers ({err}); retry") from err

    def ticket_target(self, now: float) -> int:
        """How many tickets should circulate: one per live stream slot, at least one."""
        return max(1, self.live_slots(now))

    def live_slots(self, now: float) -> int:
        """The live workers' stream slots (0 when none is alive).

        Re-read from the workers' heartbeats at most once a second: it changes only when workers
        come and go, and the submit hot path asks on every request (a full queue's 429 too).
        """
        if now - self._slots_read_at > 1.0:
            self._slots = workers.live_stream_slots(self.store, now=now,
                                                    timeout=self.settings.scheduler.worker_heartbeat_timeout)
            self._slots_read_at = now
        return self._slots

    def send_tickets(self, tickets: list[str]) -> None:
        """One drain task per new ticket. One that cannot be sent is left to the reaper, which replaces a
        ticket no task carries within `scheduler.ticket_timeout`: the work that woke it is queued already,
        and failing its call now would have its client submit it twice."""
        for ticket in tickets:
            try:
                self.send("sits.drain", ticket)
            except SitsError as err:
                log.warning("could not send a drain task for ticket %s (%s); the reaper replaces it", ticket,
                            err.message)

    def wake_workers(self, now: Callable[[], float] = time.time) -> int:
        """Ring the doorbell and top batch tickets up to one per live stream slot; each new ticket is one
        drain task."""
        moment = now()
        new = tickets.top_up_tickets(self.store, now=moment, target=self.ticket_target(moment))
        self.send_tickets(new)
        return len(new)
