"""Each worker process's reaper thread: the reaper pass never waits for a free stream slot.

The pass (`drain_loop.reap`: expired leases back to their queue, poison items failed, lost tickets
replaced, stalled job fills completed, the owner-index backfill) used to be a Celery beat task. It
ran on the worker's threads pool, whose threads are the stream slots, so while every stream of
every worker ran a long batch, a dead worker's expired leases waited for one of those batches to
end. So every worker process runs the pass on a thread of its own, started at `worker_ready` beside
the heartbeat, like the lease keeper's thread; its Redis commands go on a connection of its own
(`broker.state.store.Store` holds one per thread).

With several workers, one pass per `scheduler.reap_interval` is enough: a worker passes only while
it holds the turn (`workers.take_reaper_turn`), which it renews at each tick and which lasts
`TURN_INTERVALS` intervals, so another worker takes over once its holder has stopped ticking. The
turn only saves work: every step of the pass is idempotent (an expired lease is returned once, an
index entry added once, a job counted once), so a pass that outlasts its interval may run beside
the next, as two beat tasks could before. A worker does its first pass soon after it starts, at a
random point of its first interval (at most `FIRST_PASS_WITHIN_SECONDS` in), so that workers
started together do not all ask at once. A pass that fails (Redis away, or a bug) is logged and
tried again at the next interval: the thread never dies of it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from broker.errors import SitsError
from broker.queueing import workers
from broker.queueing.wakeup import SendTicket
from broker.state.store import Store
from sits_worker.context import WorkerContext
from sits_worker.drain_loop import reap

log = logging.getLogger(__name__)

TURN_INTERVALS = 2.5
"""How many intervals the turn lasts after its holder's last tick: a holder late by a GIL wait or a
long pass keeps it, and a dead or frozen one hands it over within about two intervals."""

FIRST_PASS_WITHIN_SECONDS = 1.0
"""A worker's first pass comes at a random point within this (or its interval, if shorter)."""

MIN_INTERVAL_SECONDS = 0.05
"""The shortest interval the thread ticks at (as `scheduler.reap_interval` allows)."""


class Reaper:
    """Runs `run_pass(now)` every `interval` seconds on a thread of its own, each time this worker
    (`holder`) takes the reaper turn."""

    def __init__(self, store: Store, holder: str, interval: float, run_pass: Callable[[float], object]) -> None:
        self._store, self._holder = store, holder
        self._interval = max(interval, MIN_INTERVAL_SECONDS)
        self._run_pass = run_pass
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, now: float) -> bool:
        """One pass unless another worker holds the turn; returns whether it ran. Errors
        (`ConnectionLost` when Redis is away) pass up to the caller."""
        if not workers.take_reaper_turn(self._store, self._holder, hold_seconds=TURN_INTERVALS * self._interval):
            return False
        self._run_pass(now)
        return True

    def start(self, first_delay: float | None = None) -> None:
        """Start the thread; its first pass comes after `first_delay` seconds (default: a random point
        of the first interval, at most `FIRST_PASS_WITHIN_SECONDS` in)."""
        if self.running:
            return
        if first_delay is None:
            first_delay = random.uniform(0.0, min(self._interval, FIRST_PASS_WITHIN_SECONDS))
        self._stop.clear()
        self._thread = threading.Thread(target=self._pass_forever, args=(first_delay,), name="sits-reaper",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread, waiting up to `timeout` seconds for a pass in progress to end; True once
        it has ended (a daemon thread: one still in a pass does not hold the process up)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    @property
    def running(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _pass_forever(self, first_delay: float) -> None:
        next_at = time.monotonic() + first_delay
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            try:
                self.run_once(time.time())
            except SitsError as err:  # Redis away: the next interval tries again
                log.warning("reaper pass failed, trying again in %.1f s: %s", self._interval, err)
            except Exception:  # a bug in one pass must not end recovery for the life of the worker
                log.exception("reaper pass failed, trying again in %.1f s", self._interval)
            # A pass that outlasted the interval is followed by the next at once, not by a burst.
            next_at = max(next_at + self._interval, time.monotonic())


def worker_reaper(ctx: WorkerContext, send: SendTicket, *, holder: str) -> Reaper:
    """The reaper of a worker process: the full pass (`drain_loop.reap`) over its context, every
    `scheduler.reap_interval`, under its name `holder`; `send` publishes a replacement ticket's task."""
    return Reaper(ctx.store, holder, ctx.settings.scheduler.reap_interval,
                  lambda now: reap(ctx, send, now=now))
