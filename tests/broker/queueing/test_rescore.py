"""Hot policy updates: a deep queue (20,000 waiting items; 100,000 under `-m slow`) re-scored in slices
while enqueue and lease go on.

How long each slice blocks Redis is a speed figure, measured by `benchmarks/rescore.py`
(Redis's own SLOWLOG); here the behaviour is checked: bounded slices, nothing lost or
duplicated, every score right, traffic served meanwhile.
"""

from __future__ import annotations

import json
import math
import threading

import pytest

from broker.jobs import fills as job_fills
from broker.queueing import policy
from broker.queueing.scoring import Factors, Weights, queue_key
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec
from tests.leasing import lease_items


def _fill(store: Store, count: int) -> None:
    for start in range(0, count, 20_000):  # 20,000 chunks a call: the setup itself is not under test
        spec = job_spec(f"jbulk{start}", rows_total=20_000, chunk_size=1, priority=start % 7)
        job_fills.create_job(store, spec, now=NOW + start / 1000)


@pytest.mark.parametrize("waiting", [20_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_a_hot_update_rescores_a_deep_queue_in_bounded_slices_while_traffic_goes_on(store: Store,
                                                                                  waiting: int) -> None:
    _fill(store, waiting)
    client = store.client
    stop = threading.Event()
    counts = {"enqueued": 0, "leased": 0}

    def traffic() -> None:  # enqueue (with the live policy, as the API does) and lease go on meanwhile
        n = 0
        while not stop.is_set():
            n += 1
            live, ordering = policy.get_policy(store, default="dynamic")
            job_fills.create_job(store, job_spec(f"jlive{n}", rows_total=2, chunk_size=1), now=NOW + 200,
                            weights=live, ordering=ordering)
            counts["enqueued"] += 2
            counts["leased"] += len(lease_items(store, MODEL_REF, now=NOW + 200, lease_seconds=60,
                                                       max_items=1))
            stop.wait(0.002)  # steady traffic, not a busy loop fighting Redis for the 2 cores

    thread = threading.Thread(target=traffic)
    thread.start()
    weights = Weights(alpha=1.0, beta=0.5, delta=0.5)
    try:
        policy.save_policy(store, weights, "dynamic")
        report = policy.rescore_all(store, weights, "dynamic")
    finally:
        stop.set()
        thread.join()

    assert report["rescored"] >= waiting and report["calls"] > waiting / 100
    # ZSCAN COUNT 32 walks 32 buckets of the set's hash table, and both tables while it is being resized
    # (two to three times as many items, seen at 20,000 and 50,000 items): bounded whatever the depth
    assert report["largest_call_items"] <= 8 * 32, "a slice must stay bounded (ZSCAN COUNT 32)"
    assert counts["enqueued"] > 0 and counts["leased"] > 0
    ready = client.zcard(store.keys.ready(MODEL_REF))
    inflight = client.zcard(store.keys.inflight(MODEL_REF))
    assert ready + inflight == waiting + counts["enqueued"], "an item was lost or duplicated"
    assert client.hlen(store.keys.items) == ready + inflight
    scored = client.zrange(store.keys.ready(MODEL_REF), 0, -1, withscores=True)
    payloads = client.hmget(store.keys.items, [item_id for item_id, _ in scored])
    for (item_id, score), payload in zip(scored, payloads, strict=True):
        factors = Factors.from_dict(json.loads(payload)["factors"])
        assert score == pytest.approx(queue_key(factors, weights), rel=1e-12), item_id


def test_fifo_ordering_serves_by_arrival_whatever_the_priority(store: Store) -> None:
    job_fills.create_job(store, job_spec("jfirst", rows_total=1, chunk_size=1, priority=0), now=NOW)
    job_fills.create_job(store, job_spec("jurgent", rows_total=1, chunk_size=1, priority=15), now=NOW + 1)
    policy.save_policy(store, Weights(), "fifo")
    policy.rescore_all(store, Weights(), "fifo")

    [first] = lease_items(store, MODEL_REF, now=NOW + 2, lease_seconds=30, max_items=1)

    assert first.item_id == "jfirst:c0000000"


def test_policy_updates_reject_unknown_keys_and_bad_values() -> None:
    from broker.errors import BadInput

    with pytest.raises(BadInput, match="unknown policy keys"):
        policy.parse_policy_update({"alpah": 1}, Weights(), "dynamic")
    with pytest.raises(BadInput, match="ordering"):
        policy.parse_policy_update({"ordering": "lifo"}, Weights(), "dynamic")
    with pytest.raises(BadInput, match="alpha"):
        policy.parse_policy_update({"alpha": -1}, Weights(), "dynamic")
    for bad in ({"alpha": math.nan}, {"alpha": math.inf}, {"delta": 1e300}, {"express_level": 99},
                {"express_level": 12.5}, {"psa_load": 1.5}, {"beta": "0.3"}, {"gamma": True}):
        with pytest.raises(BadInput, match=f"'{next(iter(bad))}' must be a (whole )?number from"):
            policy.parse_policy_update(bad, Weights(), "dynamic")
    edges, _ = policy.parse_policy_update({"express_level": 16, "psa_load": 1, "alpha": 0, "delta": 1000},
                                          Weights(), "dynamic")
    assert (edges.express_level, edges.psa_load, edges.alpha, edges.delta) == (16, 1.0, 0.0, 1000.0)
    assert isinstance(edges.express_level, int) and isinstance(edges.alpha, float)
    weights, ordering = policy.parse_policy_update({"alpha": 2, "ordering": "fifo"}, Weights(), "dynamic")
    assert weights.alpha == 2.0 and ordering == "fifo"


def test_a_stored_policy_with_values_out_of_range_reads_them_as_defaults(store: Store) -> None:
    """An older version stored a NaN weight as null: scoring and the next update must still work."""
    store.client.set(store.keys.policy, json.dumps({"weights": {"alpha": None, "delta": 0.5, "gone": 1},
                                                    "ordering": "dynamic"}))

    weights, ordering = policy.get_policy(store, default="fifo")

    assert (weights.alpha, weights.delta, ordering) == (Weights().alpha, 0.5, "dynamic")
