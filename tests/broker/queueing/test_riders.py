"""Requests and job chunks leased together: riders of a chunk's mini-batch, and a chunk carried by a
batch of requests (real Redis, time passed in)."""

from __future__ import annotations

import numpy as np
import pytest

from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.queueing import leases, reaping
from broker.queueing.leases import StaleTicket
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec, ready_ids
from tests.leasing import lease_items


def submit(store: Store, request_id: str, *, score: float, bucket: str = "features:64", rows: int = 1,
           tokens: int | None = None, tenant: str = "") -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((rows, 64), np.float32)}, rows=rows, tokens=tokens,
                       bucket=bucket, factors={"level": 0, "enqueued_at": NOW}, tenant=tenant)
    requests.submit_request(store, spec, score=score, now=NOW, max_age_seconds=60)


def chunk_score(store: Store) -> float:
    return float(store.client.zrange(store.keys.ready(MODEL_REF), 0, 0, withscores=True)[0][1])


def ids(items: list[leases.LeasedItem]) -> list[str]:
    return [item.item_id for item in items]


def test_riders_of_the_bucket_are_found_behind_job_chunks_best_first_within_the_row_budget(store: Store) -> None:
    spec = job_spec(rows_total=12, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    behind = chunk_score(store) + 100
    submit(store, "r-late", score=behind + 2)
    submit(store, "r-other", score=behind, bucket="features:32")
    submit(store, "r-two", score=behind + 1, rows=2)
    submit(store, "r-first", score=behind + 0.5)

    riders = leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=8, max_rows=3)

    assert ids(riders) == ["r-first", "r-two"]  # r-late would pass the 3 rows; r-other has another shape
    assert ready_ids(store) == [*(jobs.chunk_item_id(spec.job_id, i) for i in range(3)), "r-other", "r-late"]
    assert store.client.zscore(store.keys.inflight(MODEL_REF), "r-two") == NOW + 30


def test_riders_follow_the_tenants_fair_share_order_and_a_held_tenant_s_do_not_ride(store: Store) -> None:
    for index in range(3):
        submit(store, f"flood{index}", score=index, tenant="flood")
    submit(store, "below", score=10, tenant="below")
    submit(store, "capped", score=11, tenant="capped")

    riders = leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=2,
                                 max_rows=2, tenants={"order": ["below", "flood", "capped"], "held": ["capped"]})
    assert ids(riders) == ["below", "flood0"]  # the tenant below its share first, though last in the queue
    riders = leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=8,
                                 max_rows=8, tenants={"order": ["below", "flood", "capped"], "held": ["capped"]})
    assert ids(riders) == ["flood1", "flood2"]  # and the held tenant's request stays queued
    assert ready_ids(store) == ["capped"]


def test_riders_respect_the_token_budget_the_item_count_and_the_scan_window(store: Store) -> None:
    for index in range(6):
        submit(store, f"r{index}", score=float(index), tokens=40)

    assert ids(leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=8,
                                   max_rows=8, max_tokens=100)) == ["r0", "r1"]
    assert ids(leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=1,
                                   max_rows=8)) == ["r2"]
    assert ids(leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=8,
                                   max_rows=8, window=2)) == ["r3", "r4"]


def test_few_waiting_requests_are_found_by_their_place_in_the_queue_and_not_past_the_window(store: Store) -> None:
    # Fewer requests wait than the window holds: they are looked up through the waiting set, not by
    # reading every chunk in front of them; the window still bounds how deep in the queue one may be.
    spec = job_spec(rows_total=10, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    chunks = store.client.zrange(store.keys.ready(MODEL_REF), 0, -1)
    store.client.zadd(store.keys.ready(MODEL_REF), {chunk: float(index) for index, chunk in enumerate(chunks)})
    submit(store, "r-third", score=1.5)  # third in the queue
    submit(store, "r-deep", score=10.0)  # eleventh: past a window of 4
    submit(store, "r-first", score=-1.0)

    riders = leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=8,
                                 max_rows=8, window=4)

    assert ids(riders) == ["r-first", "r-third"]
    assert ready_ids(store)[-1] == "r-deep"
    assert leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=8,
                               max_rows=8, window=4) == []  # (r-deep is now 11th of 11: still past it)


def test_a_stale_ticket_leases_no_riders(store: Store) -> None:
    submit(store, "r0", score=1.0)
    with pytest.raises(StaleTicket):
        leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=8, max_rows=8,
                            ticket="gone")
    assert ready_ids(store) == ["r0"]


def test_a_batch_of_requests_with_rows_to_spare_takes_the_first_chunk_along_last(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    ahead = chunk_score(store) - 100
    submit(store, "r0", score=ahead)
    submit(store, "r1", score=ahead + 1)

    plain = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=4, max_chunks=1,
                               requests_only=True, carry_chunk=True)
    assert ids(plain) == ["r0", "r1"]  # requests_only never carries a chunk

    submit(store, "r2", score=ahead + 2)
    carried = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=4, max_chunks=1,
                                 carry_chunk=True)
    assert ids(carried) == ["r2", jobs.chunk_item_id(spec.job_id, 0)]
    assert ready_ids(store) == [jobs.chunk_item_id(spec.job_id, 1)]


def test_a_lease_brings_its_requests_inputs_so_the_run_reads_nothing_more(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    behind = chunk_score(store) + 100
    for index, score in enumerate((behind - 200, behind - 199, behind, behind + 1)):
        request_spec = RequestSpec(request_id=f"r{index}", model_name="mlp", model_version="v1",
                                   inputs={"features": np.full((1, 64), index, np.float32)}, rows=1, tokens=None,
                                   bucket="features:64", factors={"level": 0, "enqueued_at": NOW})
        requests.submit_request(store, request_spec, score=score, now=NOW, max_age_seconds=60)
    store.client.delete(store.keys.request("r1"))  # (its hash expired before the lease)

    batch = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2, max_rows=3, max_chunks=1,
                               carry_chunk=True)
    riders = leases.lease_riders(store, MODEL_REF, "features:64", now=NOW, lease_seconds=30, max_items=4,
                                 max_rows=4)
    assert ids(batch) == ["r0", "r1", jobs.chunk_item_id(spec.job_id, 0)] and ids(riders) == ["r2", "r3"]
    assert [item.inputs == "" for item in batch] == [False, True, True]  # (a chunk brings none)
    for index in (0, 2, 3):  # the hashes go: what the run reads came with the lease
        store.client.delete(store.keys.request(f"r{index}"))

    loaded = requests.load_inputs(store, [batch[0], batch[1], *riders])

    assert [None if tensors is None else float(tensors["features"][0, 0]) for tensors in loaded] == [0, None, 2, 3]
    again = requests.load_inputs(store, [leases.LeasedItem("r2", MODEL_REF, riders[0].payload, 1)])
    assert again == [None]  # (an item not from a lease reads its hash, gone now)


def test_a_full_batch_of_requests_takes_no_chunk(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    ahead = chunk_score(store) - 100
    for index in range(3):
        submit(store, f"r{index}", score=ahead + index)

    full = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2, max_chunks=1,
                              carry_chunk=True)

    assert ids(full) == ["r0", "r1"]
    assert ready_ids(store) == ["r2", jobs.chunk_item_id(spec.job_id, 0)]


def test_a_request_gets_one_result_even_when_completed_late_or_twice(store: Store) -> None:
    """A worker whose lease was reaped (the request waits again) or whose completion is repeated
    changes nothing: one result, from the run that still held the request."""
    submit(store, "r0", score=1.0)
    [item] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)
    reaping.reap_expired_leases(store, now=NOW + 31, max_attempts=3)  # back to waiting

    late = RequestResult(item, outputs={"logits": np.zeros((1, 2), np.float32)})
    assert requests.complete_requests(store, [late], now=NOW + 32, keep_seconds=60, batch_size=1, worker="w1") == 0
    assert ready_ids(store) == ["r0"] and requests.get_request(store, "r0").status == "queued"

    [again] = lease_items(store, MODEL_REF, now=NOW + 33, lease_seconds=30, max_items=1)
    result = RequestResult(again, outputs={"logits": np.ones((1, 2), np.float32)})
    assert requests.complete_requests(store, [result], now=NOW + 34, keep_seconds=60, batch_size=1, worker="w2") == 1
    assert requests.complete_requests(store, [result], now=NOW + 35, keep_seconds=60, batch_size=1, worker="w2") == 0
    assert store.client.hget(store.keys.counters, f"requests_succeeded:{MODEL_REF}") == "1"  # one result
    np.testing.assert_array_equal(requests.get_request(store, "r0").outputs["logits"], np.ones((1, 2)))


def test_a_batch_cut_to_a_memory_hole_leases_no_head_request_that_outgrows_it(store: Store) -> None:
    submit(store, "big", score=1.0, rows=4, tokens=512)
    submit(store, "small", score=2.0, tokens=64)

    assert lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=8, max_rows=8, max_tokens=130,
                              head_within_limits=True) == []
    assert lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=8, max_rows=2,
                              head_within_limits=True) == []
    assert ready_ids(store) == ["big", "small"]
    assert ids(lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=8, max_rows=8,
                                  max_tokens=130)) == ["big"]  # otherwise the head always goes
