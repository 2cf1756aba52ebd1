"""Circuit breakers per (model version, worker): the pure decision, its record in Redis, and the
worker's board of its own breakers.

A breaker opens when more than `breaker.failure_rate` of a worker's runs of a model version in the
last `breaker.window` failed for a reason of the device (not a bad input row), once at least
`breaker.min_runs` ran; while open, that worker leases no batch of the model. After
`breaker.cool_down` it is half-open: one probe batch may run, and its first run closes it (success)
or opens it again (failure). The decision (`note_runs`, `state_at`, `may_lease`) is pure, the clock
passed in; each worker writes its own breakers' records (`keys.breakers`), which the API
and the other workers read. docs/failures.md describes the behaviour.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from broker.errors import RetryableError
from broker.failures.settings import BreakerSettings
from broker.queueing.workers import list_workers
from broker.state.store import Store, translate_redis_errors

log = logging.getLogger(__name__)

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
"""The value of each state in `sits_breaker_state`."""

COUNTED_CLASSES = frozenset({"transient", "device_oom", "run_timeout", "invalid_model"})
"""Failure classes a breaker counts: the device's or the run's, not a bad input (the client's fault)
nor a cancel."""

WINDOW_BUCKETS = 12
"""The window is counted in this many buckets: it slides by a twelfth of itself."""

FLUSH_SECONDS = 1.0
"""A worker writes a breaker's successful runs at most this often; failures, and any outcome while
half-open, at once."""


class ModelUnavailable(RetryableError):
    """Every live worker's breaker of the model version is open: the request was not queued. The API
    answers 503 with a `Retry-After` of `retry_after` seconds (until the soonest half-open)."""

    code = "model_unavailable"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


@dataclass(frozen=True)
class Breaker:
    """One breaker's state: what `note_runs` decides from, and what its record holds."""

    state: str = CLOSED
    since: float = 0.0
    """When it entered its state."""
    retry_at: float | None = None
    """Open: when it turns half-open."""
    probe_at: float | None = None
    """Half-open: when a worker slot took the probe batch (None: nobody has yet)."""
    buckets: tuple[tuple[int, int, int], ...] = ()
    """(bucket number, runs, failed runs) of the window, oldest first (closed only)."""
    last_error: str = ""
    """The last counted failure's message."""
    opened: int = 0
    """Times it opened."""

    def to_json(self) -> str:
        """Its record in `keys.breakers`."""
        return json.dumps({"state": self.state, "since": self.since, "retry_at": self.retry_at,
                           "probe_at": self.probe_at, "buckets": [list(b) for b in self.buckets],
                           "last_error": self.last_error, "opened": self.opened})

    @classmethod
    def from_json(cls, text: str) -> Breaker:
        """A breaker from its record (a closed one from a record that does not parse)."""
        try:
            data = json.loads(text)
            buckets = tuple((int(b[0]), int(b[1]), int(b[2])) for b in data["buckets"])
            return cls(state=str(data["state"]), since=float(data["since"]), retry_at=data.get("retry_at"),
                       probe_at=data.get("probe_at"), buckets=buckets, last_error=str(data.get("last_error", "")),
                       opened=int(data.get("opened", 0)))
        except (ValueError, KeyError, TypeError):
            return cls()


def _bucket_seconds(settings: BreakerSettings) -> float:
    return settings.window / WINDOW_BUCKETS


def window_counts(breaker: Breaker, settings: BreakerSettings, *, now: float) -> tuple[int, int]:
    """(Runs, failed runs) in the window that ends `now`, to a bucket (a twelfth of the window)."""
    oldest = math.floor(now / _bucket_seconds(settings)) - WINDOW_BUCKETS + 1
    kept = [bucket for bucket in breaker.buckets if bucket[0] >= oldest]
    return sum(b[1] for b in kept), sum(b[2] for b in kept)


def state_at(breaker: Breaker, *, now: float) -> str:
    """The breaker's state at `now`: an open one whose cool-down is over reads half-open (the clock
    turns it, no write needed)."""
    if breaker.state == OPEN and breaker.retry_at is not None and now >= breaker.retry_at:
        return HALF_OPEN
    return breaker.state


def _opened(breaker: Breaker, settings: BreakerSettings, error: str, now: float) -> Breaker:
    return Breaker(OPEN, since=now, retry_at=now + settings.cool_down, last_error=error or breaker.last_error,
                   opened=breaker.opened + 1)


def note_runs(breaker: Breaker, settings: BreakerSettings, *, runs: int, failures: int, now: float,
              error: str = "") -> Breaker:
    """The breaker after `runs` more runs of which `failures` failed (counted classes only), at `now`.

    Closed: the runs join the window; it opens when the window holds `min_runs` and more than
    `failure_rate` of them failed. Open: runs still in flight when it opened change nothing.
    Half-open: a failure opens it again for another `cool_down`, else a run closes it (the probe).
    """
    state = state_at(breaker, now=now)
    if state == OPEN or runs <= 0:
        return breaker
    if state == HALF_OPEN:
        if failures:
            return _opened(breaker, settings, error, now)
        return Breaker(CLOSED, since=now, last_error=breaker.last_error, opened=breaker.opened)
    number = math.floor(now / _bucket_seconds(settings))
    buckets = [bucket for bucket in breaker.buckets if bucket[0] > number - WINDOW_BUCKETS]
    if buckets and buckets[-1][0] == number:
        _, had_runs, had_failures = buckets.pop()
        buckets.append((number, had_runs + runs, had_failures + failures))
    else:
        buckets.append((number, runs, failures))
    counted = replace(breaker, buckets=tuple(buckets), last_error=error or breaker.last_error)
    total, failed = window_counts(counted, settings, now=now)
    if total >= settings.min_runs and failed / total > settings.failure_rate:
        return _opened(counted, settings, error, now)
    return counted


def may_lease(breaker: Breaker, settings: BreakerSettings, *, now: float) -> bool:
    """Whether the breaker's worker may lease a batch of its model now: closed; or half-open with no
    probe taken, or one taken a `cool_down` ago whose run never reported (its batch went back unrun)."""
    state = state_at(breaker, now=now)
    if state == CLOSED:
        return True
    if state == OPEN:
        return False
    return breaker.probe_at is None or now - breaker.probe_at >= settings.cool_down


def with_probe(breaker: Breaker, *, now: float) -> Breaker:
    """A half-open breaker whose probe batch a slot takes at `now`."""
    since = breaker.retry_at if breaker.state == OPEN and breaker.retry_at is not None else breaker.since
    return replace(breaker, state=HALF_OPEN, since=since, probe_at=now)


def unavailable_until(breakers: Iterable[Breaker | None], *, now: float) -> float | None:
    """When the soonest of these breakers (one per live worker; None: that worker has none, closed)
    turns half-open, if every one is open now; None when some worker may take the model's work, or
    when there is no worker at all (that is not a breaker's doing)."""
    soonest: float | None = None
    seen = False
    for breaker in breakers:
        seen = True
        if breaker is None or state_at(breaker, now=now) != OPEN or breaker.retry_at is None:
            return None
        soonest = breaker.retry_at if soonest is None else min(soonest, breaker.retry_at)
    return soonest if seen else None


def counts(failure_class: str) -> bool:
    """Whether a run failure of `failure_class` counts against its device's breaker."""
    return failure_class in COUNTED_CLASSES


# --- records in Redis ------------------------------------------------------------------


def _field(model_ref: str, worker: str) -> str:
    return f"{model_ref}|{worker}"


def read_breakers(store: Store) -> dict[tuple[str, str], Breaker]:
    """Every breaker record: (model ref, worker name) -> breaker."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.breakers)
    found = {}
    for name, text in raw.items():
        model_ref, _, worker = name.partition("|")
        found[(model_ref, worker)] = Breaker.from_json(text)
    return found


def describe(breaker: Breaker, settings: BreakerSettings, model_ref: str, worker: str, *, now: float
             ) -> dict[str, Any]:
    """A breaker as `/v1/status` shows it."""
    runs, failures = window_counts(breaker, settings, now=now)
    state = state_at(breaker, now=now)
    return {"model": model_ref, "worker": worker, "state": state,
            "since": breaker.retry_at if state != breaker.state else breaker.since,
            "retry_at": breaker.retry_at if state == OPEN else None, "runs": runs, "failures": failures,
            "opened": breaker.opened, "last_error": breaker.last_error or None}


def list_breakers(store: Store, settings: BreakerSettings, *, now: float, heartbeat_timeout: float
                  ) -> list[dict[str, Any]]:
    """The breakers of the workers Redis knows (`broker.queueing.workers.list_workers`), by model then worker;
    records of workers it forgot (stopped cleanly, or silent for long) are deleted."""
    known = {worker["name"] for worker in list_workers(store, now=now, timeout=heartbeat_timeout)}
    found = read_breakers(store)
    gone = [_field(model_ref, worker) for model_ref, worker in found if worker not in known]
    if gone:
        with translate_redis_errors():
            store.client.hdel(store.keys.breakers, *gone)
    return [describe(breaker, settings, model_ref, worker, now=now)
            for (model_ref, worker), breaker in sorted(found.items()) if worker in known]


class BreakerView:
    """What the API reads of the breakers to fail requests fast: the records and the live workers,
    read again at most once a second (the submit hot path asks on every request)."""

    def __init__(self, store: Store, settings: BreakerSettings, heartbeat_timeout: float,
                 max_age: float = 1.0) -> None:
        self._store, self._settings, self._timeout, self._max_age = store, settings, heartbeat_timeout, max_age
        self._read_at = float("-inf")
        self._live: list[str] = []
        self._breakers: dict[tuple[str, str], Breaker] = {}
        self._lock = threading.Lock()

    def _refresh(self, now: float) -> None:
        with self._lock:
            if now - self._read_at <= self._max_age:
                return
            self._breakers = read_breakers(self._store) if self._settings.enabled else {}
            self._live = [worker["name"] for worker in list_workers(self._store, now=now, timeout=self._timeout)
                          if worker["alive"]]
            self._read_at = now

    def check(self, model_ref: str, *, now: float) -> None:
        """Raise `ModelUnavailable` when the breaker of `model_ref` is open on every live worker."""
        if not self._settings.enabled:
            return
        self._refresh(now)
        until = unavailable_until((self._breakers.get((model_ref, name)) for name in self._live), now=now)
        if until is not None:
            retry_after = max(1, math.ceil(until - now))
            raise ModelUnavailable(
                f"model '{model_ref}' failed on every live worker ({len(self._live)}): its circuit breakers are "
                f"open (GET /v1/status lists them); the request was not queued: retry after {retry_after} s "
                "(Retry-After), when a probe batch may run", retry_after=retry_after)


# --- a worker's own breakers -----------------------------------------------------------


class BreakerBoard:
    """One worker process's breakers, one per model version it ran: decided in memory (this worker
    is the only writer of its records) and written to Redis, read from it on first use (a worker
    started again under its name keeps an open breaker). Shared by the process's threads."""

    def __init__(self, store: Store, settings: BreakerSettings, worker: Callable[[], str],
                 clock: Callable[[], float] = time.time) -> None:
        self._store, self._settings, self._worker, self._clock = store, settings, worker, clock
        self._breakers: dict[tuple[str, str], Breaker] = {}
        self._pending: dict[tuple[str, str], tuple[int, int, str]] = {}
        self._flushed_at: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def _get(self, key: tuple[str, str]) -> Breaker:
        """The breaker of `key` (model ref, worker), read from Redis the first time (caller holds the lock)."""
        breaker = self._breakers.get(key)
        if breaker is None:
            try:
                with translate_redis_errors():
                    text = self._store.client.hget(self._store.keys.breakers, _field(*key))
            except Exception as err:  # Redis away: start closed; the next write says what this worker saw
                log.warning("could not read the circuit breaker of %s on %s: %s", key[0], key[1], err)
                text = None
            breaker = self._breakers[key] = Breaker.from_json(text) if text else Breaker(since=self._clock())
        return breaker

    def breaker(self, model_ref: str) -> Breaker:
        """This worker's breaker of `model_ref` now."""
        with self._lock:
            return self._get((model_ref, self._worker()))

    def may_lease(self, model_ref: str, *, now: float) -> bool:
        """Whether this worker may lease a batch of `model_ref` now (`may_lease`); takes no probe."""
        if not self._settings.enabled:
            return True
        with self._lock:
            return may_lease(self._get((model_ref, self._worker())), self._settings, now=now)

    def claim(self, model_ref: str, *, now: float) -> str | None:
        """Whether a slot may lease a batch of `model_ref` now: None (no), 'lease' (closed), or 'probe'
        (half-open, and the probe is this slot's: the others lease none until its run reports, or
        `release_probe` gives it back)."""
        if not self._settings.enabled:
            return "lease"
        with self._lock:
            key = (model_ref, self._worker())
            breaker = self._get(key)
            if not may_lease(breaker, self._settings, now=now):
                return None
            if state_at(breaker, now=now) == HALF_OPEN:
                self._write(key, with_probe(breaker, now=now))
                return "probe"
            return "lease"

    def release_probe(self, model_ref: str) -> None:
        """The probe lease of `model_ref` got no batch: another slot may take it."""
        with self._lock:
            key = (model_ref, self._worker())
            breaker = self._breakers.get(key)
            if breaker is not None and breaker.probe_at is not None and breaker.state == HALF_OPEN:
                self._write(key, replace(breaker, probe_at=None))

    def note_run(self, model_ref: str, *, failed: bool, error: str = "", now: float | None = None) -> None:
        """Count one run of `model_ref` on this worker (`failed`: of a counted class); the breaker's
        record is written at once for a failure or a half-open breaker, else at most every `FLUSH_SECONDS`."""
        if not self._settings.enabled:
            return
        moment = self._clock() if now is None else now
        with self._lock:
            key = (model_ref, self._worker())
            runs, failures, last = self._pending.get(key, (0, 0, ""))
            self._pending[key] = (runs + 1, failures + int(failed), error if failed else last)
            breaker = self._get(key)
            last_flush = self._flushed_at.get(key, float("-inf"))
            if failed or breaker.state != CLOSED or moment - last_flush >= FLUSH_SECONDS:
                self._flush(key, moment)

    def _flush(self, key: tuple[str, str], now: float) -> None:
        runs, failures, error = self._pending.pop(key, (0, 0, ""))
        self._flushed_at[key] = now
        before = self._get(key)
        after = note_runs(before, self._settings, runs=runs, failures=failures, now=now, error=error)
        if after.state != before.state:
            why = after.last_error if after.state == OPEN else "a probe batch ran"
            log.warning("circuit breaker of %s on %s: %s -> %s (%s)", key[0], key[1], state_at(before, now=now),
                        after.state, why)
        if after != before:
            self._write(key, after)

    def _write(self, key: tuple[str, str], breaker: Breaker) -> None:
        """Keep `breaker` and write its record (logged, not raised, when Redis is away: the worker's
        own decisions go on in memory)."""
        self._breakers[key] = breaker
        try:
            with translate_redis_errors():
                self._store.client.hset(self._store.keys.breakers, _field(*key), breaker.to_json())
        except Exception as err:
            log.warning("could not write the circuit breaker of %s on %s: %s", key[0], key[1], err)
