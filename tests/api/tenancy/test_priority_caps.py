"""A tenant's `max_priority` holds for what its deadlines do too: a capped tenant's near deadlines neither
order its job above other tenants' work of a level it may not ask, nor raise its requests (v1 and v2)
past its cap by a PSA jump, while an uncapped tenant's deadlines act as before (real Redis, no worker)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.queueing import policy
from broker.queueing.scoring import Weights
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from tests.api.api_helpers import Api, error_of, make_settings, shared_roots

ROW = [0.25] * 64


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    roots = shared_roots(tmp_path, zoo_dir)
    return make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        tenants={"acme": {"max_priority": 3, **roots}, "globex": roots}, sla={"admission": "off"},
        online={"max_wait": 0.3})


def key(client: FlaskClient, store: Store, name: str, tenant: str) -> Api:
    return Api(client, create_api_key(store, name, "user", tenant=tenant))


def ready_jobs(store: Store, model_ref: str) -> list[str]:
    """The job of each waiting chunk, best first."""
    return [item_id.split(":")[0] for item_id in store.client.zrange(store.keys.ready(model_ref), 0, -1)]


def factors_of(store: Store, item_id: str) -> dict[str, Any]:
    return dict(json.loads(store.client.hget(store.keys.items, item_id))["factors"])


def test_a_capped_tenant_s_near_deadline_orders_its_job_no_higher_than_its_cap(
        client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """acme (max_priority 3) asks 3 with a deadline a minute away: before, its deadline counted as four
    minutes waited (24 points), ahead of globex's level-4 work; now it gains nothing past level 3. The
    same job of uncapped globex still goes ahead."""
    alice, gary = key(client, store, "alice", "acme"), key(client, store, "gary", "globex")

    def submit(api: Api, name: str, **extra: Any) -> str:
        response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                              "output_dir": str(tmp_path / name), **extra})
        assert response.status_code == 201, error_of(response)
        return str(response.get_json()["id"])

    capped = submit(alice, "capped", priority=3, deadline_s=60)
    refused = alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                           "output_dir": str(tmp_path / "refused"), "priority": 4})
    assert refused.status_code == 403  # what its deadline must not buy it
    plain_level_4 = submit(gary, "level4", priority=4)
    uncapped = submit(gary, "uncapped", priority=3, deadline_s=60)

    assert ready_jobs(store, mlp["ref"]) == [uncapped, plain_level_4, capped]


def test_a_capped_tenant_s_requests_carry_its_cap_and_psa_raises_them_no_higher(
        client: FlaskClient, store: Store, mlp: dict[str, Any]) -> None:
    """v1 requests with a deadline 50 ms away in a full queue: globex's jumps to level 15, acme's stops at
    its cap, 3. A v2 request of acme's carries the cap as well (it waits for an answer no worker gives
    here, and stays queued when the call gives up)."""
    alice, gary = key(client, store, "alice", "acme"), key(client, store, "gary", "globex")
    v1 = {"model": "mlp", "inputs": {"features": [ROW]}, "deadline_ms": 50}
    submitted = [alice.post("/v1/requests", json=v1), gary.post("/v1/requests", json=v1)]
    assert [response.status_code for response in submitted] == [202, 202], [r.get_json() for r in submitted]
    capped, uncapped = (str(response.get_json()["id"]) for response in submitted)
    v2 = alice.post("/v2/models/mlp/infer",
                    json={"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}]})
    assert v2.status_code == 504, v2.get_json()
    [v2_item] = set(store.client.hkeys(store.keys.items)) - {capped, uncapped}

    assert factors_of(store, capped)["max_level"] == factors_of(store, v2_item)["max_level"] == 3
    assert "max_level" not in factors_of(store, uncapped)  # uncapped: as before
    ref = mlp["ref"]
    deadline = max(score for _, score in store.client.zrange(store.keys.deadlines(ref), 0, -1, withscores=True))
    jumped = policy.apply_psa(store, ref, Weights(), "dynamic", now=deadline - 0.05, capacity=2)

    assert sorted(jumped) == sorted([capped, uncapped])
    assert (factors_of(store, capped)["level"], factors_of(store, uncapped)["level"]) == (3, 15)
    assert store.client.zcard(store.keys.deadlines(ref)) == 0  # each at the most it may reach
