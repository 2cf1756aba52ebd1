"""The queue policy of online requests (Triton's `ModelQueuePolicy`): pure decisions, clock passed in.

What a request's model and priority level allow (`policy_for`), which timeout it gets
(`request_timeout`), and how long a client refused by a full queue should wait before it retries
(`retry_after_seconds`, from the queue's drain rate). The limits are enforced atomically where an
item is queued (`submit_request.lua`); timeouts by `broker.online.timeouts`. Offline job chunks
are not online requests: none of this applies to them. docs/scheduling.md, "Queue policy and
backpressure", is the user's view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from broker.online.settings import LevelQueuePolicy, ModelBatching, OnlineSettings, TimeoutAction

MIN_RETRY_AFTER = 1
"""The shortest Retry-After (seconds; HTTP's unit): a retry sooner would only meet the same full queue."""
MAX_RETRY_AFTER = 60
"""The longest Retry-After: an estimate of a queue with no live worker, or that never ran, is a guess."""


@dataclass(frozen=True)
class QueuePolicy:
    """The queue policy of one model's requests at one priority level, every key resolved."""

    max_queue_size: int
    """Most requests of the model waiting, all levels together (0: no limit)."""
    level_max_queue_size: int
    """Most requests of this level waiting (0: no limit of its own)."""
    default_timeout: float
    """Seconds a request that names no timeout may wait (0: none)."""
    timeout_action: TimeoutAction
    allow_timeout_override: bool


def policy_for(online: OnlineSettings, model_name: str, level: int) -> QueuePolicy:
    """The queue policy of `model_name`'s requests at priority `level`: the model's keys (`online.models`,
    else `online.batching`), with the keys its `priority_levels` entry for `level` sets on top."""
    return resolve(online.batching_for(model_name), level)


def resolve(batching: ModelBatching, level: int) -> QueuePolicy:
    """`batching`'s queue keys for `level`, its `priority_levels` entry on top."""
    entry = batching.priority_levels.get(level) or LevelQueuePolicy()
    return QueuePolicy(
        max_queue_size=batching.max_queue_size,
        level_max_queue_size=entry.max_queue_size or 0,
        default_timeout=batching.default_timeout if entry.default_timeout is None else entry.default_timeout,
        timeout_action=entry.timeout_action or batching.timeout_action,
        allow_timeout_override=(batching.allow_timeout_override if entry.allow_timeout_override is None
                                else entry.allow_timeout_override),
    )


def request_timeout(policy: QueuePolicy, requested: float | None) -> float | None:
    """Seconds the request may wait for a worker, or None: Triton's rule. The policy's
    `default_timeout`; with `allow_timeout_override`, the request's own timeout (`requested`)
    instead when it is shorter, or when the policy sets none."""
    default = policy.default_timeout or None
    if requested and policy.allow_timeout_override and (default is None or requested < default):
        return requested
    return default


def seconds_per_request(totals: Mapping[str, int]) -> float | None:
    """How long one request's share of a run takes, from the model version's statistics
    (`broker.monitoring.model_stats` running totals): mean run time over mean requests per run; None before
    any run."""
    ran, runs, run_ns = totals.get("infer_count", 0), totals.get("execution_count", 0), totals.get("infer_ns", 0)
    if ran <= 0 or runs <= 0 or run_ns <= 0:
        return None
    return (run_ns / ran / 1e9) / (ran / runs)


def retry_after_seconds(waiting: int, seconds_each: float | None, stream_slots: int) -> int:
    """The Retry-After of a full queue: how long the `waiting` requests take to drain at
    `seconds_each` per request on `stream_slots` parallel slots, in whole seconds from
    `MIN_RETRY_AFTER` to `MAX_RETRY_AFTER`. No live slot, or no estimate: the longest."""
    if stream_slots <= 0 or seconds_each is None or not math.isfinite(seconds_each):
        return MAX_RETRY_AFTER
    drain = waiting * seconds_each / stream_slots
    return max(MIN_RETRY_AFTER, min(MAX_RETRY_AFTER, math.ceil(drain)))
