"""The reaper pass's step over leases: expired leases and parked retries whose backoff passed go back to
their queue; a lost lease past its item's attempts goes to the dead set instead.

Run by every worker's reaper thread while it holds the reaper turn (`sits_worker/upkeep/reaper.py`);
time is passed in, so tests expire a lease by reaping with a later `now`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.queueing.leases import decode_payload
from broker.state.scripts import call_pipelined
from broker.state.store import Store, translate_redis_errors


@dataclass(frozen=True)
class ReapResult:
    """What one reaper pass did."""

    returned: int
    dead_items: list[tuple[str, str, dict[str, Any]]]
    """(model ref, item id, payload) of items that used up their attempts."""
    lost: list[tuple[str, str, dict[str, Any], float | None]] = field(default_factory=list)
    """(model ref, item id, payload, when it is queued again: None for now) of the leases that
    expired because their worker was lost (not those parked for a retry, nor those gone dead)."""


def reap_expired_leases(store: Store, *, now: float, max_attempts: int, limit: int = 1000,
                        lost_delays: Sequence[float] = ()) -> ReapResult:
    """Return every expired lease to its queue, or to the dead set after `max_attempts` lost leases;
    items parked for a retry whose backoff has passed go back too (`reap_leases.lua`). `lost_delays`:
    the wait after the n-th lost lease of an item before it is queued again (none: at once)."""
    keys = store.keys
    returned = 0
    lost: list[tuple[str, str, dict[str, Any], float | None]] = []
    delays = json.dumps([float(delay) for delay in lost_delays])
    with translate_redis_errors():
        refs = sorted(store.client.smembers(keys.queues))
        # every queue's call in one round trip (a pass runs each reaper interval, over every model version)
        replies = call_pipelined(store.client, [
            (store.scripts.reap_leases, [keys.inflight(ref), keys.ready(ref), keys.items, keys.attempts, keys.dead,
                                         keys.waiting_requests(ref), keys.retrying(ref)],
             [now, max_attempts, limit, delays]) for ref in refs])
        for ref, (back, _, *lost_pairs) in zip(refs, replies, strict=True):
            returned += int(back)
            if lost_pairs:
                payloads = store.client.hmget(keys.items, lost_pairs[0::2])
                lost += [(ref, item_id, decode_payload(payload), float(at) if at else None)
                         for item_id, at, payload in zip(lost_pairs[0::2], lost_pairs[1::2], payloads, strict=True)]
        dead_ids = store.client.zrange(keys.dead, 0, limit - 1)
        dead_items = []
        for item_id in dead_ids:
            payload = store.client.hget(keys.items, item_id)
            decoded = decode_payload(payload)
            dead_items.append((decoded.get("model_ref", ""), item_id, decoded))
    return ReapResult(returned=returned, dead_items=dead_items, lost=lost)
