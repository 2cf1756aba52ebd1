"""One tenant holds at most `api.max_waits_per_tenant` waiting calls in an API process; others are not held up."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from tests.api.api_helpers import Api, error_of, make_settings
from tests.waiting import eventually

ROW = [[0.5] * 64]


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    return make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        api={"max_waits_per_tenant": 1}, online={"max_wait": "3s"})


def test_a_tenant_s_second_waiting_call_is_a_429_while_other_tenants_and_admins_still_wait(
        client: FlaskClient, store: Store, api: Api, mlp: dict[str, Any]) -> None:
    """No worker runs here: a waiting call holds its thread until `online.max_wait`."""
    alice, bob = (Api(client, create_api_key(store, name, "user")) for name in ("alice", "bob"))
    answers: dict[str, int] = {}

    def wait_as(name: str, key: Api) -> None:
        answers[name] = key.post("/v1/requests?wait=true", json={"model": "mlp", "inputs": {"features": ROW}}
                                 ).status_code

    holder = threading.Thread(target=wait_as, args=("first", alice))
    holder.start()
    eventually(lambda: client.application.extensions["sits"].wait_slots.held("alice") == 1, timeout=5)

    refused = alice.post("/v1/requests?wait=true", json={"model": "mlp", "inputs": {"features": ROW}})
    v2 = alice.post("/v2/models/mlp/infer", json={
        "inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW[0]}]})
    not_waiting = alice.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ROW}})
    others = [threading.Thread(target=wait_as, args=(name, key)) for name, key in (("bob", bob), ("admin", api))]
    for thread in others:
        thread.start()
    for thread in (holder, *others):
        thread.join(timeout=10)

    assert refused.status_code == v2.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert "api.max_waits_per_tenant" in error_of(refused) and "without waiting" in error_of(refused)
    assert not_waiting.status_code == 202  # a call that does not wait holds no thread
    assert answers == {"first": 202, "bob": 202, "admin": 202}  # each waited its 3 s out (no worker answers)


def test_a_tenant_runs_one_registration_at_a_time_per_process(
        client: FlaskClient, store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """A registration loads, checks and runs its model on a request thread: a tenant's second one at
    once is a 429, not a second thread busy with it."""
    alice = Api(client, create_api_key(store, "alice", "user"))
    model = tmp_path / "alice" / "mlp.onnx"
    model.parent.mkdir()
    model.write_bytes((zoo_dir / "mlp.onnx").read_bytes())
    slots = client.application.extensions["sits"].registrations

    with slots.hold("alice", 1):  # as a registration of hers running on another thread
        refused = alice.post("/v1/models", json={"name": "mine", "path": str(model)})
    registered = alice.post("/v1/models", json={"name": "mine", "path": str(model)})

    assert refused.status_code == 429 and "models.registrations_per_tenant" in error_of(refused)
    assert registered.status_code == 201, error_of(registered)
