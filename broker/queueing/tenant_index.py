"""The tenants' indexes of the model queues, built for queues stored before they existed.

Beside each model's ready queue, every script keeps one sorted set per tenant of its waiting items
(`keys.ready_of_tenant`, lib.lua's `ready_add`), so that a fair-share lease reads the first-ranked tenants'
work from their own indexes instead of behind every other tenant's (`lease_batch.lua`). A queue that starts
empty has its index at once; one that held work when the fleet was upgraded has none until a reaper pass
walks it (`index_ready.lua`, a page per pass and queue) and marks it built. Until then its leases weigh
the window from the queue's head, as before.
"""

from __future__ import annotations

from broker.state.store import Store, translate_redis_errors

INDEX_PAGE = 1000
"""Waiting items one `index_ready.lua` call indexes (a payload read each, a decode per job: a few ms)."""


def index_waiting_items(store: Store, *, page: int = INDEX_PAGE) -> bool:
    """Index a page of the waiting items of every queue whose tenant index is not built yet; True once
    every queue's is. Run by every reaper pass. Idempotent (an item is indexed at its score in the
    queue), so passes of several workers at once leave the same indexes."""
    keys = store.keys
    with translate_redis_errors():
        refs = sorted(store.client.smembers(keys.queues))
        if not refs:
            return True
        pipe = store.client.pipeline(transaction=False)
        for ref in refs:
            pipe.exists(keys.ready_of_tenant_built(ref))
        unbuilt = [ref for ref, built in zip(refs, pipe.execute(), strict=True) if not built]
        done = [int(store.scripts.index_ready(keys=[keys.ready(ref), keys.items], args=[page])) for ref in unbuilt]
    return all(done)
