"""PSA priority jumps: exactly when remaining delay < 200 ms, queue load > 75 % and base level < 8."""

from __future__ import annotations

import numpy as np
import pytest

from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import policy, queues
from broker.queueing.scoring import Factors, Weights, psa_jump_level, queue_key
from broker.state.store import Store
from tests.broker.broker_helpers import NOW
from tests.leasing import lease_items

MODEL = "mlp@v1"


def submit(store: Store, request_id: str, *, level: int, deadline_in: float | None) -> None:
    factors = Factors(level=level, enqueued_at=NOW, est_latency_ms=5.0)
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 4), np.float32)}, rows=1, tokens=None, bucket="f:4",
                       factors=factors.to_dict(), deadline_at=NOW + deadline_in if deadline_in else None)
    requests.submit_request(store, spec, score=queue_key(factors, Weights()), now=NOW, max_age_seconds=60)


@pytest.mark.parametrize(
    ("remaining_ms", "load_items", "base_level", "expected"),
    [
        (50, 4, 0, 15),      # all three conditions, under 100 ms
        (150, 4, 0, 12),     # 100-200 ms
        (250, 4, 0, None),   # not urgent yet
        (50, 3, 0, None),    # load 3/4 = 75 %: not above
        (50, 4, 8, None),    # base level 8: not below
        (50, 4, 7, 15),
    ],
)
def test_psa_jumps_exactly_when_all_three_conditions_hold(store: Store, remaining_ms: float, load_items: int,
                                                          base_level: int, expected: int | None) -> None:
    submit(store, "rwatch", level=base_level, deadline_in=remaining_ms / 1000)
    for index in range(load_items - 1):
        submit(store, f"rfill{index}", level=0, deadline_in=None)

    jumped = policy.apply_psa(store, MODEL, Weights(), "dynamic", now=NOW, capacity=4)

    decision = psa_jump_level(base_level=base_level, remaining_ms=remaining_ms, queue_load=load_items / 4,
                              weights=Weights())
    assert decision == expected  # the pure rule and the Lua agree on every case
    assert jumped == (["rwatch"] if expected else [])
    [first] = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1, max_rows=1)
    if expected:
        assert first.item_id == "rwatch" and first.payload["factors"]["level"] == expected
        assert first.payload["factors"]["base_level"] == base_level


def test_psa_goes_from_12_to_15_as_the_deadline_nears_and_leaves_the_index(store: Store) -> None:
    submit(store, "rwatch", level=0, deadline_in=0.15)
    for index in range(3):
        submit(store, f"rfill{index}", level=0, deadline_in=None)

    assert policy.apply_psa(store, MODEL, Weights(), "dynamic", now=NOW, capacity=4) == ["rwatch"]
    assert policy.apply_psa(store, MODEL, Weights(), "dynamic", now=NOW + 0.01, capacity=4) == []
    assert policy.apply_psa(store, MODEL, Weights(), "dynamic", now=NOW + 0.07, capacity=4) == ["rwatch"]
    assert store.client.zcard(store.keys.deadlines(MODEL)) == 0
    score = store.client.zscore(store.keys.ready(MODEL), "rwatch")
    assert score == min(s for _, s in store.client.zrange(store.keys.ready(MODEL), 0, -1, withscores=True))


def test_a_leased_item_leaves_the_deadline_index(store: Store) -> None:
    submit(store, "rwatch", level=0, deadline_in=0.05)
    lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1)

    assert policy.apply_psa(store, MODEL, Weights(), "dynamic", now=NOW, capacity=1) == []
    assert store.client.zcard(store.keys.deadlines(MODEL)) == 0


def test_model_order_round_robin_rotates_and_the_others_follow_the_best_head() -> None:
    heads = {"a@1": 5.0, "b@1": -3.0, "c@1": 1.0}
    assert policy.model_order(heads, "fifo", None) == ["b@1", "c@1", "a@1"]
    assert policy.model_order(heads, "graph-aware-backfill", "b@1") == ["b@1", "c@1", "a@1"]
    assert policy.model_order(heads, "round-robin", None) == ["a@1", "b@1", "c@1"]
    assert policy.model_order(heads, "round-robin", "a@1") == ["b@1", "c@1", "a@1"]
    assert policy.model_order(heads, "round-robin", "c@1") == ["a@1", "b@1", "c@1"]
    assert policy.model_order({"a@1": 0.0, "c@1": 0.0}, "round-robin", "b@1") == ["c@1", "a@1"]


def test_psa_pass_only_touches_models_with_an_item_near_its_deadline(store: Store) -> None:
    submit(store, "rsoon", level=0, deadline_in=0.05)
    submit(store, "rfill", level=0, deadline_in=None)
    capacities = {MODEL: 2, "other@v1": 2}

    watcher = queues.QueueWatcher(store)
    assert policy.psa_pass(store, watcher.snapshot(), capacities.__getitem__, default="dynamic", now=NOW - 10) is False
    assert policy.psa_pass(store, watcher.snapshot(), capacities.__getitem__, default="dynamic", now=NOW) is True
    [first] = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1, max_rows=1)
    assert first.item_id == "rsoon"
