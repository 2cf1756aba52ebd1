"""A deep queue does not starve a tenant (real Redis, time passed in).

A tenant that queues thousands of one-row chunks or requests ahead of another's does not hide the
first-ranked tenant's work behind them: a fair-share lease reads each ranked tenant's own index of its waiting
items (`keys.ready_of_tenant`), not only the window from the queue's head (`lease_batch.lua`). A queue stored
before the indexes is indexed by reaper passes, a page at a time (`broker.queueing.tenant_index`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import tenant_index
from broker.queueing.leases import LeaseOptions, LeaseResult, lease_batch
from broker.state.embedded import EmbeddedRedis
from broker.state.keys import Keys
from broker.state.store import Store
from tests.broker.broker_helpers import NOW

MODEL = "mlp@v1"
FLOOD = 5000
ORDER = {"order": ["small", "flood"], "held": [], "window": 4096}
"""The fair order a worker passes: `small` ranks first (below its share), `flood` after it; the default window."""


def job(store: Store, job_id: str, tenant: str, rows: int) -> None:
    job_fills.create_job(store, jobs.JobSpec(
        job_id=job_id, model_name="mlp", model_version="v1", input_batch="/in.npy", input_format="npy",
        input_checksum="sha256:0", output_dir="/out", output_names=["y"], rows_total=rows, chunk_size=1,
        batch_size=1, owner=f"{tenant}-key", tenant=tenant), now=NOW)


def submit(store: Store, request_id: str, tenant: str, *, score: float) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"x": np.zeros((1, 4), np.float32)}, rows=1, tokens=None, bucket="x:4",
                       factors={"enqueued_at": NOW}, owner=f"{tenant}-key", tenant=tenant)
    requests.submit_request(store, spec, score=score, now=NOW, max_age_seconds=600)


def lease(store: Store, *, max_items: int = 4, requests_only: bool = False,
          order: dict | None = None) -> LeaseResult:
    options = LeaseOptions(max_items=max_items, requests_only=requests_only, tenants=order or ORDER)
    return lease_batch(store, MODEL, options, now=NOW, lease_seconds=30)


def tenants_of(result: LeaseResult) -> list[str]:
    return [item.payload["tenant"] for item in result.items]


def test_a_flood_of_chunks_ahead_does_not_hide_the_first_ranked_tenant_s_job(store: Store) -> None:
    job(store, "jflood", "flood", FLOOD)
    job(store, "jsmall", "small", 3)
    assert store.client.zrank(store.keys.ready(MODEL), "jsmall:c0000000") == FLOOD  # behind every flood chunk

    taken = lease(store, max_items=3)
    assert [item.item_id for item in taken.items] == [f"jsmall:c000000{i}" for i in range(3)]
    assert taken.absent == []  # small was found, so it is not left out of the next orders
    # small has nothing left: the index says so at once, and flood's chunks go next
    after = lease(store, max_items=2)
    assert tenants_of(after) == ["flood", "flood"] and after.absent == ["small"]


def test_a_flood_of_requests_ahead_does_not_hide_the_first_ranked_tenant_s_requests(store: Store) -> None:
    for index in range(FLOOD):
        submit(store, f"f{index}", "flood", score=index)
    for index in range(3):
        submit(store, f"s{index}", "small", score=FLOOD + index)

    assert [item.item_id for item in lease(store, max_items=2).items] == ["s0", "s1"]
    # a requests-only lease (a running chunk's mini-batch boundary, a returning tenant) finds it as well; the
    # batch's rows left go to the next tenant in the order, from the queue's head
    assert [item.item_id for item in lease(store, max_items=2, requests_only=True).items] == ["s2", "f0"]
    returning = {"order": ["small"], "held": [], "window": 4096, "only": True}  # (`FairShare.returning_option`)
    submit(store, "s3", "small", score=FLOOD + 3)
    assert [item.item_id for item in lease(store, max_items=2, requests_only=True, order=returning).items] == ["s3"]


def test_a_deep_queue_stored_before_the_indexes_is_indexed_page_by_page_and_then_found(store: Store) -> None:
    job(store, "jflood", "flood", FLOOD)
    job(store, "jsmall", "small", 2)
    ready = store.keys.ready(MODEL)
    store.client.delete(store.keys.ready_of_tenant(MODEL, "flood"), store.keys.ready_of_tenant(MODEL, "small"),
                        store.keys.ready_of_tenant_built(MODEL))  # (as a version before the indexes left it)

    assert tenants_of(lease(store, max_items=1)) == ["flood"]  # the window alone: small waits past it
    passes = 0
    while not tenant_index.index_waiting_items(store, page=1000):
        passes += 1
        assert passes < 50
        # what is leased meanwhile leaves its index too: the walk and the scripts never disagree
        tenants_of(lease(store, max_items=1, order={"order": ["flood"], "held": [], "window": 16}))
    assert passes >= 3  # (5,000 items, about a thousand a pass)
    by_tenant = {tenant: dict(store.client.zrange(store.keys.ready_of_tenant(MODEL, tenant), 0, -1, withscores=True))
                 for tenant in ("flood", "small")}
    assert by_tenant["flood"] | by_tenant["small"] == dict(store.client.zrange(ready, 0, -1, withscores=True))
    assert list(by_tenant["small"]) == ["jsmall:c0000000", "jsmall:c0000001"]
    assert tenants_of(lease(store, max_items=2)) == ["small", "small"]


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A server of this module's own: its command counts are the leases' alone."""
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("counted")), appendonly=False).start()
    yield server
    server.stop()


@pytest.mark.parametrize("small_rows, held", [(40, False), (2, False), (2, True)])
def test_a_lease_reads_a_bounded_part_of_a_deep_queue(own_redis: EmbeddedRedis, small_rows: int,
                                                       held: bool) -> None:
    """The ranked tenants' items are read from their own indexes, and the window from the head not at all while
    they fill the batch or no other tenant's item waits: a lease costs the same whether 5,000 of another tenant's
    items wait in front or none, also while that tenant is held (Redis's own count of the lease's reads)."""
    store = Store(client=redis.Redis.from_url(own_redis.url, decode_responses=True), keys=Keys())
    store.client.flushdb()
    job(store, "jflood", "flood", FLOOD)
    job(store, "jsmall", "small", small_rows)
    order = {"order": ["small", "flood"], "held": ["flood"] if held else [], "window": 4096}
    store.client.config_resetstat()
    taken = lease(store, max_items=4, order=order)
    stats = store.client.info("commandstats")
    reads = sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("zrange", "zscore", "hget"))
    assert tenants_of(taken)[:min(small_rows, 4)] == ["small"] * min(small_rows, 4)
    assert 0 < reads < 100, stats  # (a window scan reads 4,096 entries and decodes a payload per job)
    store.client.close()
