"""The beat's re-scoring pass against a real Redis: stale estimates re-estimated in bounded slices, a compare-and-set
per item, marks that stop a walk once a profile settled, PSA for every queue.

A model version's record starts as registration with `profile_mode: static` leaves it (FLOPs only: 1 s a row
here), and gets a profile as workers' observed ones do (`update_model_version`), while requests wait.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.jobs import fills as job_fills
from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import policy, re_estimate
from broker.queueing.re_estimate import SETTLE_SECONDS, StaleEstimate, rescore_queues
from broker.queueing.scoring import Factors, Weights, estimate_latency_ms, queue_key
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec, ready_ids

RECORD = {"name": "mlp", "version": "v1", "path": "/nowhere.onnx", "signature": {},
          "static_profile": {"flops_per_sample": 5e10}}  # 1000 ms a row by FLOPs
FAST = {"source": "observed", "device": "cpu", "points": [
    {"batch_size": 1, "latency_ms": 2.0, "rows_per_second": 500.0},
    {"batch_size": 8, "latency_ms": 6.0, "rows_per_second": 1333.0}]}


def register(store: Store, profile: dict[str, Any] | None = None) -> ModelRecord:
    return registry.save_model_version(store, {**RECORD, **({"profile": profile} if profile else {})})


def observe(store: Store, profile: dict[str, Any]) -> None:
    """A worker writes its observed profile into the record."""
    registry.update_model_version(store, MODEL_REF, {"profile": profile})


def submit(store: Store, request_id: str, *, rows: int = 1, now: float = NOW, tenant: str = "acme",
           deadline_in: float | None = None) -> None:
    """A request queued as intake queues it: estimated from the record as it is now."""
    record = registry.get_model(store, MODEL_REF)
    factors = Factors(level=0, est_latency_ms=estimate_latency_ms(record, rows=rows, tokens=None), enqueued_at=now)
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((rows, 4), np.float32)}, rows=rows, tokens=None, bucket="f:4",
                       factors=factors.to_dict(), tenant=tenant,
                       deadline_at=now + deadline_in if deadline_in is not None else None)
    requests.submit_request(store, spec, score=queue_key(factors, Weights()), now=now, max_age_seconds=600)


def run_pass(store: Store, now: float = NOW, **options: Any) -> re_estimate.RescoreReport:
    return rescore_queues(store, now=now, default="dynamic", capacity_of=lambda ref: 1024, **options)


def payload(store: Store, item_id: str) -> dict[str, Any]:
    return json.loads(store.client.hget(store.keys.items, item_id))


def test_a_stale_estimate_is_re_estimated_and_its_request_moves_ahead(store: Store) -> None:
    register(store)
    job_fills.create_job(store, job_spec("jbefore", rows_total=1, chunk_size=1), now=NOW - 2)
    submit(store, "rstale", rows=8)
    assert ready_ids(store) == ["jbefore:c0000000", "rstale"]  # 8 s by FLOPs: no latency points to speak of

    observe(store, FAST)
    report = run_pass(store, now=NOW + 1)

    assert ready_ids(store) == ["rstale", "jbefore:c0000000"]
    factors = payload(store, "rstale")["factors"]
    assert factors["est_latency_ms"] == pytest.approx(6.0)
    score = store.client.zscore(store.keys.ready(MODEL_REF), "rstale")
    assert score == pytest.approx(queue_key(Factors.from_dict(factors), Weights()), abs=1e-9)
    assert payload(store, "rstale")["score"] == pytest.approx(score, abs=1e-9)
    assert store.client.zscore(store.keys.ready_of_tenant(MODEL_REF, "acme"), "rstale") == score
    summary = report.to_json()
    assert summary["re_estimated"] == 1 and summary["moved_ahead"] == 1 and summary["moved_back"] == 0
    # α x (100 ms / 6 ms, at most 10) - α x 100 ms / 8000 ms, α 0.4
    assert summary["largest_move_points"] == pytest.approx(0.4 * 10 - 0.4 * (100 / 8000), abs=1e-6)
    assert store.client.hget(store.keys.counters, f"rescore_moved_latency:{MODEL_REF}") == "1"


def test_an_estimate_within_the_tolerance_is_left_as_it_is(store: Store) -> None:
    register(store, FAST)
    submit(store, "rfine")
    observe(store, {**FAST, "points": [{"batch_size": 1, "latency_ms": 2.1, "rows_per_second": 476.0}]})

    report = run_pass(store)

    assert report.models_walked == [MODEL_REF] and report.calls == 0
    assert payload(store, "rfine")["factors"]["est_latency_ms"] == 2.0


def test_an_unchanged_profile_is_walked_until_intake_may_no_longer_hold_the_old_record(store: Store) -> None:
    register(store)
    submit(store, "r1")
    assert run_pass(store, now=NOW).models_walked == [MODEL_REF]  # (a first look: no mark yet)
    assert run_pass(store, now=NOW + SETTLE_SECONDS / 2).models_walked == [MODEL_REF]
    assert run_pass(store, now=NOW + SETTLE_SECONDS + 1).models_walked == [MODEL_REF]  # the walk after it settled
    assert run_pass(store, now=NOW + SETTLE_SECONDS + 2).models_walked == []

    observe(store, FAST)  # a new profile: walked again, for SETTLE_SECONDS from this pass
    changed = run_pass(store, now=NOW + 100)
    assert changed.models_walked == [MODEL_REF] and changed.to_json()["re_estimated"] == 1
    submit(store, "r2", now=NOW + 101)  # an API process still holding the old record in its cache
    payload_r2 = payload(store, "r2")
    payload_r2["factors"]["est_latency_ms"] = 1000.0
    store.client.hset(store.keys.items, "r2", json.dumps(payload_r2))
    assert run_pass(store, now=NOW + 101).to_json()["re_estimated"] == 1
    assert run_pass(store, now=NOW + 100 + SETTLE_SECONDS + 1).models_walked == [MODEL_REF]
    assert run_pass(store, now=NOW + 100 + SETTLE_SECONDS + 2).models_walked == []


def test_a_deep_queue_is_re_estimated_in_bounded_slices_each_item_once(store: Store) -> None:
    register(store)
    for index in range(300):  # (past 128 members a ZSET is a hash table, and ZSCAN honours COUNT)
        submit(store, f"r{index:03}", now=NOW + index / 1000)
    observe(store, FAST)

    report = run_pass(store, count=32)

    assert report.to_json()["re_estimated"] == 300
    assert report.largest_call_items <= 32 and report.calls >= 300 / 32
    assert all(payload(store, f"r{index:03}")["factors"]["est_latency_ms"] == 2.0 for index in range(300))
    assert ready_ids(store) == [f"r{index:03}" for index in range(300)]  # same points for all: arrival order
    assert run_pass(store, now=NOW + 1).calls == 0  # nothing moved any more


def test_two_passes_at_once_re_estimate_each_item_once(store: Store) -> None:
    register(store)
    for index in range(200):
        submit(store, f"r{index:03}")
    observe(store, FAST)
    reports: list[re_estimate.RescoreReport] = []
    passes = [threading.Thread(target=lambda: reports.append(run_pass(store, count=8))) for _ in range(2)]
    for thread in passes:
        thread.start()
    for thread in passes:
        thread.join()

    assert sum(report.total("re_estimated") for report in reports) == 200
    assert store.client.hget(store.keys.counters, f"rescore_moved_latency:{MODEL_REF}") == "200"
    assert store.client.zcard(store.keys.ready(MODEL_REF)) == 200


def test_a_write_is_refused_for_an_item_gone_or_re_estimated_since_it_was_read_or_under_a_new_policy(
        store: Store) -> None:
    register(store)
    submit(store, "rwaiting")
    submit(store, "rleased")
    store.client.zrem(store.keys.ready(MODEL_REF), "rleased")  # (as a lease takes it out of the ready set)
    raw = policy.read_raw_policy(store)
    read_then = StaleEstimate("rwaiting", 1000.0, 2.0)

    assert re_estimate.write_estimates(store, MODEL_REF, [StaleEstimate("rwaiting", 999.0, 2.0)], raw, Weights(),
                                       "dynamic") == []
    assert re_estimate.write_estimates(store, MODEL_REF, [StaleEstimate("rleased", 1000.0, 2.0)], raw, Weights(),
                                       "dynamic") == []
    policy.save_policy(store, Weights(alpha=1.0), "dynamic")
    assert re_estimate.write_estimates(store, MODEL_REF, [read_then], raw, Weights(), "dynamic") is None
    assert payload(store, "rwaiting")["factors"]["est_latency_ms"] == 1000.0
    [(_, _, after)] = re_estimate.write_estimates(store, MODEL_REF, [read_then], policy.read_raw_policy(store),
                                                  Weights(alpha=1.0), "dynamic") or []
    assert after == pytest.approx(queue_key(Factors.from_dict(payload(store, "rwaiting")["factors"]),
                                            Weights(alpha=1.0)), abs=1e-9)


def test_the_pass_makes_the_psa_jump_of_a_queue_no_drain_loop_looks_at(store: Store) -> None:
    register(store, FAST)
    submit(store, "rurgent", deadline_in=0.05)
    before = store.client.zscore(store.keys.ready(MODEL_REF), "rurgent")

    report = rescore_queues(store, now=NOW, default="dynamic", capacity_of=lambda ref: 1)  # load 1/1 > 0.75

    assert report.to_json()["psa_jumps"] == 1
    assert payload(store, "rurgent")["factors"]["level"] == 15
    assert ready_ids(store) == ["rurgent"]
    assert store.client.zscore(store.keys.ready(MODEL_REF), "rurgent") < before - 1000  # express now
    assert store.client.hget(store.keys.counters, f"rescore_moved_psa:{MODEL_REF}") == "1"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(level=st.integers(0, 15), sla=st.sampled_from([1.0, 2.0, 3.0]), complexity=st.floats(0, 1),
       order_back=st.one_of(st.none(), st.floats(0, 3600)), max_level=st.integers(0, 15),
       tokens=st.one_of(st.none(), st.integers(1, 400)), new_ms=st.floats(0.001, 1e6),
       alpha=st.floats(0, 5), delta=st.floats(0, 2), ordering=st.sampled_from(["dynamic", "fifo"]))
def test_the_script_scores_exactly_as_queue_key(store: Store, level: int, sla: float, complexity: float,
                                                 order_back: float | None, max_level: int, tokens: int | None,
                                                 new_ms: float, alpha: float, delta: float, ordering: Any) -> None:
    factors = Factors(level=level, sla_weight=sla, est_latency_ms=50.0, complexity=complexity, enqueued_at=NOW,
                      tokens=tokens, order_at=None if order_back is None else NOW - order_back, max_level=max_level)
    store.client.hset(store.keys.items, "r", json.dumps({"kind": "request", "factors": factors.to_dict()}))
    store.client.zadd(store.keys.ready(MODEL_REF), {"r": 0.0})
    weights = Weights(alpha=alpha, delta=delta)

    [(_, _, after)] = re_estimate.write_estimates(store, MODEL_REF, [StaleEstimate("r", 50.0, new_ms)],
                                                  policy.read_raw_policy(store), weights, ordering) or []

    expected = queue_key(Factors.from_dict({**factors.to_dict(), "est_latency_ms": new_ms}), weights, ordering)
    assert after == pytest.approx(expected, rel=1e-12, abs=1e-6)
    assert store.client.zscore(store.keys.ready(MODEL_REF), "r") == pytest.approx(expected, rel=1e-12, abs=1e-6)
