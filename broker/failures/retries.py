"""Carrying out the retry matrix in Redis: park a failed item until its backoff has passed, record
every failure by class on its job's (or request's) record, and read those records back.

A retried item waits in Redis, not in a sleeping worker thread: it stays in its queue's in-flight
set with its lease deadline moved to when it may run again, marked in `keys.retrying`, and the
reaper's next pass after that returns it to its queue at the score its payload keeps, so it keeps
its place in priority order (`retry_item.lua`, `reap_leases.lua`). The decisions (the class, the
waits) are `broker/failures/retry_policy.py`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.failures.settings import FAILURE_CLASSES
from broker.queueing.leases import LeasedItem
from broker.state.replies import RetryReply
from broker.state.store import Store, translate_redis_errors

_ITEM_COUNT = "item:"
"""Prefix of the job hash fields that count one item's failures of one class ('item:<id>:<class>')."""


@dataclass(frozen=True)
class RetryOutcome:
    """What `retry_later` did with a failed item."""

    retried: bool
    """Parked until `retry_at`; else not retried (its class's attempts are used up), or gone."""
    failures: int = 0
    """This item's failures of the class so far, this one included (0: the item was gone)."""
    retry_at: float | None = None

    @property
    def gone(self) -> bool:
        """The item was no longer in flight (reaped, finished, or its job stopped meanwhile)."""
        return not self.retried and self.failures == 0


def record_key(store: Store, item: LeasedItem) -> str:
    """The record that shows an item's failures: its job's hash, or the request's own."""
    if item.payload.get("kind") == "request":
        return store.keys.request(item.payload["req"])
    return store.keys.job(item.payload.get("job", ""))


def retry_later(store: Store, item: LeasedItem, *, failure_class: str, error: str, delays: Sequence[float],
                now: float) -> RetryOutcome:
    """Record a failure of `item` in `failure_class` and park it in flight for `delays[n-1]` seconds, n
    its failures of that class so far; not retried once there is no such delay. One atomic call;
    times are kept to the millisecond."""
    if failure_class not in FAILURE_CLASSES:
        raise ValueError(f"{failure_class!r} is not a failure class: one of {', '.join(FAILURE_CLASSES)}")
    own = item.payload.get("kind") == "request"
    count_field = f"attempts:{failure_class}" if own else f"{_ITEM_COUNT}{item.item_id}:{failure_class}"
    # Times in milliseconds: Lua's numbers print with 14 digits, and the record must agree with itself.
    options = {"class": failure_class, "error": error, "delays": [round(float(delay), 3) for delay in delays],
               "count_field": count_field, "model": item.model_ref}
    keys = store.keys
    with translate_redis_errors():
        reply = store.scripts.retry_item(
            keys=[keys.inflight(item.model_ref), keys.retrying(item.model_ref), keys.attempts,
                  record_key(store, item), keys.counters],
            args=[item.item_id, repr(round(now, 3)), json.dumps(options)])
    status = RetryReply(int(reply[0]))
    if status is RetryReply.NOT_IN_FLIGHT:
        return RetryOutcome(retried=False)
    if status is RetryReply.NOT_RETRIED:
        return RetryOutcome(retried=False, failures=int(reply[1]))
    return RetryOutcome(retried=True, failures=int(reply[1]), retry_at=float(reply[2]))


def note_lost(store: Store, lost: Sequence[tuple[str, str, dict[str, Any], float | None]], *, now: float,
              error: str, retried: bool = True) -> None:
    """Record each lost lease (`reaping.ReapResult.lost`: model ref, item id, payload, when it is queued
    again, None for now) as a `worker_lost` failure on its record; with `retried` False, as one that is
    not retried (its item went dead)."""
    with translate_redis_errors():
        for model_ref, item_id, payload, retry_at in lost:
            item = LeasedItem(item_id, model_ref, payload, 0)
            if payload.get("kind") != "request" and not payload.get("job"):
                continue
            again = round(now if retry_at is None else retry_at, 3) if retried else None
            options = {"class": "worker_lost", "error": error, "retry_at": again, "model": model_ref}
            store.scripts.note_failure(keys=[record_key(store, item), store.keys.counters],
                                       args=[item_id, repr(round(now, 3)), json.dumps(options)])


def forget_item_counts(store: Store, job_id: str) -> int:
    """Start a resumed job's items on fresh attempts: drop the counts of each item's failures by class
    (the job's totals and its failure log stay). Returns how many counts were dropped."""
    with translate_redis_errors():
        names = [name for name in store.client.hkeys(store.keys.job(job_id)) if name.startswith(_ITEM_COUNT)]
        return int(store.client.hdel(store.keys.job(job_id), *names)) if names else 0


def failure_record(raw: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """From a job's or request's hash: failure class -> {attempts, last_error, last_failed_at} of the
    classes it failed in, and its last failures, oldest first ({class, item, at, retry_at})."""
    by_class: dict[str, dict[str, Any]] = {}
    for failure_class in FAILURE_CLASSES:
        attempts = raw.get(f"attempts:{failure_class}")
        if attempts:
            failed_at = raw.get(f"failed_at:{failure_class}")
            by_class[failure_class] = {"attempts": int(attempts), "last_error": raw.get(f"error:{failure_class}"),
                                       "last_failed_at": float(failed_at) if failed_at else None}
    log = json.loads(raw["failures"]) if raw.get("failures") else []
    return by_class, log if isinstance(log, list) else []


def is_failure_field(name: str) -> bool:
    """Whether a job hash field belongs to its failure record (`failure_record` reads them)."""
    return name.startswith((_ITEM_COUNT, "attempts:", "error:", "failed_at:")) or name == "failures"
