"""A merged batch's rows split by the tenants' shares in `lease_batch.lua` (real Redis).

While two tenants with shares flood one model, the one fair share ranks first fills the batch and the
other gets its share's part of the rows; while the first is present with nothing waiting (its clients
are between an answer and their next call), the other's requests wait; a tenant alone gets full
batches. `broker/tenants/batch_shares.py` is the reference: the last test holds the script to it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.queueing import leases
from broker.queueing.leases import LeasedItem, LeaseNotes, LeaseOptions, LeaseStatus
from broker.state.embedded import EmbeddedRedis
from broker.state.keys import Keys
from broker.state.store import Store
from broker.tenants.batch_shares import BatchShares, split_batch
from tests.broker.broker_helpers import NOW, fresh_prefix, ready_ids
from tests.leasing import lease_items

MODEL = "mlp@v1"
PRESENT_FOR = 0.05
ORDER = {"order": ["s1", "s2"], "held": [], "window": 4096}
SHARES = BatchShares((("s1", 0.7), ("s2", 0.3)), PRESENT_FOR)


def submit(store: Store, request_id: str, tenant: str, *, score: float, rows: int = 1) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"x": np.zeros((rows, 4), np.float32)}, rows=rows, tokens=None, bucket="x:4",
                       factors={"enqueued_at": NOW}, owner=f"{tenant}-key", tenant=tenant)
    requests.submit_request(store, spec, score=score, now=NOW, max_age_seconds=600)


def flood(store: Store, counts: dict[str, int], *, tag: str = "", first_score: float = 0) -> None:
    """`counts` one-row requests of each tenant (ids `<tenant><tag>-<n>`), interleaved in the queue (as two
    floods arrive)."""
    score = first_score
    for index in range(max(counts.values(), default=0)):
        for tenant, count in counts.items():
            if index < count:
                submit(store, f"{tenant}{tag}-{index}", tenant, score=score)
                score += 1


def lease(store: Store, *, now: float, notes: LeaseNotes | None = None, max_items: int = 64,
          shares: BatchShares | None = SHARES, order: dict | None = None) -> list[LeasedItem]:
    return lease_items(store, MODEL, now=now, lease_seconds=30, max_items=max_items, tenants=order or ORDER,
                       shares=shares, notes=notes)


def tenant_rows(items: list[LeasedItem]) -> Counter[str]:
    return Counter({tenant: rows for tenant, rows in
                    Counter(item.payload["tenant"] for item in items for _ in range(item.payload["rows"])).items()})


def test_both_tenants_waiting_the_batch_s_rows_follow_their_shares(store: Store) -> None:
    flood(store, {"s1": 8, "s2": 8})
    batch = lease(store, now=NOW)
    assert tenant_rows(batch) == {"s1": 8, "s2": 3}  # 3 of 11 rows: floor(8 * 0.3 / 0.7)
    assert [item.item_id for item in batch[:8]] == [f"s1-{index}" for index in range(8)]  # the first fills first
    assert ready_ids(store) == [f"s2-{index}" for index in range(3, 8)]  # the rest waits, in its order

    without = lease(store, now=NOW, shares=None)  # (the order alone: every waiting request joins)
    assert tenant_rows(without) == {"s2": 5}


def test_the_tenant_present_with_nothing_waiting_holds_the_other_s_requests_for_its_presence(store: Store) -> None:
    flood(store, {"s1": 8, "s2": 8})
    lease(store, now=NOW)  # s1's 8 and s2's 3 run; s1's clients are away until their answers come
    notes = LeaseNotes()
    assert lease(store, now=NOW + 0.01, notes=notes) == [] and notes.held_for_share
    assert not notes.absent  # s1 is present: not told absent, its requests come in a moment
    assert len(ready_ids(store)) == 5  # nothing lost

    submit(store, "s1-back", "s1", score=100)  # one of s1's clients calls again
    assert tenant_rows(lease(store, now=NOW + 0.02)) == {"s1": 1}  # floor(1 * 0.3 / 0.7): none of s2's yet

    later = NOW + 0.02 + PRESENT_FOR + 0.001  # s1 did not come back: s2 gets the device, whole batches
    assert tenant_rows(lease(store, now=later)) == {"s2": 5}


def test_answering_a_tenant_s_requests_keeps_it_present(store: Store) -> None:
    flood(store, {"s1": 2, "s2": 8})
    ran = lease(store, now=NOW)
    assert tenant_rows(ran) == {"s1": 2}  # floor(2 * 0.3 / 0.7): none of s2's
    answered = NOW + 1.0  # a long run: its lease marked s1 a second ago
    assert tenant_rows(lease(store, now=answered)) == {"s2": 8}  # gone by then, without the answer
    store.client.delete(store.keys.tenants_served(MODEL))
    flood(store, {"s2": 8}, tag="-again", first_score=200)
    results = [RequestResult(item, outputs={"y": np.zeros((1, 2), np.float32)}) for item in ran]
    requests.complete_requests(store, results, now=answered, keep_seconds=60, batch_size=len(ran), worker="w1",
                               run_started=NOW, run_rows=len(ran))
    notes = LeaseNotes()
    assert lease(store, now=answered + 0.01, notes=notes) == [] and notes.held_for_share  # answered: present


def test_the_present_tenant_fills_first_though_the_order_took_it_for_absent_a_moment(store: Store) -> None:
    flood(store, {"s2": 8, "s1": 8})  # (s2's first in the queue too)
    taken_for_absent = {"order": ["s2"], "held": [], "window": 4096}  # s1 was away when a scan looked
    batch = lease(store, now=NOW, order=taken_for_absent)
    assert tenant_rows(batch) == {"s1": 8, "s2": 3} and batch[0].item_id == "s1-0"


def test_a_tenant_alone_gets_full_batches(store: Store) -> None:
    flood(store, {"s2": 20})
    assert tenant_rows(lease(store, now=NOW)) == {"s2": 20}
    flood(store, {"s2": 20, "free": 4}, tag="-again", first_score=100)  # beside a tenant without a share: no
    # split, its requests go after
    assert tenant_rows(lease(store, now=NOW + 1.0)) == {"s2": 20, "free": 4}


def test_rows_count_not_requests_and_a_tenant_without_a_share_gets_none_beside_two_with_one(store: Store) -> None:
    submit(store, "s1-big", "s1", score=0, rows=7)
    submit(store, "s2-a", "s2", score=1, rows=2)
    submit(store, "free-a", "free", score=2)
    submit(store, "s2-b", "s2", score=3, rows=2)
    submit(store, "s2-c", "s2", score=4)
    batch = lease(store, now=NOW)
    assert [item.item_id for item in batch] == ["s1-big", "s2-a", "s2-c"]  # s2: 3 rows of its 7 * 0.3 / 0.7
    assert ready_ids(store) == ["free-a", "s2-b"]


def test_the_over_share_tenant_ranking_second_does_not_stall_a_returning_tenant(store: Store) -> None:
    flood(store, {"s1": 3, "s2": 8})
    s2_first = BatchShares((("s2", 0.3), ("s1", 0.7)), PRESENT_FOR)  # s1 used more than its share lately
    batch = lease(store, now=NOW, shares=s2_first, order={"order": ["s2", "s1"], "held": [], "window": 4096})
    assert tenant_rows(batch) == {"s2": 8, "s1": 3}  # s1 may add 18: all it has


def test_the_script_splits_as_the_reference_does(redis_server: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(waiting=st.lists(st.integers(0, 12), min_size=3, max_size=3),
           shares=st.lists(st.sampled_from([0.1, 0.2, 0.25, 0.3, 0.5, 0.7]), min_size=3, max_size=3),
           served_ago=st.lists(st.sampled_from([None, 0.01, 0.2]), min_size=3, max_size=3),
           max_items=st.sampled_from([4, 16, 64]))
    def agree(waiting: list[int], shares: list[float], served_ago: list[float | None], max_items: int) -> None:
        store = Store(client=client, keys=Keys(prefix=fresh_prefix()))
        tenants = ["a", "b", "c"]
        try:
            flood(store, {tenant: count for tenant, count in zip(tenants, waiting, strict=True) if count})
            served = {tenant: NOW - ago for tenant, ago in zip(tenants, served_ago, strict=True) if ago is not None}
            if served:
                client.hset(store.keys.tenants_served(MODEL), mapping=served)
            option = BatchShares(tuple(zip(tenants, shares, strict=True)), PRESENT_FOR)
            result = leases.lease_batch(store, MODEL, LeaseOptions(max_items=max_items, tenants=ORDER | {
                "order": tenants}, shares=option), now=NOW, lease_seconds=30)

            waiting_by = dict(zip(tenants, waiting, strict=True))
            heads = [tenant for tenant in tenants if waiting_by[tenant]]
            if not heads:
                assert result.status is LeaseStatus.NOTHING
                return
            expected = split_batch(option, waiting=waiting_by, served_at=served, head_tenant=heads[0],
                                   anchor_rows=min(waiting_by[heads[0]], max_items), now=NOW)
            if expected is not None and expected.hold:
                assert result.status is LeaseStatus.HELD_FOR_SHARE and not result.items
                return
            rows, room = {}, max_items
            for tenant in heads:
                most = expected.most_rows(tenant) if expected is not None else None
                rows[tenant] = min(waiting_by[tenant], room, room if most is None else most)
                room -= rows[tenant]
            assert tenant_rows(result.items) == Counter({tenant: count for tenant, count in rows.items() if count})
        finally:
            for key in client.scan_iter(f"{store.keys.prefix}:*", count=1000):
                client.delete(key)

    try:
        agree()
    finally:
        client.close()
