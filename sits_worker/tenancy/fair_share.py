"""The fair-share order a worker's leases follow: which tenant's work goes first, which one waits.

Each lease asks `FairShare.lease_option` for the order of the tenants (`broker.tenants.shares.fair_order`:
usage over guaranteed share, lowest first; past `guaranteed_share * limit` of the fleet, held) and
hands it to `lease_batch.lua`, which weighs the first `fair_share.window` waiting items by it. The
tenants' usage is read from Redis at most every `fair_share.usage_refresh` (after this worker's own
bills are flushed), the fleet's stream slots at most every second. Those reads happen on a refresher
thread, woken when they are due: a lease or a mini-batch boundary's look orders by what was read last
and waits for no usage read of its own (two round trips, 1-2 ms on a loaded host). Only the first order
reads them itself, and so does every order with `usage_refresh: 0`.

A tenant a full scan found no work of is left out of the model's scans a moment (`ABSENT_SECONDS`), and
longer while a view of the jobs, read on the same thread, shows it none of that model
(`ABSENT_JOBLESS_SECONDS`).

`batch_shares` gives the same order to a merged batch of online requests: its rows follow the tenants'
shares while more than one with a share is present on the model (`broker.tenants.batch_shares`).

Fair share applies only while some tenant has a guaranteed share; without one the queue's own order
(priority, deadlines, CP-Score) stands, as it did before tenants had records.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.config.settings import Settings
from broker.jobs.records import active_job_tenants
from broker.queueing import workers
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.batch_shares import BatchShares, ranked_shares
from broker.tenants.records import TenantTable
from broker.tenants.shares import TenantShare, Usage, fair_order
from sits_worker.tenancy.usage_meter import UsageMeter

ABSENT_SECONDS = 0.5
"""How long a tenant a full scan found no work of stays out of a model's fair order (`note_absent`): its
requests still get in at once (`returning_option`, `reclaim_option`), its job chunks wait at most this
long. Longer while it has no job of the model at all (`ABSENT_JOBLESS_SECONDS`)."""
ABSENT_JOBLESS_SECONDS = 10.0
"""How long such a tenant stays out while it ranks ahead of every tenant still in the order (its requests
are then leased first anyway: `returning_option`) and the worker's view of the jobs, read since the scan
and fresh, shows it no job of the model: it has no chunk to find, and each full scan of a queue of
thousands of another tenant's chunks costs milliseconds of Redis time. A job it submits ends this within
`JOBS_REFRESH_SECONDS` of being listed (from its first slice of chunks); the bound covers what the view
cannot see."""
JOBS_REFRESH_SECONDS = 0.25
"""How often the refresher reads which tenants have jobs of which model (`jobs.active_job_tenants`), while
a tenant may be taken for absent."""
JOBS_VIEW_FRESH_SECONDS = 0.5
"""How old that view may be and still keep a tenant out longer than `ABSENT_SECONDS`."""
JOBS_VIEW_MOST = 256
"""Past this many active jobs the view is not read (each read is a command per job, from every worker
four times a second): tenants taken for absent come back after `ABSENT_SECONDS`, as without it."""

SLOTS_REFRESH_SECONDS = 1.0
"""How long the fleet's live stream slots are reused before they are counted again."""
REFRESHER_IDLE_SECONDS = 10.0
"""How long the refresher thread waits for a wake-up before it ends (the next due read starts it again)."""

log = logging.getLogger(__name__)


class FairShare:
    """One worker process's view of the tenants' shares and usage. Thread-safe; `clock` for tests."""

    def __init__(self, store: Store, settings: Settings, meter: UsageMeter,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._settings = settings.fair_share
        self._heartbeat_timeout = settings.scheduler.worker_heartbeat_timeout
        self._meter = meter
        self._clock = clock
        self.table = TenantTable(settings.tenants)
        self._lock = threading.Lock()
        self._usage: dict[str, Usage] = {}
        self._usage_at = float("-inf")
        self._slots = 1
        self._slots_at = float("-inf")
        self.holding = False
        """Whether the last order held a tenant back (the drain loop then polls less often)."""
        self._absent: dict[tuple[str, str], float] = {}
        """(Model ref, tenant) -> when a full scan of the model's queue last found no work of the tenant."""
        self._absent_last = float("-inf")
        """When a tenant was last taken for absent anywhere."""
        self._job_tenants: dict[str, set[str]] = {}
        """Model ref -> the tenants with a job of it, as last read (`jobs.active_job_tenants`)."""
        self._job_records: dict[str, tuple[str, str]] = {}
        """Job id -> (model ref, tenant): what the view's reads already know (the refresher's only)."""
        self._view_at = float("-inf")
        """When the read that gave `_job_tenants` began."""
        self._view_started_at = float("-inf")
        """When the last read of the view was started (due again `JOBS_REFRESH_SECONDS` later)."""
        self._returning_missed: dict[str, float] = {}
        """Model ref -> when a lease of returning tenants' requests (`returning_option`) last found none."""
        self._view_lock = threading.Lock()
        self._refresh_due = threading.Event()
        self._refresher: threading.Thread | None = None
        self._warned_at = float("-inf")

    def lease_option(self, model_ref: str | None = None) -> dict[str, Any] | None:
        """The `tenants` option of `lease_batch.lua` ({order, held, window}), or None: no fair share. For
        `model_ref`, the tenants a full scan of its queue just found no work of are left out of `order`
        for `ABSENT_SECONDS` (longer while they have no job of it: `_absent_from`): they rank after the
        others, so the next scans stop early instead of reading the whole window for them every lease.
        Their requests still get in: the next lease of a free slot looks for them first while they rank
        ahead of every present tenant (`returning_option`), and so does the next mini-batch boundary of
        a running chunk (`reclaim_option`)."""
        ranked = self._order()
        if ranked is None:
            return None
        order, held = ranked
        if model_ref is not None:
            gone = self._absent_from(model_ref, order)
            order = [name for name in order if name not in gone]
        return {"order": order, "held": sorted(held), "window": self._settings.window}

    def batch_shares(self) -> BatchShares | None:
        """The `shares` option of `lease_batch.lua` and `lease_riders.lua`: the tenants with a share in the fair
        order, the held left out, and `fair_share.present_for` (the lease sets its own `in_flight_for`:
        `sits_worker.serving.leasing.share_option`); None: no fair share."""
        ranked = self._order()
        if ranked is None:
            return None
        order, held = ranked
        guaranteed = {name: share.guaranteed_share for name, share in self._with_shares().items()}
        return BatchShares(ranked_shares(order, held, guaranteed), self._settings.present_for)

    def returning_option(self, model_ref: str) -> dict[str, Any] | None:
        """The `tenants` option that leases only the online requests of the tenants `lease_option` leaves out
        of `model_ref`'s order as absent and that rank above every tenant still in it, or None: there are
        none. A tenant a scan found no work of that comes back with a request would otherwise wait for the
        next mini-batch boundary of a running chunk; a requests-only lease finds its request among the
        model's waiting requests without reading the queue (`lease_batch.lua`). Such a tenant had no work
        in the queue moments ago, so its new requests are all it has: they go first, as the full order says.
        None too for half the shortest preemption target after such a lease found nothing
        (`note_returning_missed`)."""
        with self._lock:  # (on every lease that finds requests waiting: no order computed while nobody is absent)
            if not self._someone_absent(self._clock()):
                return None
        ranked = self._order()
        if ranked is None:
            return None
        order, held = ranked
        gone = self._absent_from(model_ref, order)
        returning = []
        for name in order:
            if name not in gone:
                break
            if name not in held:
                returning.append(name)
        with self._lock:
            missed_at = self._returning_missed.get(model_ref, float("-inf"))
        if not returning or self._clock() - missed_at < self._returning_pause():
            return None
        return {"order": returning, "held": [], "window": self._settings.window, "only": True}

    def note_returning_missed(self, model_ref: str) -> None:
        """A lease under `returning_option(model_ref)` found nothing: the next one waits half the shortest
        preemption target (each reads up to `fair_share.window` of the model's waiting requests, which a
        flood of another tenant's requests makes costly)."""
        with self._lock:
            self._returning_missed[model_ref] = self._clock()

    def _returning_pause(self) -> float:
        return min(self._half_targets(), default=ABSENT_SECONDS)

    def _absent_from(self, model_ref: str, order: list[str]) -> set[str]:
        """The tenants a full scan of `model_ref`'s queue found no work of in the last `ABSENT_SECONDS`; and,
        up to `ABSENT_JOBLESS_SECONDS`, those of them at the head of `order` (ahead of every tenant still
        in it) that a fresh view of the jobs, read since their scan, shows no job of the model."""
        now = self._clock()
        with self._lock:
            marks = {name: at for (ref, name), at in self._absent.items() if ref == model_ref}
            view_at, with_jobs = self._view_at, self._job_tenants.get(model_ref, set())
        gone = {name for name, at in marks.items() if now - at < ABSENT_SECONDS}
        for name in order:
            if name in gone:
                continue
            if not _jobless_since(marks.get(name), view_at, name not in with_jobs, now=now):
                break
            gone.add(name)
        return gone

    def note_absent(self, model_ref: str, tenants: list[str]) -> None:
        """Tenants a full scan of `model_ref`'s queue found no work of (`lease_batch.lua`'s reply)."""
        now = self._clock()
        with self._lock:
            for name in tenants:
                self._absent[(model_ref, name)] = now
            if tenants:
                self._absent_last = now
            if len(self._absent) > 4096:  # (models and tenants come and go: forget the stale)
                self._absent = {key: at for key, at in self._absent.items() if now - at < ABSENT_JOBLESS_SECONDS}

    def reclaim_option(self, tenant: str) -> dict[str, Any] | None:
        """The `tenants` option that leases only the work of tenants ranking above `tenant` (none held):
        what a running chunk of `tenant` lets in at a mini-batch boundary, so that a tenant below its
        share gets its share back within its preemption target. None when no tenant ranks above it, or
        fair share is off."""
        ranked = self._order()
        if ranked is None:
            return None
        order, held = ranked
        with_shares = self._with_shares()
        above = order[:order.index(tenant)] if tenant in order else [name for name in order if name in with_shares]
        above = [name for name in above if name not in held]
        return {"order": above, "held": [], "window": self._settings.window, "only": True} if above else None

    def _with_shares(self) -> dict[str, TenantShare]:
        """The shares of the tenants that have one (fair share ranks them before every other)."""
        return {name: tenant.share() for name, tenant in self.table.tenants(self._store).items()
                if tenant.guaranteed_share > 0}

    def _order(self) -> tuple[list[str], set[str]] | None:
        """(The tenants in the order their work goes, those held), or None: no fair share now."""
        shares = self._with_shares() if self._settings.enabled else {}
        if not shares:
            self.holding = False
            return None
        now = self._clock()
        usage, slots = self._fresh(now)
        waiting = [*shares, *(name for name in usage if name not in shares)]
        order, held = fair_order(shares, usage, waiting, stream_slots=slots,
                                 half_life=self._settings.usage_half_life, now=now)
        self.holding = bool(held)
        return order, held

    def look_interval(self, interval: float) -> float:
        """How often a running job chunk looks for waiting online work between its mini-batches: every
        `interval` (`scheduler.yield_check_interval`), or sooner, every half of the smallest
        `preemption_target` of a tenant with a share, so that such a tenant's requests get a device
        within it: a look comes at a mini-batch boundary, so the wait is at most the look's interval
        plus the running mini-batch."""
        if not self._settings.enabled:
            return interval
        return min([interval, *self._half_targets()])

    def _half_targets(self) -> list[float]:
        """Half the `preemption_target` of each tenant with a share."""
        return [tenant.preemption_target / 2 for tenant in self.table.tenants(self._store).values()
                if tenant.guaranteed_share > 0]

    def _fresh(self, now: float) -> tuple[dict[str, Usage], int]:
        """The tenants' usage and the fleet's stream slots as last read. Read here only the first time (or
        at every call with `usage_refresh: 0`); when a read is due, the refresher thread is woken to do it
        and this call goes on with what it has."""
        with self._lock:
            known = self._usage_at > float("-inf")
            due = (now - self._usage_at >= self._settings.usage_refresh
                   or now - self._slots_at >= SLOTS_REFRESH_SECONDS
                   or (self._someone_absent(now) and now - self._view_started_at >= JOBS_REFRESH_SECONDS))
        if not known or self._settings.usage_refresh == 0:
            self._read(now)
        elif due:
            self._wake_refresher()
        with self._lock:
            return self._usage, self._slots

    def _read(self, now: float) -> None:
        """Read what is due: this worker's bills flushed, then every tenant's usage; the live stream slots;
        while some tenant is taken for absent, which tenants have active jobs."""
        with self._lock:
            usage_due = now - self._usage_at >= self._settings.usage_refresh
            slots_due = now - self._slots_at >= SLOTS_REFRESH_SECONDS
            jobs_due = self._someone_absent(now) and now - self._view_started_at >= JOBS_REFRESH_SECONDS
            if usage_due:
                self._usage_at = now
            if slots_due:
                self._slots_at = now
            if jobs_due:
                self._view_started_at = now
        if usage_due:
            self._meter.flush()
            usage = tenant_usage.read_usage(self._store)
            with self._lock:
                self._usage = usage
        if slots_due:
            slots = workers.live_stream_slots(self._store, now=now, timeout=self._heartbeat_timeout)
            with self._lock:
                self._slots = max(1, slots)
        if jobs_due:
            with self._view_lock:  # (one read at a time: its cache is shared)
                job_tenants = active_job_tenants(self._store, most=JOBS_VIEW_MOST, known=self._job_records)
            with self._lock:
                if job_tenants is None:
                    self._job_tenants, self._view_at = {}, float("-inf")
                elif now >= self._view_at:
                    self._job_tenants, self._view_at = job_tenants, now

    def _someone_absent(self, now: float) -> bool:
        """Whether a tenant may still be taken for absent somewhere (a mark under `ABSENT_JOBLESS_SECONDS`
        old); under the lock."""
        return now - self._absent_last < ABSENT_JOBLESS_SECONDS

    def _wake_refresher(self) -> None:
        with self._lock:  # (held until it is started: it ends under this lock, so no wake-up is lost)
            self._refresh_due.set()
            if self._refresher is None:
                refresher = threading.Thread(target=self._refresh_when_due, name="sits-fair-share-refresher",
                                             daemon=True)
                refresher.start()
                self._refresher = refresher

    def _refresh_when_due(self) -> None:
        """The refresher thread: a read each time it is woken; it ends after `REFRESHER_IDLE_SECONDS` without."""
        while True:
            self._refresh_due.wait(timeout=REFRESHER_IDLE_SECONDS)
            with self._lock:
                if not self._refresh_due.is_set():
                    self._refresher = None
                    return
                self._refresh_due.clear()
            try:
                self._read(self._clock())
            except Exception as err:  # (Redis away: the orders go on with what was read; the next due read retries)
                if time.monotonic() - self._warned_at >= REFRESHER_IDLE_SECONDS:
                    self._warned_at = time.monotonic()
                    log.warning("fair share: could not read the tenants' usage (%s); ordering by the last read "
                                "meanwhile", err)


def _jobless_since(mark: float | None, view_at: float, jobless: bool, *, now: float) -> bool:
    """Whether a tenant taken for absent at `mark` stays out longer: under `ABSENT_JOBLESS_SECONDS` since,
    and a view read after the mark, at most `JOBS_VIEW_FRESH_SECONDS` old, shows it `jobless`."""
    return (mark is not None and now - mark < ABSENT_JOBLESS_SECONDS and jobless and view_at >= mark
            and now - view_at < JOBS_VIEW_FRESH_SECONDS)
