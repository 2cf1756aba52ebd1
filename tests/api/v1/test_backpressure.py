"""Queue policy at the edge: a full queue is a 429 with Retry-After to v1 and v2 clients alike, and nothing
already queued is lost; timeouts are enforced while no worker takes anything (none runs here: the
waiting API process deals with its request at the timeout). Real Redis; a stand-in worker where one must
lease or complete, through the broker's own calls."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.online import requests
from broker.online.queue_policy import MAX_RETRY_AFTER
from broker.online.requests import RequestResult
from broker.queueing import workers
from broker.state.store import Store
from sits_api.app import create_app
from tests.api.api_helpers import Api, error_of
from tests.api.v1.test_metrics import samples, value
from tests.leasing import lease_items

ROW = [0.5] * 64
V1 = {"model": "mlp", "inputs": {"features": [ROW]}}
V2 = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}


def api_with(settings: Settings, store: Store, admin_key: str, **online: Any) -> Api:
    """The API over the test's Redis with `online` settings on top."""
    return Api(create_app(settings.with_overrides(online=online), store=store).test_client(), admin_key)


def waiting_payloads(store: Store, ref: str) -> dict[str, dict[str, Any]]:
    ids = store.client.zrange(store.keys.ready(ref), 0, -1)
    return {item_id: json.loads(store.client.hget(store.keys.items, item_id)) for item_id in ids}


def complete_all(store: Store, ref: str, *, run_started: float | None = None) -> list[str]:
    """A stand-in worker: lease everything waiting and complete it."""
    leased = lease_items(store, ref, now=time.time(), lease_seconds=30, max_items=100)
    results = [RequestResult(item, outputs={"logits": np.zeros((1, 10), np.float32)}) for item in leased]
    requests.complete_requests(store, results, now=time.time(), keep_seconds=60, batch_size=len(results),
                               worker="w", run_started=run_started, run_rows=len(results))
    return [item.item_id for item in leased]


def test_a_full_queue_answers_429_with_retry_after_to_v1_and_v2_and_keeps_what_it_holds(
        settings: Settings, store: Store, admin_key: str, mlp: dict[str, Any]) -> None:
    api = api_with(settings, store, admin_key, models={"mlp": {"max_queue_size": 2}})
    ref = f"mlp@{mlp['version']}"
    queued = [api.post("/v1/requests", json=V1).get_json()["id"] for _ in range(2)]

    v1 = api.post("/v1/requests", json=V1)
    v2 = api.post("/v2/models/mlp/infer", json=V2)

    for refused in (v1, v2):
        assert refused.status_code == 429, refused.get_json()
        assert refused.headers["Retry-After"] == str(MAX_RETRY_AFTER)  # no live worker: nothing drains
        assert refused.get_json()["code"] == "queue_full"
        assert "has 2 requests waiting" in error_of(refused) and "online.models.mlp.max_queue_size" in error_of(refused)
    assert sorted(waiting_payloads(store, ref)) == sorted(queued)  # nothing lost, nothing more queued
    scraped = samples(api.client.get("/metrics", headers=api.headers).get_data(as_text=True))
    assert value(scraped, "sits_requests_rejected_total", model="mlp", version=mlp["version"],
                 reason="queue_full") == 2
    assert value(scraped, "sits_queue_max_requests", model="mlp", version=mlp["version"]) == 2

    assert sorted(complete_all(store, ref)) == sorted(queued)
    assert [api.get(f"/v1/requests/{request_id}").get_json()["status"] for request_id in queued] == ["succeeded"] * 2
    assert api.post("/v1/requests", json=V1).status_code == 202  # room again


def test_retry_after_is_the_queue_s_drain_time_at_the_measured_rate_over_the_live_slots(
        settings: Settings, store: Store, admin_key: str, mlp: dict[str, Any]) -> None:
    api = api_with(settings, store, admin_key, models={"mlp": {"max_queue_size": 2}})
    ref = f"mlp@{mlp['version']}"
    workers.record_heartbeat(store, "w", {"streams": 2}, now=time.time())
    api.post("/v1/requests", json=V1)
    complete_all(store, ref, run_started=time.time() - 2.9)  # one request, one run of 2.9 s
    for _ in range(2):
        assert api.post("/v1/requests", json=V1).status_code == 202

    refused = api.post("/v1/requests", json=V1)

    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "3"  # 2 waiting x 2.9 s / 2 slots, rounded up


def test_a_priority_level_s_own_limit_refuses_that_level_only(settings: Settings, store: Store, admin_key: str,
                                                              mlp: dict[str, Any]) -> None:
    api = api_with(settings, store, admin_key, batching={"priority_levels": {15: {"max_queue_size": 1}}})

    assert api.post("/v1/requests", json=V1 | {"priority": 15}).status_code == 202
    urgent = api.post("/v1/requests", json=V1 | {"priority": 15})
    routine = api.post("/v1/requests", json=V1 | {"priority": 3})
    v2_urgent = api.post("/v2/models/mlp/infer", json=V2 | {"parameters": {"priority": 1}})  # Triton's 1: level 15

    assert urgent.status_code == 429 and "priority level 15 of model" in error_of(urgent)
    assert "priority_levels.15.max_queue_size" in error_of(urgent) and urgent.headers["Retry-After"]
    assert routine.status_code == 202
    assert v2_urgent.status_code == 429 and "priority level 15" in error_of(v2_urgent)
    scraped = samples(api.client.get("/metrics", headers=api.headers).get_data(as_text=True))
    level = {"model": "mlp", "version": mlp["version"], "level": "15"}
    assert value(scraped, "sits_queue_level_waiting_requests", **level) == 1
    assert value(scraped, "sits_queue_level_max_requests", **level) == 1


def test_a_waiting_client_is_answered_at_its_reject_timeout_though_no_worker_takes_anything(
        settings: Settings, store: Store, admin_key: str, mlp: dict[str, Any]) -> None:
    api = api_with(settings, store, admin_key, models={"mlp": {"default_timeout": "200ms"}})

    began = time.monotonic()
    by_default = api.post("/v1/requests?wait=true", json=V1)
    waited = time.monotonic() - began
    own = api.post("/v1/requests?wait=true", json=V1 | {"timeout_ms": 50})  # shorter than the default: its own

    for answer in (by_default, own):
        body = answer.get_json()
        assert answer.status_code == 200 and (body["status"], body["error_code"]) == ("failed", "timeout"), body
    assert 0.2 <= waited < 1.5  # at the timeout, not at online.max_wait (30 s)
    assert "(0.2 s)" in by_default.get_json()["error"] and "(0.05 s)" in own.get_json()["error"]
    assert waiting_payloads(store, f"mlp@{mlp['version']}") == {}


def test_a_request_past_its_delay_timeout_stays_queued_at_the_lowest_level(
        settings: Settings, store: Store, admin_key: str, mlp: dict[str, Any]) -> None:
    api = api_with(settings, store, admin_key, models={"mlp": {"default_timeout": "50ms", "timeout_action": "delay"}})
    ref = f"mlp@{mlp['version']}"

    answer = api.post("/v1/requests?wait=true", json=V1 | {"priority": 9, "deadline_ms": 300})

    assert answer.status_code == 202  # not failed at 50 ms: still waiting when its deadline's wait ended
    [payload] = waiting_payloads(store, ref).values()
    assert (payload["factors"]["level"], payload["factors"]["base_level"]) == (0, 9)
    [done] = complete_all(store, ref)
    assert api.get(f"/v1/requests/{done}").get_json()["status"] == "succeeded"


def test_without_timeout_override_a_v2_timeout_only_orders_the_queue(
        settings: Settings, store: Store, admin_key: str, mlp: dict[str, Any]) -> None:
    api = api_with(settings, store, admin_key, max_wait="300ms", batching={"allow_timeout_override": False})

    answer = api.post("/v2/models/mlp/infer", json=V2 | {"parameters": {"timeout": 1000}})

    assert answer.status_code == 504 and "online.max_wait" in error_of(answer)  # waited, not failed at 1 ms
    [payload] = waiting_payloads(store, f"mlp@{mlp['version']}").values()
    assert "expires_at" not in payload


@pytest.mark.parametrize("timeout_ms", [0, -5, "1s", True])
def test_a_v1_timeout_must_be_a_positive_number_of_milliseconds(api: Api, mlp: dict[str, Any],
                                                                timeout_ms: object) -> None:
    answer = api.post("/v1/requests", json=V1 | {"timeout_ms": timeout_ms})

    assert answer.status_code == 400 and "timeout_ms" in error_of(answer)
