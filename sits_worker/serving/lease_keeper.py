"""Keeps the leases of long runs alive while ONNX Runtime holds the thread.

A job chunk extends its own lease between its mini-batches (`between_minibatches.BetweenBatches`), but a batch
of online requests is one `session.run`: a run longer than `scheduler.lease_timeout` (a large
request body on a large model, on a CPU) would be taken back by the reaper while it still runs,
leased again by another stream (a second run of the same rows), and after `jobs.max_attempts`
such rounds failed as if its workers had died. So each run registers what it holds here for its
duration, and one thread per worker process extends the leases (and touches the ticket) of every
run that has held them for a quarter of the lease since the last extension. Registering costs a
lock and a dict entry, so short runs (nearly all of them) cost no Redis round trip and no thread.
A run held for `MAX_LEASES_HELD` leases (and at least `MIN_HELD_SECONDS`) is no longer extended: a run
that hangs (a driver that never returns) then goes back to the reaper, which retries its items elsewhere
and in the end fails them, instead of holding them and its ticket for ever.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from broker.errors import SitsError
from broker.queueing import leases
from broker.queueing.leases import LeasedItem
from broker.state.store import Store

log = logging.getLogger(__name__)

MAX_LEASES_HELD = 10
"""Leases' worth of time (10 min at the default 60 s) after which a run's leases are no longer extended."""

MIN_HELD_SECONDS = 60.0
"""The least time a run's leases are extended, however short the lease: a short lease is there to find a
dead worker soon, not to cut a slow run on a loaded machine short."""


@dataclass
class _Held:
    items: Sequence[LeasedItem]
    ticket: str
    held_since: float
    """`time.monotonic()` when the run registered."""
    extended_at: float
    """`time.monotonic()` of the lease or of its last extension."""


class LeaseKeeper:
    """Extends the leases of the runs registered with `holding` every quarter of `lease_seconds`."""

    def __init__(self, store: Store, lease_seconds: float) -> None:
        self._store, self._lease_seconds = store, lease_seconds
        self._held: dict[int, _Held] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def holding(self, items: Sequence[LeasedItem], ticket: str = "") -> Iterator[None]:
        """Keep the leases of `items` (leased just now) and `ticket` alive until the block ends."""
        if not items and not ticket:
            yield
            return
        number = next(self._numbers)
        with self._lock:
            now = time.monotonic()
            self._held[number] = _Held(items, ticket, now, now)
            if self._thread is None:
                self._thread = threading.Thread(target=self._extend_forever, name="sits-lease-keeper", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._held[number]

    def extend_due(self) -> int:
        """Extend the leases of runs held for a quarter of the lease since their last extension; returns
        how many runs were extended. A lease the reaper already took back stays taken (`extend_lease`)."""
        now, lease = time.monotonic(), self._lease_seconds
        most = max(MAX_LEASES_HELD * lease, MIN_HELD_SECONDS)
        with self._lock:
            due = [held for held in self._held.values()
                   if now - held.extended_at >= lease / 4 and now - held.held_since < most]
            for held in due:
                held.extended_at = now
        for held in due:
            leases.extend_leases(self._store, held.items, held.ticket, now=time.time(),
                                 lease_seconds=self._lease_seconds)
        return len(due)

    def _extend_forever(self) -> None:
        while True:
            time.sleep(self._lease_seconds / 8)
            try:
                self.extend_due()
            except SitsError as err:  # Redis away: the next round tries again, the reaper decides meanwhile
                log.warning("could not extend the leases of long runs: %s", err)
            except Exception:  # (a keeper that died here would let every later long run lose its lease)
                log.exception("could not extend the leases of long runs; trying again next round")
