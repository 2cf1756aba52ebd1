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


def test_a_registration_past_the_wait_answers_202_and_its_record_says_how_it_ended(
        redis_server: EmbeddedRedis, store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """Registrations run off the request threads: one not done within `models.registration_wait` (0 here)
    answers 202 with an id; polling it gives the version, to its own tenant only; a failed one its error.
    The tenant's slot is held until the registration ends, not until the call returns."""
    from sits_api.app import create_app

    settings = make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        models={"registration_wait": 0})
    app = create_app(settings, store=store)
    client = app.test_client()
    alice, bob = (Api(client, create_api_key(store, name, "user")) for name in ("alice", "bob"))
    model = tmp_path / "alice" / "mlp.onnx"
    model.parent.mkdir()
    model.write_bytes((zoo_dir / "mlp.onnx").read_bytes())
    (tmp_path / "alice" / "broken.onnx").write_bytes(b"not a model")

    started = alice.post("/v1/models", json={"name": "mine", "path": str(model)})
    assert started.status_code == 202, error_of(started)
    poll = started.get_json()["poll"]
    eventually(lambda: alice.get(poll).get_json()["status"] != "running", timeout=30)
    done = alice.get(poll).get_json()
    assert done["status"] == "registered" and done["model"]["ref"] == done["ref"] and done["model"]["owner"] == "alice"
    assert bob.get(poll).status_code == 404  # another tenant's: as an unknown id
    assert alice.get("/v1/models/registrations/g000000000000").status_code == 404
    assert alice.get("/v1/models/registrations/../x").status_code == 404
    eventually(lambda: client.application.extensions["sits"].registrations.held("alice") == 0, timeout=5)  # freed

    failed = alice.post("/v1/models", json={"name": "broken", "path": str(tmp_path / "alice" / "broken.onnx")})
    eventually(lambda: alice.get(failed.get_json()["poll"]).get_json()["status"] == "failed", timeout=30)
    ended = alice.get(failed.get_json()["poll"]).get_json()
    assert ended["code"] == "invalid_model" and ended["http_status"] == 422 and "broken.onnx" in ended["error"]
