"""`POST/GET /v1/models/<name>/tune` without workers: who may tune, what is refused before a sweep is sent."""

from __future__ import annotations

import base64
import json
import shutil
import time
from pathlib import Path

import redis
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from broker.tuning import results
from broker.tuning.results import Tuning
from tests.api.api_helpers import Api


def _heartbeat(store: Store, name: str = "w1", device: str = "cpu", streams: int = 2) -> None:
    store.client.hset(store.keys.workers, name, json.dumps({"device": device, "streams": streams, "pid": 1,
                                                            "last_heartbeat": time.time()}))


def test_another_tenants_model_is_403_and_the_owner_tunes_it(client: FlaskClient, store: Store, zoo_dir: Path) -> None:
    owner = Api(client, create_api_key(store, "alice", "user", tenant="team-a"))
    other = Api(client, create_api_key(store, "mallory", "user", tenant="team-b"))
    own = zoo_dir / "team-a" / "mlp.onnx"  # (a tenant's files lie in its folder of each root)
    own.parent.mkdir(exist_ok=True)
    shutil.copy(zoo_dir / "mlp.onnx", own)
    registered = owner.post("/v1/models", json={"name": "mlp-a", "path": str(own)})
    assert registered.status_code == 201, registered.get_json()
    _heartbeat(store)

    refused = other.post("/v1/models/mlp-a/tune", json={"p99_ms": 100})
    assert refused.status_code == 403, refused.get_json()
    assert owner.post("/v1/models/no-such-model/tune", json={}).status_code == 404

    started = owner.post("/v1/models/mlp-a/tune", json={"p99_ms": 100, "concurrencies": [1, 4],
                                                          "batch_sizes": [1, 8], "streams": [1]})
    assert started.status_code == 202, started.get_json()
    body = started.get_json()
    assert body["device_kinds"] == ["cpu"] and body["poll"].endswith("/tune") and body["ask_id"]
    assert other.get("/v1/models/mlp-a/tune").get_json()["tunings"] == []  # readable by any key that may use it


def test_a_running_sweep_is_409_and_a_sweep_past_an_hour_is_400(api: Api, store: Store, mlp: dict) -> None:
    _heartbeat(store)
    huge = api.post("/v1/models/mlp/tune", json={"cell_seconds": 60, "concurrencies": [1, 2, 4, 8, 16, 32, 64, 128],
                                                  "batch_sizes": list(range(1, 13))})
    assert huge.status_code == 400 and "would take up to" in huge.get_json()["error"], huge.get_json()
    bad = api.post("/v1/models/mlp/tune", json={"concurrencies": [0]})
    assert bad.status_code == 400 and "concurrencies" in bad.get_json()["error"]
    results.begin(store, Tuning(model_ref=mlp["ref"], device_kind="cpu", method="quick", p99_bound_ms=120,
                                started_at=time.time(), updated_at=time.time()), now=time.time())
    busy = api.post("/v1/models/mlp/tune", json={})
    assert busy.status_code == 409 and "being tuned" in busy.get_json()["error"]


def test_no_live_worker_is_409(api: Api, mlp: dict) -> None:
    answer = api.post("/v1/models/mlp/tune", json={})
    assert answer.status_code == 409 and "no live worker" in answer.get_json()["error"]


def test_a_sweep_never_sends_its_key_where_a_host_header_points(api: Api, store: Store, mlp: dict, settings: Settings,
                                                                 redis_server: EmbeddedRedis) -> None:
    """The attack: a Host header naming a server of the caller's choosing, so that the releaser's clients
    send the sweep's key and requests there (a request forger inside the fleet's network). The ask carries
    no URL: the releaser takes `tuning.api_url` or the stack's own address."""
    _heartbeat(store)
    broker = redis.Redis.from_url(redis_server.url, decode_responses=True)
    answer = api.client.post("/v1/models/mlp/tune", json={}, headers={**api.headers, "Host": "attacker.example:9"})
    assert answer.status_code == 202, answer.get_json()
    queue = settings.beat.queue(settings.redis.key_prefix)
    asks = [json.loads(base64.b64decode(json.loads(message)["body"]))[0][0]
            for message in broker.lrange(queue, 0, -1) if json.loads(message)["headers"]["task"] == "sits.tune_model"]
    [ask] = [ask for ask in asks if ask["ask_id"] == answer.get_json()["ask_id"]]
    assert ask["api_url"] == ""


def test_another_tenant_reads_a_sweep_without_who_asked_for_it(client: FlaskClient, store: Store, api: Api,
                                                               mlp: dict) -> None:
    results.save(store, Tuning(model_ref=mlp["ref"], device_kind="cpu", method="quick", p99_bound_ms=120,
                               status=results.DONE, tenant="team-a"))
    other = Api(client, create_api_key(store, "eve", "user", tenant="team-b"))
    assert other.get("/v1/models/mlp/tune").get_json()["tunings"][0]["tenant"] == ""
    assert api.get("/v1/models/mlp/tune").get_json()["tunings"][0]["tenant"] == "team-a"  # (an admin sees it)
