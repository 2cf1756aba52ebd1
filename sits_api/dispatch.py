"""Sending work to the workers: Celery tasks by name, never by importing the worker package."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from broker import queues
from broker.config import Settings
from broker.store import Store
from broker.wakeup import ticket_target

TASK_QUEUE = "sits"


class Dispatcher:
    """A light Celery client that publishes SITS tasks by name."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self._celery = Celery("sits-api", broker=settings.redis.url)
        self._celery.conf.update(task_default_queue=TASK_QUEUE, broker_connection_retry_on_startup=True,
                                 task_send_sent_event=True, task_ignore_result=True)
        self._target, self._target_read_at = 1, float("-inf")

    def send(self, name: str, *args: Any) -> None:
        """Publish task `name` with `args`."""
        self._celery.send_task(name, args=list(args), queue=TASK_QUEUE)

    def wake_workers(self, now: Callable[[], float] = time.time) -> int:
        """Top batch tickets up to one per live stream slot; each new ticket is one drain task.

        The slot count (every worker's heartbeat) is re-read at most once a second: it changes
        only when workers come and go, and this runs on every submission.
        """
        moment = now()
        if moment - self._target_read_at > 1.0:
            self._target = ticket_target(self.store, now=moment,
                                         heartbeat_timeout=self.settings.scheduler.worker_heartbeat_timeout)
            self._target_read_at = moment
        new = queues.top_up_tickets(self.store, now=moment, target=self._target)
        for ticket in new:
            self.send("sits.drain", ticket)
        return len(new)
