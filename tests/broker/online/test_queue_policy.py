"""The queue policy of online requests: its configuration, its decisions, the atomic limit in the submit
script and the timeout pass (real Redis; time passed in)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.errors import ConfigError, InferenceTimeout
from broker.online import requests
from broker.online import timeouts as request_timeouts
from broker.online.queue_policy import (
    MAX_RETRY_AFTER,
    QueuePolicy,
    policy_for,
    request_timeout,
    retry_after_seconds,
    seconds_per_request,
)
from broker.online.requests import QueueAtLimit, RequestSpec
from broker.queueing import leases, policy, reaping
from broker.queueing.scoring import Factors, Weights, queue_key
from broker.state.store import Store
from tests.broker.broker_helpers import NOW
from tests.leasing import lease_items

MODEL = "mlp@v1"


def online(**section: object) -> Settings:
    return Settings().with_overrides(online=section)


def spec(request_id: str, *, level: int = 0, now: float = NOW, **timeouts: float) -> RequestSpec:
    factors = Factors(level=level, est_latency_ms=5.0, enqueued_at=now)
    return RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None, bucket="",
                       factors=factors.to_dict(), **timeouts)  # type: ignore[arg-type]


def submit(store: Store, request: RequestSpec, *, most: int = 0, most_at_level: int = 0) -> None:
    factors = Factors.from_dict(request.factors)
    requests.submit_request(store, request, score=queue_key(factors, Weights()), now=factors.enqueued_at,
                            max_age_seconds=600, max_waiting=most, max_waiting_at_level=most_at_level)


# --- configuration and decisions -------------------------------------------------------------


def test_the_queue_keys_sit_beside_the_batching_keys_and_a_level_overrides_only_what_it_sets() -> None:
    settings = online(batching={"default_timeout": "2s", "max_queue_size": 100},
                      models={"bert": {"timeout_action": "delay",
                                       "priority_levels": {15: {"max_queue_size": 10, "default_timeout": "100ms"}}}})

    assert policy_for(settings.online, "mlp", 15) == QueuePolicy(
        max_queue_size=100, level_max_queue_size=0, default_timeout=2.0, timeout_action="reject",
        allow_timeout_override=True)
    assert policy_for(settings.online, "bert", 15) == QueuePolicy(
        max_queue_size=100, level_max_queue_size=10, default_timeout=0.1, timeout_action="delay",
        allow_timeout_override=True)
    assert policy_for(settings.online, "bert", 3).default_timeout == 2.0  # a level without an entry: the model's


@pytest.mark.parametrize(("section", "says"), [
    ({"batching": {"priority_levels": {16: {"max_queue_size": 1}}}}, "16 is not a priority level: use 0 to 15"),
    ({"batching": {"priority_levels": {"high": {}}}}, "'high' is not a priority level"),
    ({"batching": {"priority_levels": [15]}}, "not a mapping of priority levels"),
    ({"batching": {"timeout_action": "drop"}}, "online.batching.timeout_action: Input should be 'reject' or 'delay'"),
    ({"batching": {"default_timeout": "soon"}}, "'soon' is not a duration"),
    ({"batching": {"max_queue_size": -1}}, "online.batching.max_queue_size: Input should be greater than or equal"),
    ({"batching": {"max_queue_size": True}}, "is a boolean, not a number"),
    ({"models": {"mlp": {"priority_levels": {3: {"max_batch_size": 8}}}}},
     "online.models.mlp.priority_levels.3.max_batch_size: unknown key"),
    ({"batching": {"max_queue_size": 5, "priority_levels": {15: {"max_queue_size": 9}}}},
     "priority_levels.15.max_queue_size (9) is above max_queue_size (5), which bounds all levels together"),
])
def test_a_wrong_queue_policy_is_a_config_error_that_names_the_key(section: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        online(**section)

    assert says in str(refused.value)


@pytest.mark.parametrize(("default", "override", "requested", "timeout"), [
    (0.0, True, None, None),   # no timeout anywhere
    (0.0, True, 0.3, 0.3),     # no default: the request's own applies
    (2.0, True, None, 2.0),    # the default for a request that names none
    (2.0, True, 0.3, 0.3),     # a shorter one of its own
    (2.0, True, 5.0, 2.0),     # never a longer one (Triton's rule)
    (2.0, False, 0.3, 2.0),    # no override: the default
    (0.0, False, 0.3, None),   # no override, no default: none
])
def test_a_request_s_timeout_follows_triton_s_rule(default: float, override: bool, requested: float | None,
                                                   timeout: float | None) -> None:
    queue = QueuePolicy(max_queue_size=0, level_max_queue_size=0, default_timeout=default,
                        timeout_action="reject", allow_timeout_override=override)

    assert request_timeout(queue, requested) == timeout


def test_retry_after_is_the_time_the_waiting_requests_take_to_drain_in_whole_seconds_within_bounds() -> None:
    assert retry_after_seconds(40, 0.25, 2) == 5           # 40 x 0.25 s over 2 slots
    assert retry_after_seconds(3, 0.001, 4) == 1           # a fast queue: at least 1 s
    assert retry_after_seconds(10_000, 1.0, 1) == MAX_RETRY_AFTER
    assert retry_after_seconds(5, 0.1, 0) == MAX_RETRY_AFTER  # no live worker: nothing drains
    assert retry_after_seconds(5, None, 2) == MAX_RETRY_AFTER
    # 10 runs of 4 requests, each run 0.2 s: 0.05 s a request
    assert seconds_per_request({"infer_count": 40, "infer_ns": 40 * 200_000_000, "execution_count": 10}) == 0.05
    assert seconds_per_request({}) is None


# --- the limit in the submit script ----------------------------------------------------------------


def test_a_full_queue_takes_nothing_and_says_how_many_wait(store: Store) -> None:
    for index in range(3):
        submit(store, spec(f"r{index}"), most=3)

    with pytest.raises(QueueAtLimit) as full:
        submit(store, spec("r3"), most=3)

    assert (full.value.waiting, full.value.level) == (3, None)
    assert store.client.zrange(store.keys.ready(MODEL), 0, -1) == ["r0", "r1", "r2"]
    assert not store.client.exists(store.keys.request("r3"))
    assert store.client.hget(store.keys.counters, f"requests_rejected_queue_full:{MODEL}") == "1"


def test_leased_requests_do_not_count_and_requests_back_in_the_queue_count_again(store: Store) -> None:
    for index in range(2):
        submit(store, spec(f"r{index}"), most=2)
    leased = lease_items(store, MODEL, now=NOW, lease_seconds=10, max_items=2)

    submit(store, spec("r2"), most=2)  # the two leased ones are in a batch: room for two more
    assert leases.return_unrun(store, leased[:1]) == 1  # one goes back: the queue is full again
    with pytest.raises(QueueAtLimit):
        submit(store, spec("r3"), most=2)
    reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=3)  # the other's lease ran out

    assert store.client.zcard(store.keys.waiting_requests(MODEL)) == 3
    riders = leases.lease_riders(store, MODEL, "", now=NOW + 11, lease_seconds=10, max_items=3, max_rows=3)
    assert len(riders) == 3 and store.client.zcard(store.keys.waiting_requests(MODEL)) == 0


def test_a_level_s_limit_counts_that_level_only(store: Store) -> None:
    submit(store, spec("urgent", level=15), most_at_level=1)
    submit(store, spec("routine", level=0), most_at_level=1)

    with pytest.raises(QueueAtLimit) as full:
        submit(store, spec("urgent-2", level=15), most_at_level=1)

    assert (full.value.waiting, full.value.level) == (1, 15)
    assert store.client.hget(store.keys.counters, f"requests_rejected_level_full:{MODEL}") == "1"


def test_submits_racing_for_the_last_places_never_overfill_the_queue(store: Store) -> None:
    accepted: list[str] = []
    refused: list[str] = []

    def client(index: int) -> None:
        try:
            submit(store, spec(f"r{index}"), most=3)
            accepted.append(f"r{index}")
        except QueueAtLimit:
            refused.append(f"r{index}")

    threads = [threading.Thread(target=client, args=(index,)) for index in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(accepted) == 3 and len(refused) == 9
    assert sorted(store.client.zrange(store.keys.ready(MODEL), 0, -1)) == sorted(accepted)


# --- timeouts ----------------------------------------------------------------------------------------


def expire(store: Store, now: float) -> request_timeouts.TimeoutPass:
    return request_timeouts.expire_timed_out(store, MODEL, now=now, weights=Weights(), ordering="dynamic",
                                             keep_seconds=60)


def test_a_request_still_waiting_at_its_reject_timeout_fails_as_timed_out_and_leaves_the_queue(
        store: Store) -> None:
    submit(store, spec("late", expires_at=NOW + 0.2))
    submit(store, spec("patient", expires_at=NOW + 60))

    assert expire(store, NOW + 0.1).rejected == []
    assert expire(store, NOW + 0.3).rejected == ["late"]
    assert expire(store, NOW + 0.4).rejected == []  # once

    late = requests.get_request(store, "late")
    assert (late.status, late.error_code) == ("failed", InferenceTimeout.code)
    assert "within its 'timeout'; it is not run" in late.error and "(0.2 s)" in late.error
    assert store.client.hget(store.keys.counters, f"requests_failed:{MODEL}") == "1"  # answered once
    assert store.client.zrange(store.keys.ready(MODEL), 0, -1) == ["patient"]
    assert store.client.zrange(store.keys.waiting_requests(MODEL), 0, -1) == ["patient"]
    assert store.client.zcard(store.keys.inflight(MODEL)) == 0


def test_a_request_past_its_delay_timeout_drops_behind_its_level_and_still_waits(store: Store) -> None:
    submit(store, spec("delayed", level=8, delay_at=NOW + 0.2))
    submit(store, spec("fresh", level=8, now=NOW + 1))

    assert store.client.zrange(store.keys.ready(MODEL), 0, -1) == ["delayed", "fresh"]
    assert expire(store, NOW + 1).delayed == ["delayed"]

    assert store.client.zrange(store.keys.ready(MODEL), 0, -1) == ["fresh", "delayed"]
    factors = json.loads(store.client.hget(store.keys.items, "delayed"))["factors"]
    assert (factors["level"], factors["base_level"]) == (0, 8)
    assert store.client.zscore(store.keys.waiting_requests(MODEL), "delayed") == 8  # still counts at its level
    assert requests.get_request(store, "delayed").status == "queued"
    assert expire(store, NOW + 2) == request_timeouts.TimeoutPass(rejected=[], delayed=[])  # once


def test_a_request_a_worker_holds_is_left_to_it_and_a_finished_one_leaves_the_index(store: Store) -> None:
    submit(store, spec("running", expires_at=NOW + 0.2))
    [held] = lease_items(store, MODEL, now=NOW, lease_seconds=10, max_items=1)

    assert expire(store, NOW + 1).rejected == []
    assert store.client.zcard(store.keys.request_timeouts(MODEL)) == 1  # its lease may yet run out
    requests.complete_requests(store, [requests.RequestResult(held, outputs={})], now=NOW + 1, keep_seconds=60,
                               batch_size=1, worker="w1")
    expire(store, NOW + 2)

    assert requests.get_request(store, "running").status == "succeeded"
    assert store.client.zcard(store.keys.request_timeouts(MODEL)) == 0


def test_a_reject_timeout_survives_a_lease_lost_before_it_passed(store: Store) -> None:
    """A worker leases the request in time and dies; the reaper brings it back past its timeout."""
    submit(store, spec("orphan", expires_at=NOW + 5))
    lease_items(store, MODEL, now=NOW, lease_seconds=10, max_items=1)
    expire(store, NOW + 6)
    reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=3)

    assert expire(store, NOW + 11).rejected == ["orphan"]
    assert requests.get_request(store, "orphan").error_code == InferenceTimeout.code


def test_the_delayed_score_follows_a_hot_policy_update(store: Store) -> None:
    submit(store, spec("delayed", level=8, delay_at=NOW + 0.2))
    expire(store, NOW + 1)
    weights = Weights(alpha=0.9)
    policy.rescore_all(store, weights, "dynamic", settle_seconds=0)

    factors = Factors.from_dict(json.loads(store.client.hget(store.keys.items, "delayed"))["factors"])
    assert factors.level == 0
    assert store.client.zscore(store.keys.ready(MODEL), "delayed") == pytest.approx(queue_key(factors, weights))
