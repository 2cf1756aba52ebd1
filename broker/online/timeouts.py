"""Online requests past their timeout (the queue policy's `timeout_action`), found while they wait.

A request that names a timeout, or gets its model's `default_timeout` (`broker.online.queue_policy`), is
indexed by the instant it passes (`keys.request_timeouts`). A pass over that index, due entries
only, applies the action to those still waiting:

- `reject`: the request fails as timed out (error code `timeout`), and its waiter gets that answer;
- `delay`: it stays queued at level 0, the lowest, and still runs.

Workers need not be free for this: every reaper pass runs it (on the reaper's own thread), and an
API process waiting for a request runs it for that request's model when the timeout comes, so its
client is answered then. A lease never takes a request past its `reject` timeout, nor counts it as its
tenant's work (`lease_batch.lua`): a worker whose lease saw one runs the pass at once
(`sits_worker.serving.leasing`), and one whose request passed it between the lease and the run does not
run it (`sits_worker.serving.request_runs`). Offline job chunks have no timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.errors import InferenceTimeout
from broker.online import requests
from broker.online.requests import RequestResult
from broker.queueing import policy
from broker.queueing.leases import LeasedItem, decode_payload
from broker.queueing.scoring import Ordering, Weights
from broker.state.store import Store, translate_redis_errors

REJECT_LEASE_SECONDS = 30.0
"""The lease a rejected request is held under until its failure is stored (right after): should the
caller die in between, the reaper returns it when this runs out, and the next pass rejects it again."""
PASS_LIMIT = 1000
"""Most due index entries one call looks at (a call stays short; the next pass takes the rest)."""


@dataclass(frozen=True)
class TimeoutPass:
    """What one pass over a model's timeout index did."""

    rejected: list[str]
    """Ids of the requests failed as timed out."""
    delayed: list[str]
    """Ids of the requests dropped to level 0."""


def expire_timed_out(store: Store, model_ref: str, *, now: float, weights: Weights, ordering: Ordering,
                     keep_seconds: float) -> TimeoutPass:
    """Apply the timeout action to `model_ref`'s waiting requests whose timeout passed by `now`; a
    rejected request's result is kept `keep_seconds` (`online.result_ttl`). Idempotent: a request
    leased, done or dealt with already is left alone."""
    keys = store.keys
    with translate_redis_errors():
        reply = store.scripts.expire_requests(
            keys=[keys.request_timeouts(model_ref), keys.ready(model_ref), keys.inflight(model_ref), keys.items,
                  keys.waiting_requests(model_ref), keys.deadlines(model_ref)],
            args=[now, now + REJECT_LEASE_SECONDS, PASS_LIMIT])
    count = int(reply[0])
    items = [LeasedItem(str(reply[1 + 2 * i]), model_ref, decode_payload(reply[2 + 2 * i]), 1) for i in range(count)]
    delayed = [str(item_id) for item_id in reply[1 + 2 * count:]]
    if items:
        failed = [RequestResult(item, error=timed_out_message(item.payload), code=InferenceTimeout.code, ran=False)
                  for item in items]
        requests.complete_requests(store, failed, now=now, keep_seconds=keep_seconds, batch_size=0,
                                   worker="queue-policy")
    policy.rescore_items(store, model_ref, delayed, weights, ordering)
    return TimeoutPass(rejected=[item.item_id for item in items], delayed=delayed)


def expire_all(store: Store, *, now: float, weights: Weights, ordering: Ordering,
               keep_seconds: float) -> TimeoutPass:
    """`expire_timed_out` for every model queue (a reaper pass)."""
    rejected: list[str] = []
    delayed: list[str] = []
    with translate_redis_errors():
        refs = sorted(store.client.smembers(store.keys.queues))
    for ref in refs:
        done = expire_timed_out(store, ref, now=now, weights=weights, ordering=ordering, keep_seconds=keep_seconds)
        rejected += done.rejected
        delayed += done.delayed
    return TimeoutPass(rejected=rejected, delayed=delayed)


def timed_out_message(payload: dict[str, Any]) -> str:
    """The error of a request failed at its timeout, saying how long it waited and what to do."""
    factors = payload.get("factors") or {}
    waited = float(payload.get("expires_at") or 0) - float(factors.get("enqueued_at") or 0)
    timeout = f" ({waited:.3g} s)" if 0 < waited < 1e9 else ""
    return (f"request {payload.get('req', '')} was not taken by a worker within its 'timeout'; it is not run "
            f"(its timeout{timeout} passed while it waited in the queue: give it a longer timeout, or retry "
            "when the queue is shorter)")
