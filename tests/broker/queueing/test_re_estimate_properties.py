"""Property: the beat's re-scoring, interleaved with enqueue / lease / complete / expire and profile changes, never
loses or duplicates a request, and keeps every score and every tenant index right.

A hypothesis state machine drives the real scripts on the session's Redis. A re-scoring pass is split where a
real one can be overtaken: it reads the payloads (`stale_estimates`) at one step and writes (`write_estimates`)
at a later one, while leases, completions, expiries, new requests and new profiles come in between; whole
passes (`rescore_queues`) run too. After every step each request is in exactly one place (waiting, leased or
answered), each waiting one is scored as `queue_key` scores its payload, and each tenant's index holds exactly
its waiting items at their scores.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from broker.models import registry
from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.queueing import policy, re_estimate, reaping
from broker.queueing.leases import LeasedItem
from broker.queueing.scoring import Factors, Weights, estimate_latency_ms, queue_key
from broker.state.embedded import EmbeddedRedis
from broker.state.keys import Keys
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, fresh_prefix
from tests.leasing import lease_items

TENANTS = ("a", "b")
MAX_REQUESTS = 12


class ReEstimateMachine(RuleBasedStateMachine):
    """Requests of one model whose profile changes while they wait; workers; re-scoring passes, some split."""

    redis_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.client: Any = redis.Redis.from_url(self.redis_url, decode_responses=True)
        self.store = Store(client=self.client, keys=Keys(prefix=fresh_prefix()))
        self.now = NOW
        self.submitted: list[str] = []
        self.answered: set[str] = set()
        self.held: list[LeasedItem] = []
        registry.save_model_version(self.store, {"name": "mlp", "version": "v1", "path": "/x.onnx", "signature": {},
                                                 "static_profile": {"flops_per_sample": 5e10}})

    def teardown(self) -> None:
        for key in self.client.scan_iter(f"{self.store.keys.prefix}:*", count=1000):
            self.client.delete(key)
        self.client.close()

    @precondition(lambda self: len(self.submitted) < MAX_REQUESTS)
    @rule(rows=st.integers(1, 3), tenant=st.sampled_from(TENANTS), deadline=st.booleans(),
          cached_ms=st.sampled_from([None, 1000.0, 0.5]))
    def submit(self, rows: int, tenant: str, deadline: bool, cached_ms: float | None) -> None:
        """Intake queues a request, estimated from the record as it is, or (`cached_ms`) from one an API process
        still holds in its cache."""
        record = registry.get_model(self.store, MODEL_REF)
        estimate = estimate_latency_ms(record, rows=rows, tokens=None) if cached_ms is None else cached_ms * rows
        factors = Factors(level=0, est_latency_ms=estimate, enqueued_at=self.now)
        request_id = f"r{len(self.submitted)}"
        spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                           inputs={"x": np.zeros((rows, 2), np.float32)}, rows=rows, tokens=None, bucket="x:2",
                           factors=factors.to_dict(), tenant=tenant,
                           deadline_at=self.now + 0.05 if deadline else None)
        weights, ordering = policy.get_policy(self.store, default="dynamic")
        requests.submit_request(self.store, spec, score=queue_key(factors, weights, ordering), now=self.now,
                                max_age_seconds=3600, policy_json=policy.read_raw_policy(self.store))
        self.submitted.append(request_id)

    @rule(latency_ms=st.sampled_from([0.5, 2.0, 40.0, 900.0]))
    def profile_changes(self, latency_ms: float) -> None:
        """A worker writes an observed profile (or a re-profile lands)."""
        registry.update_model_version(self.store, MODEL_REF, {"profile": {"source": "observed", "points": [
            {"batch_size": 1, "latency_ms": latency_ms, "rows_per_second": 1000 / latency_ms}]}})

    @rule(alpha=st.sampled_from([0.4, 1.0]))
    def policy_changes(self, alpha: float) -> None:
        """An admin changes the weights; everything waiting is re-scored (`PUT /v1/policy`)."""
        weights = Weights(alpha=alpha)
        policy.save_policy(self.store, weights, "dynamic")
        policy.rescore_all(self.store, weights, "dynamic", settle_seconds=0)

    @rule(most=st.integers(1, 3))
    def lease(self, most: int) -> None:
        self.held += lease_items(self.store, MODEL_REF, now=self.now, lease_seconds=30, max_items=most)

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 10))
    def complete(self, pick: int) -> None:
        item = self.held.pop(pick % len(self.held))
        if requests.complete_requests(self.store, [RequestResult(item, outputs={})], now=self.now,
                                      keep_seconds=3600, batch_size=1, worker="w1"):
            self.answered.add(item.item_id)

    @rule()
    def leases_expire(self) -> None:
        """A worker died: its leases lapse and the reaper returns the items to the queue."""
        self.now += 31
        reaping.reap_expired_leases(self.store, now=self.now, max_attempts=100)
        self.held = []

    @rule(meanwhile=st.lists(st.sampled_from(["lease", "complete", "expire", "submit", "profile", "pass"]),
                             max_size=3))
    def overtaken_pass(self, meanwhile: list[str]) -> None:
        """A pass reads the waiting requests' payloads, decides what moved, and writes it only after the other
        operations in `meanwhile` ran."""
        keys = self.store.keys
        ids = list(self.client.zrange(keys.waiting_requests(MODEL_REF), 0, -1))
        payloads = dict(zip(ids, self.client.hmget(keys.items, ids), strict=True)) if ids else {}
        read = re_estimate.stale_estimates(payloads, registry.get_model(self.store, MODEL_REF),
                                           tolerance=re_estimate.TOLERANCE)
        read_policy = policy.read_raw_policy(self.store)
        weights, ordering = policy.get_policy(self.store, default="dynamic")
        for operation in meanwhile:
            if operation == "lease":
                self.lease(3)
            elif operation == "complete" and self.held:
                self.complete(0)
            elif operation == "expire":
                self.leases_expire()
            elif operation == "submit" and len(self.submitted) < MAX_REQUESTS:
                self.submit(1, "a", False, 1000.0)
            elif operation == "profile":
                self.profile_changes(0.5)
            elif operation == "pass":
                self.whole_pass(0.0)
        re_estimate.write_estimates(self.store, MODEL_REF, read, read_policy, weights, ordering)

    @rule(seconds=st.sampled_from([0.0, 1.0, 10.0]))
    def whole_pass(self, seconds: float) -> None:
        self.now += seconds
        re_estimate.rescore_queues(self.store, now=self.now, default="dynamic", capacity_of=lambda ref: 2)

    @invariant()
    def each_request_is_in_exactly_one_place(self) -> None:
        keys = self.store.keys
        ready = self.client.zrange(keys.ready(MODEL_REF), 0, -1)
        leased = self.client.zrange(keys.inflight(MODEL_REF), 0, -1)
        places = [*ready, *leased, *self.answered]
        assert sorted(places) == sorted(self.submitted), "a request was lost or duplicated"
        assert set(self.client.zrange(keys.waiting_requests(MODEL_REF), 0, -1)) == set(ready)

    @invariant()
    def waiting_items_are_scored_from_their_payloads_and_indexed_by_tenant(self) -> None:
        keys = self.store.keys
        weights, ordering = policy.get_policy(self.store, default="dynamic")
        scored = dict(self.client.zrange(keys.ready(MODEL_REF), 0, -1, withscores=True))
        by_tenant: dict[str, dict[str, float]] = {tenant: {} for tenant in TENANTS}
        for item_id, score in scored.items():
            payload = json.loads(self.client.hget(keys.items, item_id))
            expected = queue_key(Factors.from_dict(payload["factors"]), weights, ordering)
            assert abs(score - expected) < 1e-6, (item_id, score, expected)
            by_tenant[payload["tenant"]][item_id] = score
        for tenant in TENANTS:
            indexed = dict(self.client.zrange(keys.ready_of_tenant(MODEL_REF, tenant), 0, -1, withscores=True))
            assert indexed == by_tenant[tenant], tenant


def test_re_estimating_among_other_operations_loses_duplicates_or_misscores_nothing(
        redis_server: EmbeddedRedis) -> None:
    class OnSessionRedis(ReEstimateMachine):
        redis_url = redis_server.url

    run_state_machine_as_test(OnSessionRedis, settings=settings(
        max_examples=100, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
