"""The tenants' shares wherever requests are leased, not only in one merged batch (real Redis, time passed in).

Requests riding in a job chunk's mini-batch (`lease_riders.lua`) are split as a batch of requests is; a tenant's
requests leased and not yet answered keep it present while their batch runs on one slot, so that the next
slot does not fill up with the other tenant's requests; and how long a tenant stays present after its answer
is the `fair_share.present_for` setting. `broker/tenants/batch_shares.py` is the reference.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.config.settings import Settings
from broker.errors import ConfigError
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.queueing import leases
from broker.queueing.leases import LeasedItem, LeaseNotes
from broker.state.embedded import EmbeddedRedis
from broker.state.keys import Keys
from broker.state.store import Store
from broker.tenants.batch_shares import BatchShares, in_flight_bound, split_riders
from tests.broker.broker_helpers import MODEL_REF, NOW, fresh_prefix, job_spec, ready_ids
from tests.leasing import lease_items

BUCKET = "features:64"
PRESENT_FOR = 0.05
ORDER = {"order": ["s1", "s2"], "held": [], "window": 4096}
SHARES = BatchShares((("s1", 0.7), ("s2", 0.3)), PRESENT_FOR)
RUNNING = BatchShares((("s1", 0.7), ("s2", 0.3)), PRESENT_FOR, in_flight_for=1.0)
"""The shares a worker's lease passes: a leased request keeps its tenant present up to a second unanswered."""


def submit(store: Store, request_id: str, tenant: str, *, score: float, rows: int = 1, bucket: str = BUCKET) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((rows, 64), np.float32)}, rows=rows, tokens=None, bucket=bucket,
                       factors={"level": 0, "enqueued_at": NOW}, owner=f"{tenant}-key", tenant=tenant)
    requests.submit_request(store, spec, score=score, now=NOW, max_age_seconds=600)


def flood(store: Store, counts: dict[str, int], *, tag: str = "", first_score: float = 0) -> None:
    """`counts` one-row requests of each tenant (ids `<tenant><tag>-<n>`), interleaved in the queue."""
    score = first_score
    for index in range(max(counts.values(), default=0)):
        for tenant, count in counts.items():
            if index < count:
                submit(store, f"{tenant}{tag}-{index}", tenant, score=score)
                score += 1


def riders(store: Store, *, now: float, shares: BatchShares | None = SHARES, order: dict | None = None,
           max_rows: int = 16) -> list[LeasedItem]:
    return leases.lease_riders(store, MODEL_REF, BUCKET, now=now, lease_seconds=30, max_items=max_rows,
                               max_rows=max_rows, tenants=order or ORDER, shares=shares)


def lease(store: Store, *, now: float, shares: BatchShares = RUNNING, notes: LeaseNotes | None = None
          ) -> list[LeasedItem]:
    return lease_items(store, MODEL_REF, now=now, lease_seconds=30, max_items=64, tenants=ORDER, shares=shares,
                       notes=notes)


def answer(store: Store, items: list[LeasedItem], *, now: float) -> None:
    results = [RequestResult(item, outputs={"y": np.zeros((1, 2), np.float32)}) for item in items]
    requests.complete_requests(store, results, now=now, keep_seconds=60, batch_size=len(items), worker="w1",
                               run_started=now - 0.01, run_rows=len(items))


def tenant_rows(items: list[LeasedItem]) -> Counter[str]:
    return Counter(item.payload["tenant"] for item in items for _ in range(item.payload["rows"]))


# --- riders of a job chunk's mini-batch -----------------------------------------------------------------------

def test_riders_of_a_tenant_over_its_share_add_at_most_its_share_of_the_first_tenant_s_rows(store: Store) -> None:
    job_fills.create_job(store, job_spec(rows_total=8, chunk_size=4), now=NOW)  # (the chunks wait in front)
    behind = float(store.client.zrange(store.keys.ready(MODEL_REF), -1, -1, withscores=True)[0][1]) + 1
    flood(store, {"s2": 8, "s1": 8}, first_score=behind)  # (s2's flood first in the queue)
    ridden = riders(store, now=NOW)
    assert tenant_rows(ridden) == {"s1": 8, "s2": 3}  # floor(8 * 0.3 / 0.7), not 8 of 16 rows
    assert [item.item_id for item in ridden[:8]] == [f"s1-{index}" for index in range(8)]  # the first rides first
    assert [item_id for item_id in ready_ids(store) if not jobs.is_chunk_item_id(item_id)] == \
        [f"s2-{index}" for index in range(3, 8)]  # the rest waits, in its order

    flood(store, {"s1": 8}, tag="-b", first_score=behind + 100)
    assert tenant_rows(riders(store, now=NOW, shares=None)) == {"s2": 5, "s1": 8}  # (the order alone: all ride)


def test_riders_follow_the_first_ranked_tenant_even_where_the_order_took_it_for_absent(store: Store) -> None:
    flood(store, {"s2": 8, "s1": 8})
    ridden = riders(store, now=NOW, order={"order": ["s2"], "held": [], "window": 4096})
    assert tenant_rows(ridden) == {"s1": 8, "s2": 3} and ridden[0].item_id == "s1-0"


def test_no_rider_of_the_other_tenant_while_the_first_is_present_with_nothing_waiting(store: Store) -> None:
    flood(store, {"s1": 8, "s2": 8})
    assert tenant_rows(lease(store, now=NOW, shares=SHARES)) == {"s1": 8, "s2": 3}  # s1's clients now wait
    assert riders(store, now=NOW + 0.01) == []  # s2's five do not ride in its place
    assert len(ready_ids(store)) == 5

    later = NOW + PRESENT_FOR + 0.001  # s1 did not come back: s2 alone, its requests ride uncapped
    assert tenant_rows(riders(store, now=later)) == {"s2": 5}


def test_a_tenant_alone_rides_uncapped(store: Store) -> None:
    flood(store, {"s2": 20})
    assert tenant_rows(riders(store, now=NOW)) == {"s2": 16}


def test_riders_keep_their_tenant_present_while_the_mini_batch_runs(store: Store) -> None:
    flood(store, {"s1": 4})
    assert tenant_rows(riders(store, now=NOW, shares=RUNNING)) == {"s1": 4}
    flood(store, {"s2": 8}, first_score=100)
    notes = LeaseNotes()
    assert lease(store, now=NOW + 0.5, notes=notes) == [] and notes.held_for_share  # s1's riders still run


def test_the_riders_split_follows_the_reference(redis_server: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(waiting=st.lists(st.integers(0, 10), min_size=3, max_size=3),
           elsewhere=st.lists(st.integers(0, 2), min_size=3, max_size=3),
           shares=st.lists(st.sampled_from([0.1, 0.2, 0.3, 0.5, 0.7]), min_size=3, max_size=3),
           served_ago=st.lists(st.sampled_from([None, 0.01, 0.2, -0.5]), min_size=3, max_size=3),
           max_rows=st.sampled_from([4, 16]))
    def agree(waiting: list[int], elsewhere: list[int], shares: list[float], served_ago: list[float | None],
              max_rows: int) -> None:
        store = Store(client=client, keys=Keys(prefix=fresh_prefix()))
        tenants = ["a", "b", "c"]
        try:
            flood(store, {tenant: count for tenant, count in zip(tenants, waiting, strict=True) if count})
            for tenant, count in zip(tenants, elsewhere, strict=True):  # (requests of another shape)
                for index in range(count):
                    submit(store, f"{tenant}-other-{index}", tenant, score=1000 + index, bucket="features:32")
            served = {tenant: NOW - ago for tenant, ago in zip(tenants, served_ago, strict=True) if ago is not None}
            if served:  # (a negative age: a leased batch of the tenant still runs)
                client.hset(store.keys.tenants_served(MODEL_REF), mapping=served)
            option = BatchShares(tuple(zip(tenants, shares, strict=True)), PRESENT_FOR)
            ridden = leases.lease_riders(store, MODEL_REF, BUCKET, now=NOW, lease_seconds=30, max_items=max_rows,
                                         max_rows=max_rows, tenants={"order": tenants, "held": []}, shares=option)

            rows_by = dict(zip(tenants, waiting, strict=True))
            waiting_by = {tenant: rows_by[tenant] + more for tenant, more in zip(tenants, elsewhere, strict=True)}
            expected = split_riders(option, waiting=waiting_by, served_at=served, rider_rows=rows_by,
                                    max_rows=max_rows, now=NOW)
            if expected is not None and expected.hold:
                assert ridden == []
                return
            first = [expected.anchor] if expected is not None else []
            rows, room = {}, max_rows
            for tenant in [*first, *(tenant for tenant in tenants if tenant not in first)]:
                most = expected.most_rows(tenant) if expected is not None else None
                rows[tenant] = min(rows_by[tenant], room, room if most is None else most)
                room -= rows[tenant]
            assert tenant_rows(ridden) == Counter({tenant: count for tenant, count in rows.items() if count})
        finally:
            for key in client.scan_iter(f"{store.keys.prefix}:*", count=1000):
                client.delete(key)

    try:
        agree()
    finally:
        client.close()


# --- several stream slots: a tenant present while its batch runs --------------------------------------------

def test_a_run_longer_than_the_presence_does_not_hand_the_next_slot_to_the_other_tenant(store: Store) -> None:
    flood(store, {"s1": 8, "s2": 8})
    first_slot = lease(store, now=NOW)
    assert tenant_rows(first_slot) == {"s1": 8, "s2": 3}  # s1's clients all wait for this batch's answers

    notes = LeaseNotes()
    assert lease(store, now=NOW + 0.2, notes=notes) == []  # the next slot, 4 presences later, the run still going
    assert notes.held_for_share and not notes.absent
    assert len(ready_ids(store)) == 5  # s2's rest waits for s1's next calls, as on one slot

    answer(store, first_slot, now=NOW + 0.3)
    flood(store, {"s1": 8}, tag="-next", first_score=100)  # s1's clients call again
    assert tenant_rows(lease(store, now=NOW + 0.31)) == {"s1": 8, "s2": 3}


def test_the_answer_ends_the_running_presence_so_a_lone_tenant_waits_no_longer(store: Store) -> None:
    flood(store, {"s1": 4, "s2": 8})
    ran = lease(store, now=NOW)
    assert tenant_rows(ran) == {"s1": 4, "s2": 1}
    answer(store, ran, now=NOW + 0.1)  # well before the bound of a second
    notes = LeaseNotes()
    assert lease(store, now=NOW + 0.1 + PRESENT_FOR / 2, notes=notes) == [] and notes.held_for_share
    assert tenant_rows(lease(store, now=NOW + 0.1 + PRESENT_FOR + 0.001)) == {"s2": 7}  # s1 gone: full batches


def test_requests_never_answered_hold_the_other_tenant_no_longer_than_the_bound(store: Store) -> None:
    flood(store, {"s1": 4, "s2": 8})
    assert tenant_rows(lease(store, now=NOW)) == {"s1": 4, "s2": 1}  # (its worker dies: no answer comes)
    assert lease(store, now=NOW + RUNNING.in_flight_for) == []  # still within the bound and the presence
    past = NOW + RUNNING.in_flight_for + PRESENT_FOR + 0.001
    assert tenant_rows(lease(store, now=past)) == {"s2": 7}


def test_a_tenant_is_never_held_back_by_its_own_running_batch(store: Store) -> None:
    flood(store, {"s1": 70})
    assert tenant_rows(lease(store, now=NOW)) == {"s1": 64}
    assert tenant_rows(lease(store, now=NOW + 0.2)) == {"s1": 6}  # the next slot takes the rest at once
    notes = LeaseNotes()
    assert lease(store, now=NOW + 0.3, notes=notes) == [] and not notes.held_for_share  # (nothing waits)


def test_the_bound_follows_the_model_s_run_and_the_worker_s_slots() -> None:
    assert in_flight_bound(0.1, 4) == pytest.approx(0.8)  # up to four runs share the device, twice over
    assert in_flight_bound(0.3, 0) == pytest.approx(0.6)  # (a worker has a slot at least)
    assert in_flight_bound(0.001, 2) == in_flight_bound(-1.0, 2) == 0.5  # a run slower than its profile counts too


# --- the presence window is a setting ----------------------------------------------------------------------

def test_the_presence_after_an_answer_is_the_fair_share_present_for_setting(store: Store) -> None:
    present_for = Settings().with_overrides(fair_share={"present_for": "200ms"}).fair_share.present_for
    assert present_for == pytest.approx(0.2)
    shares = BatchShares(SHARES.ranked, present_for)
    flood(store, {"s1": 8, "s2": 8})
    answer(store, lease(store, now=NOW, shares=shares), now=NOW + 0.01)
    notes = LeaseNotes()
    assert lease(store, now=NOW + 0.15, shares=shares, notes=notes) == [] and notes.held_for_share  # past 50 ms
    assert tenant_rows(lease(store, now=NOW + 0.211, shares=shares)) == {"s2": 5}


@pytest.mark.parametrize("value", ["0s", "-50ms", "11s"])
def test_a_presence_out_of_range_is_refused_with_what_to_fix(value: str) -> None:
    with pytest.raises(ConfigError, match="present_for"):
        Settings().with_overrides(fair_share={"present_for": value})
