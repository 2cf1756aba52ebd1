"""Online requests in Redis: the tensor codec, submit (policy check, doorbell, tickets), token budgets, waiting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from broker.errors import Conflict
from broker.online import requests
from broker.online.requests import PolicyChanged, RequestResult, RequestSpec
from broker.queueing import policy, queues
from broker.queueing.scoring import Weights
from broker.state.store import Store
from tests.broker.broker_helpers import NOW
from tests.leasing import lease_items

MODEL = "transformer@v1"


def spec(request_id: str, *, length: int = 9, padded: int | None = 16, bucket: str = "input_ids:~16") -> RequestSpec:
    return RequestSpec(request_id=request_id, model_name="transformer", model_version="v1",
                       inputs={"input_ids": np.arange(length, dtype=np.int64)[None, :]}, rows=1, tokens=length,
                       bucket=bucket, factors={"enqueued_at": NOW}, padded_tokens=padded)


@given(hnp.arrays(dtype=st.sampled_from([np.float32, np.float16, np.int64, np.int32, np.uint8, np.bool_]),
                  shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
def test_packed_arrays_come_back_identical(array: np.ndarray) -> None:
    unpacked = requests.unpack_array(requests.pack_array(array))

    assert unpacked.dtype == array.dtype and unpacked.shape == array.shape
    np.testing.assert_array_equal(unpacked, array)


def test_submit_queues_rings_the_doorbell_and_tops_tickets_up(store: Store) -> None:
    new = requests.submit_request(store, spec("r1"), score=1.0, now=NOW, max_age_seconds=60, ticket_target=2)
    again = requests.submit_request(store, spec("r2"), score=2.0, now=NOW, max_age_seconds=60, ticket_target=2)

    assert len(new) == 2 and again == []  # two tickets circulate: the second submit sends none
    assert store.client.zrange(store.keys.ready(MODEL), 0, -1) == ["r1", "r2"]
    assert store.client.llen(store.keys.doorbell) == 2
    with pytest.raises(Conflict):
        requests.submit_request(store, spec("r1"), score=1.0, now=NOW, max_age_seconds=60)


def test_submit_scored_with_a_replaced_policy_is_refused_and_writes_nothing(store: Store) -> None:
    live = policy.LivePolicy(store, default="dynamic")
    stale_raw, _, _ = live.current()
    policy.save_policy(store, Weights(alpha=0.9), "dynamic")

    with pytest.raises(PolicyChanged):
        requests.submit_request(store, spec("r1"), score=1.0, now=NOW, max_age_seconds=60, policy_json=stale_raw)
    assert not store.client.exists(store.keys.request("r1"), store.keys.ready(MODEL))

    fresh_raw, weights, _ = live.refresh()
    assert weights.alpha == 0.9
    requests.submit_request(store, spec("r1"), score=1.0, now=NOW, max_age_seconds=60, policy_json=fresh_raw)
    assert store.client.zcard(store.keys.ready(MODEL)) == 1


def test_token_budget_counts_padded_tokens_and_merges_nearby_lengths(store: Store) -> None:
    for index, length in enumerate([9, 12, 16, 10, 15]):  # all of length class 16
        requests.submit_request(store, spec(f"r{index}", length=length), score=float(index), now=NOW,
                                max_age_seconds=60)
    requests.submit_request(store, spec("rlong", length=30, padded=32, bucket="input_ids:~32"), score=0.5,
                            now=NOW, max_age_seconds=60)

    first = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=8, max_tokens=64)
    second = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=8, max_tokens=64)
    third = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=8, max_tokens=64)

    assert [item.item_id for item in first] == ["r0", "r1", "r2", "r3"]  # 4 x 16 padded tokens = 64
    assert [item.item_id for item in second] == ["rlong"]  # another length class, not merged
    assert [item.item_id for item in third] == ["r4"]


def test_a_waiter_without_an_inbox_reads_the_finished_request_from_its_hash(store: Store) -> None:
    requests.submit_request(store, spec("r1"), score=1.0, now=NOW, max_age_seconds=60)
    [item] = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1)
    assert requests.wait_for_request(store, "r1", timeout=0.05) is None

    embedding = np.full((1, 4), 0.5, np.float32)
    requests.complete_requests(store, [RequestResult(item, outputs={"embedding": embedding})], now=NOW + 0.25,
                               keep_seconds=60, batch_size=1, worker="w1")
    done = requests.wait_for_request(store, "r1", timeout=1)

    assert done is not None
    assert done == requests.get_request(store, "r1")  # (all but the outputs, compared below)
    assert done.status == "succeeded" and done.batch_size == 1 and done.latency_ms == 250.0
    np.testing.assert_array_equal(done.outputs["embedding"], embedding)


def test_a_snapshot_empties_the_doorbell_and_a_lease_that_leaves_work_rings_it(store: Store) -> None:
    """Rings that came before a look at the queues announce work that look sees: they are dropped, else
    each would wake an idle loop later for nothing. A lease that leaves work waiting rings once, so
    that an idle peer takes the next batch."""
    for n in range(3):
        requests.submit_request(store, spec(f"r{n}"), score=float(n), now=NOW, max_age_seconds=60)
    assert store.client.llen(store.keys.doorbell) == 3

    assert queues.QueueWatcher(store).snapshot().heads
    assert store.client.llen(store.keys.doorbell) == 0

    assert len(lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=2)) == 2
    assert store.client.llen(store.keys.doorbell) == 1  # r2 waits

    queues.QueueWatcher(store).snapshot()
    assert len(lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=2)) == 1
    assert store.client.llen(store.keys.doorbell) == 0  # nothing left: no peer to wake
