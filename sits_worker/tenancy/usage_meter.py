"""Billing a worker's runs to the tenants in them, for fair share and chargeback.

A run is billed inside a `billing` scope that names the work in it (each tenant's rows, requests and
queue time): `WorkerContext.run` adds every run's measured seconds to the scope of its thread, and
the scope's end splits them over its tenants by rows (`broker.tenants.shares.attribute`, exact: the
parts sum to the seconds measured). Parts wait in memory and go to Redis in one call
(`broker.tenants.usage.note_usage`) at most every `fair_share.usage_refresh`, so a run costs no extra
round trip. A scope that finds a flush due wakes this meter's flusher thread to write it, so no
request waits for a bill before its result is stored; the drain loop's fair-share order and the
heartbeat flush what waits too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.shares import attribute
from broker.tenants.usage import BillEntry

log = logging.getLogger(__name__)

MAX_PENDING = 4096
"""Entries kept while Redis is away; past it the oldest are dropped (and logged)."""

FLUSHER_IDLE_SECONDS = 5.0
"""The flusher thread ends after this long without a flush due; the next due flush starts it again."""


@dataclass(frozen=True)
class Work:
    """One tenant's part of a run's work: its rows, by whose key, and (for online requests) how many
    requests and how long they waited in the queue."""

    tenant: str
    owner: str
    rows: int
    requests: int = 0
    queue_seconds: float = 0.0


@dataclass
class _Scope:
    model_ref: str
    work: Sequence[Work]
    seconds: float = 0.0
    rerun: bool = False
    """Runs again of work already billed (a merged batch split to find a bad request): only their seconds
    are billed, not their rows, requests or queue time a second time."""


class UsageMeter:
    """This worker process's bills not yet in Redis. Thread-safe; `clock` is passed in for tests."""

    def __init__(self, store: Store, *, device_kind: str, half_life: float, flush_every: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._device = device_kind
        self._half_life = half_life
        self._flush_every = flush_every
        self._clock = clock
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str, bool], BillEntry] = {}
        self._flushed_at = float("-inf")
        self._flush_lock = threading.Lock()
        """Held by a flush from taking the entries to writing them: a flush called meanwhile waits for that
        write, so what was billed before it is in Redis when it returns (fair share reads usage after one)."""
        self._flush_due = threading.Event()
        self._flusher: threading.Thread | None = None

    @contextlib.contextmanager
    def billing(self, model_ref: str, work: Sequence[Work], *, rerun: bool = False) -> Iterator[None]:
        """Bill the runs of this thread within the block to `work`'s tenants (a block within another's
        bills its own runs to its own `work` alone); with `rerun`, the seconds alone (see `_Scope.rerun`)."""
        scopes = self._scopes()
        scope = _Scope(model_ref, [part for part in work if part.tenant], rerun=rerun)
        scopes.append(scope)
        try:
            yield
        finally:
            scopes.pop()
            if scope.seconds > 0 and scope.work:
                self._add(scope)

    def charge(self, model_ref: str, work: Sequence[Work], seconds: float) -> None:
        """Charge `seconds` to `work`'s tenants, split by rows, in the usage fair share ranks by alone: what
        presence costs (docs/tenants.md, "What presence costs"): a stream slot's wait held for a tenant's next
        call, and the estimated run of requests leased and not run. Nothing ran, so it is on no bill (bills
        hold measured device time); but the device was kept for them, and a tenant must not keep the first
        rank, holding the others back, for free."""
        rows_by_tenant: dict[str, float] = {}
        for part in work:
            if part.tenant:
                rows_by_tenant[part.tenant] = rows_by_tenant.get(part.tenant, 0) + part.rows
        if seconds <= 0 or not rows_by_tenant:
            return
        with self._lock:
            for tenant, part_seconds in attribute(seconds, rows_by_tenant).items():
                self._merge(BillEntry(tenant, "", model_ref, self._device, part_seconds, 0, billed=False))
            due = self._clock() - self._flushed_at >= self._flush_every
        if due:
            self._wake_flusher()

    def add_run(self, seconds: float) -> None:
        """Count a run's measured seconds on this thread's innermost scope (none: the run is not billed)."""
        scopes = self._scopes()
        if scopes:
            scopes[-1].seconds += seconds

    def flush(self) -> None:
        """Write what waits, in one call; kept for the next flush when Redis is away. Returns once what was
        billed before the call is written (or kept), a write another thread had begun included."""
        with self._flush_lock:
            with self._lock:
                entries, self._pending = list(self._pending.values()), {}
                self._flushed_at = self._clock()
            if not entries:
                return
            try:
                tenant_usage.note_usage(self._store, entries, now=self._clock(), half_life=self._half_life)
            except Exception as err:
                log.warning("could not bill %d runs' device time to their tenants (kept for the next try): %s",
                            len(entries), err)
                with self._lock:
                    for entry in entries:
                        self._merge(entry)

    def _scopes(self) -> list[_Scope]:
        scopes = getattr(self._local, "scopes", None)
        if scopes is None:
            scopes = self._local.scopes = []
        return scopes

    def _add(self, scope: _Scope) -> None:
        rows_by_tenant: dict[str, float] = {}
        for part in scope.work:
            rows_by_tenant[part.tenant] = rows_by_tenant.get(part.tenant, 0) + part.rows
        seconds_by_tenant = attribute(scope.seconds, rows_by_tenant)
        tenant_rows = {tenant: rows for tenant, rows in rows_by_tenant.items() if rows} or rows_by_tenant
        with self._lock:
            for part in scope.work:
                # each tenant's seconds split again over its keys, by rows (a tenant of one key: all of it)
                weight = part.rows / tenant_rows[part.tenant] if tenant_rows.get(part.tenant) else 1.0
                counted = (0, 0, 0.0) if scope.rerun else (part.rows, part.requests, part.queue_seconds)
                self._merge(BillEntry(part.tenant, part.owner, scope.model_ref, self._device,
                                      seconds_by_tenant.get(part.tenant, 0.0) * weight, *counted))
            due = self._clock() - self._flushed_at >= self._flush_every
        if due:
            self._wake_flusher()

    def _wake_flusher(self) -> None:
        with self._lock:  # (held until it is started: it ends under this lock, so no wake-up is lost)
            self._flush_due.set()
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_when_due, name="sits-usage-flusher", daemon=True)
                self._flusher.start()

    def _flush_when_due(self) -> None:
        """The flusher thread: a flush each time it is woken; it ends after `FLUSHER_IDLE_SECONDS` without
        (or on an error no flush expects: the next due flush starts a new one)."""
        try:
            while True:
                self._flush_due.wait(timeout=FLUSHER_IDLE_SECONDS)
                with self._lock:
                    if not self._flush_due.is_set():
                        return
                    self._flush_due.clear()
                self.flush()  # (logs and keeps the entries when Redis is away)
        finally:
            with self._lock:
                self._flusher = None

    def _merge(self, entry: BillEntry) -> None:
        """Add `entry` to what waits (under the lock)."""
        key = (entry.tenant, entry.owner, entry.model, entry.billed)
        held = self._pending.get(key)
        if held is None:
            if len(self._pending) >= MAX_PENDING:
                dropped = self._pending.pop(next(iter(self._pending)))
                log.warning("dropped a bill of %.3f device-seconds of tenant %s: Redis has been away too long",
                            dropped.seconds, dropped.tenant)
            self._pending[key] = entry
            return
        self._pending[key] = replace(held, seconds=held.seconds + entry.seconds, rows=held.rows + entry.rows,
                                     requests=held.requests + entry.requests,
                                     queue_seconds=held.queue_seconds + entry.queue_seconds)
