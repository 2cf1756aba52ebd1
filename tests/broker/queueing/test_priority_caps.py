"""A tenant's cap (`Factors.max_level`, its `max_priority`) bounds what deadlines do: PSA jumps stop at it,
and deadline ordering gains a capped item no more points than asking its cap would (real Redis)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest

from broker.jobs import fills as job_fills
from broker.jobs import stops as job_stops
from broker.jobs.records import job_factors, job_order_time
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import policy
from broker.queueing.scoring import Factors, Weights, deadline_order_time, deadline_reach, psa_jump_level, queue_key
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec, ready_ids


def submit(store: Store, request_id: str, *, level: int, deadline_in: float | None, cap: int | None = None,
           tenant: str = "") -> None:
    """A request as the API queues it; `cap` its tenant's max_priority (None: uncapped)."""
    factors = Factors(level=level, enqueued_at=NOW, est_latency_ms=5.0)
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 4), np.float32)}, rows=1, tokens=None, bucket="f:4",
                       factors={**factors.to_dict(), **({"max_level": cap} if cap is not None else {})},
                       deadline_at=NOW + deadline_in if deadline_in else None, tenant=tenant)
    requests.submit_request(store, spec, score=queue_key(factors, Weights()), now=NOW, max_age_seconds=60)


def factors_of(store: Store, item_id: str) -> dict[str, Any]:
    return dict(json.loads(store.client.hget(store.keys.items, item_id))["factors"])


def test_a_capped_tenant_s_near_deadline_under_load_is_not_raised_past_its_cap(store: Store) -> None:
    """A full queue, three requests 50 ms from their deadlines: the uncapped one jumps to 15 as before; the
    one capped at 5 stops at 5; the one capped at the level it asked (3) does not jump. Other work of
    level 10 so stays ahead of both capped ones, and every one of them leaves the deadline index."""
    submit(store, "rcapped", level=3, deadline_in=0.05, cap=3, tenant="cheap")
    submit(store, "rroom", level=0, deadline_in=0.05, cap=5, tenant="cheap")
    submit(store, "rfree", level=3, deadline_in=0.05, tenant="free")
    submit(store, "rlegit", level=10, deadline_in=None, tenant="other")

    jumped = policy.apply_psa(store, MODEL_REF, Weights(), "dynamic", now=NOW, capacity=4)

    assert sorted(jumped) == ["rfree", "rroom"]
    assert factors_of(store, "rfree")["level"] == 15
    assert (factors_of(store, "rroom")["level"], factors_of(store, "rroom")["base_level"]) == (5, 0)
    assert factors_of(store, "rcapped")["level"] == 3
    assert ready_ids(store) == ["rfree", "rlegit", "rroom", "rcapped"]
    assert store.client.zcard(store.keys.deadlines(MODEL_REF)) == 0


def test_an_item_capped_above_12_jumps_to_12_and_then_only_to_its_cap(store: Store) -> None:
    submit(store, "rwatch", level=0, deadline_in=0.15, cap=13)
    for index in range(3):
        submit(store, f"rfill{index}", level=0, deadline_in=None)

    assert policy.apply_psa(store, MODEL_REF, Weights(), "dynamic", now=NOW, capacity=4) == ["rwatch"]
    assert factors_of(store, "rwatch")["level"] == 12
    assert store.client.zcard(store.keys.deadlines(MODEL_REF)) == 1  # it may rise further
    assert policy.apply_psa(store, MODEL_REF, Weights(), "dynamic", now=NOW + 0.07, capacity=4) == ["rwatch"]
    assert factors_of(store, "rwatch")["level"] == 13
    assert store.client.zcard(store.keys.deadlines(MODEL_REF)) == 0


@pytest.mark.parametrize(
    ("remaining_ms", "base_level", "cap", "expected"),
    [
        (50, 0, 15, 15),     # uncapped: as before
        (50, 0, 5, 5),       # under 100 ms: 15, capped to 5
        (150, 0, 5, 5),      # 100-200 ms: 12, capped to 5
        (150, 0, 13, 12),    # a cap above the target changes nothing
        (50, 3, 3, None),    # a cap not above the base level: no jump
        (250, 0, 5, None),   # not urgent yet
    ],
)
def test_psa_stops_at_the_cap_and_the_lua_agrees_with_the_pure_rule(store: Store, remaining_ms: float,
                                                                    base_level: int, cap: int,
                                                                    expected: int | None) -> None:
    submit(store, "rwatch", level=base_level, deadline_in=remaining_ms / 1000, cap=cap)
    for index in range(3):
        submit(store, f"rfill{index}", level=0, deadline_in=None)

    jumped = policy.apply_psa(store, MODEL_REF, Weights(), "dynamic", now=NOW, capacity=4)

    decision = psa_jump_level(base_level=base_level, remaining_ms=remaining_ms, queue_load=1.0, weights=Weights(),
                              max_level=cap)
    assert decision == expected
    assert jumped == (["rwatch"] if expected else [])
    assert factors_of(store, "rwatch")["level"] == (expected or base_level)


# --- deadline ordering -------------------------------------------------------------------------------


def test_a_deadline_reaches_as_far_as_the_points_up_to_the_cap() -> None:
    assert deadline_reach(0, 3, 0.1) == pytest.approx(30.0)  # 3 points at 0.1 a second
    assert deadline_reach(3, 3, 0.1) == deadline_reach(5, 3, 0.1) == 0.0
    assert deadline_reach(0, 15, 0.1) == deadline_reach(0, 3, 0.0) == math.inf  # uncapped; no aging at all
    # within its reach, a capped tenant's deadlines still order its own items earliest first
    assert deadline_order_time(NOW, NOW + 5, 300, 30) == NOW - 25
    assert deadline_order_time(NOW, NOW + 20, 300, 30) == NOW - 10
    assert deadline_order_time(NOW, NOW + 60, 300, 30) == NOW  # beyond it: arrival order
    assert deadline_order_time(NOW, NOW + 60, 300) == NOW - 240  # uncapped: the whole horizon, as before


@pytest.mark.parametrize("level", [0, 2, 3])
@pytest.mark.parametrize("due_in", [0.0, 1.0, 5.0, 29.0, 60.0, 299.0, 3600.0])
def test_a_capped_job_s_deadline_never_ranks_it_above_a_new_job_at_its_cap(level: int, due_in: float) -> None:
    weights = Weights()
    order_at = job_order_time(level, 3, NOW, NOW + due_in, horizon=300, delta=weights.delta)
    capped = queue_key(job_factors(level, NOW, order_at, 3), weights)

    assert capped >= queue_key(job_factors(3, NOW), weights) - 1e-9
    uncapped = queue_key(job_factors(level, NOW, deadline_order_time(NOW, NOW + due_in, 300)), weights)
    assert uncapped <= capped  # an uncapped job's deadline lifts it at least as far, as before


def test_a_capped_job_keeps_within_its_cap_through_a_rescore_that_raises_delta(store: Store) -> None:
    """Queued at δ 0.1 with 2.5 points of its deadline (25 s of a 30 s reach); an operator then raises δ
    to 1: the Lua re-score gives it 3 points at most, the key Python computes, level with a job of its cap."""
    spec = dataclasses.replace(job_spec("jcapped", rows_total=1, chunk_size=1), deadline_at=NOW + 5,
                               max_priority=3)
    job_fills.create_job(store, spec, now=NOW, deadline_horizon=300)
    job_fills.create_job(store, job_spec("jlevel3", rows_total=1, chunk_size=1, priority=3), now=NOW)
    stored = Factors.from_dict(factors_of(store, "jcapped:c0000000"))
    assert (stored.order_at, stored.max_level) == (NOW - 25, 3)

    weights = Weights(delta=1.0)
    policy.rescore_all(store, weights, "dynamic")

    scores = dict(store.client.zrange(store.keys.ready(MODEL_REF), 0, -1, withscores=True))
    assert scores["jcapped:c0000000"] == pytest.approx(queue_key(stored, weights), rel=1e-12)
    assert scores["jcapped:c0000000"] == pytest.approx(scores["jlevel3:c0000000"], abs=1e-6)


def test_a_resume_and_a_refill_keep_the_job_s_cap(store: Store) -> None:
    spec = dataclasses.replace(job_spec("jcapped", rows_total=2, chunk_size=1), deadline_at=NOW + 65,
                               max_priority=2)
    job_fills.create_job(store, spec, now=NOW, deadline_horizon=300)
    job_stops.stop_job(store, "jcapped", status="cancelled", error="", now=NOW + 1)
    job_fills.resume_job(store, "jcapped", now=NOW + 60, deadline_horizon=300)  # the cap it recorded

    resumed = Factors.from_dict(factors_of(store, "jcapped:c0000000"))
    assert (resumed.max_level, resumed.order_at) == (2, NOW + 60 - 15)  # due in 5 s, a 20 s reach
    store.client.delete(store.keys.items)  # as if the resume's fill had stopped part-way
    store.client.delete(store.keys.ready(MODEL_REF))
    job_fills.refill_job(store, "jcapped", now=NOW + 61)
    assert Factors.from_dict(factors_of(store, "jcapped:c0000000")).max_level == 2


# --- the express lane ---------------------------------------------------------------------------------


def test_a_short_token_request_takes_the_express_lane_only_for_a_tenant_that_may_ask_its_level(
        store: Store) -> None:
    """A 20-token request is express (1,000 points ahead) for an uncapped tenant, but not for one capped
    below `express_level`: it would pass a 'vip' level-11 request of another tenant that waited a minute.
    Python's key at submit and the Lua re-score agree."""
    weights = Weights()
    short = {"level": 0, "enqueued_at": NOW, "est_latency_ms": 5.0, "tokens": 20}
    capped = Factors.from_dict({**short, "max_level": 3})
    uncapped = Factors.from_dict(short)
    vip = Factors(level=11, enqueued_at=NOW - 60, est_latency_ms=5.0)
    assert queue_key(uncapped, weights) < queue_key(vip, weights) < queue_key(capped, weights)
    assert queue_key(capped, weights) == pytest.approx(queue_key(Factors.from_dict({**short, "tokens": None}),
                                                                  weights))

    for item_id, factors in (("rcapped", capped), ("rfree", uncapped), ("rvip", vip)):
        spec = RequestSpec(request_id=item_id, model_name="mlp", model_version="v1",
                           inputs={"features": np.zeros((1, 4), np.float32)}, rows=1, tokens=factors.tokens,
                           bucket="f:4", factors=factors.to_dict(), deadline_at=None, tenant="")
        requests.submit_request(store, spec, score=0.0, now=NOW, max_age_seconds=60)  # scores set below
    policy.rescore_all(store, weights, "dynamic")
    assert ready_ids(store) == ["rfree", "rvip", "rcapped"]
