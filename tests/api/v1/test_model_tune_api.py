"""`POST/GET /v1/models/<name>/tune` without workers: who may tune, what is refused before a sweep is sent."""

from __future__ import annotations

import base64
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import redis
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import authenticate, create_api_key, list_api_keys
from broker.tuning import results
from broker.tuning.results import Tuning
from sits_api.tuning.sweep import Caller, TuneAsk, run_tuning
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
    [queued] = other.get("/v1/models/mlp-a/tune").get_json()["tunings"]  # readable by any key that may use it
    assert queued["status"] == "queued" and queued["tenant"] == ""  # (not who asked)


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


def test_a_second_ask_before_a_releaser_takes_the_first_is_409(api: Api, store: Store, mlp: dict) -> None:
    """The attack: ask again and again before a releaser begins the first sweep. Each ask answered 202 would
    hold a releaser thread for up to an hour in turn, so the ask is claimed when it is answered."""
    _heartbeat(store)
    first = api.post("/v1/models/mlp/tune", json={})
    assert first.status_code == 202, first.get_json()
    second = api.post("/v1/models/mlp/tune", json={})
    assert second.status_code == 409 and "being tuned" in second.get_json()["error"], second.get_json()
    [queued] = api.get("/v1/models/mlp/tune").get_json()["tunings"]
    assert queued["status"] == "queued" and queued["ask_id"] == first.get_json()["ask_id"]


def test_sweeps_past_the_releasers_spare_threads_are_429_with_retry_after(api: Api, store: Store, mlp: dict,
                                                                          zoo_dir: Path) -> None:
    """The releasers' threads (`beat.release_threads`, 2 by default) also release every tenant's schedules:
    sweeps of many models at once would hold them all, each for up to an hour."""
    _heartbeat(store)
    assert api.post("/v1/models", json={"name": "mlp-2", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201
    assert api.post("/v1/models/mlp/tune", json={}).status_code == 202
    refused = api.post("/v1/models/mlp-2/tune", json={})
    assert refused.status_code == 429, refused.get_json()
    assert int(refused.headers["Retry-After"]) >= 1 and "release_threads" in refused.get_json()["error"]


def test_a_device_kind_no_live_worker_has_is_409(api: Api, store: Store, mlp: dict) -> None:
    """A sweep on a kind no worker has would bar every worker of the model (the kinds it does not measure)
    for all of its planned time, every tenant's requests of it unserved, and measure nothing."""
    _heartbeat(store, device="cpu")
    answer = api.post("/v1/models/mlp/tune", json={"device_kind": "gpu"})
    assert answer.status_code == 409 and "no live gpu worker" in answer.get_json()["error"], answer.get_json()
    assert api.get("/v1/models/mlp/tune").get_json()["tunings"] == []


def test_a_sweep_that_cannot_start_ends_failed_and_leaves_no_key(store: Store, settings: Settings, mlp: dict) -> None:
    """A releaser that cannot reach the API (a `tuning.api_url` that is no http URL) ends the ask failed,
    saying why, so its poller stops; and it deletes the key it made for the sweep."""
    unreachable = settings.with_overrides(tuning={"api_url": "ftp://nowhere.example"})
    ask = TuneAsk(model_ref=mlp["ref"], p99_bound_ms=100.0, device_kinds=("cpu",), ask_id="a" * 32)
    [ended] = run_tuning(unreachable, store, ask, Caller(tenant="team-a", owner="alice"))
    assert ended.status == results.FAILED and "ftp://nowhere.example" in ended.error
    stored = results.read(store, mlp["ref"], "cpu")
    assert stored is not None and stored.status == results.FAILED and stored.ask_id == ask.ask_id
    assert [k["name"] for k in list_api_keys(store) if k["name"].startswith("sits-tune-")] == []


def test_another_tenant_cannot_take_the_name_of_a_sweeps_key(client: FlaskClient, store: Store, settings: Settings,
                                                             api: Api, mlp: dict) -> None:
    """The attack: read a queued ask's id (GET /tune shows it to any key that may use the model) and make a
    key of one's own tenant under the name the sweep's key would take, so that the sweep cannot make it."""
    _heartbeat(store)
    assert api.post("/v1/models/mlp/tune", json={}).status_code == 202
    [queued] = Api(client, create_api_key(store, "eve", "tenant-admin", tenant="team-b")).get(
        "/v1/models/mlp/tune").get_json()["tunings"]
    squatter = create_api_key(store, f"sits-tune-{queued['ask_id'][:16]}", "user", tenant="team-b")
    unreachable = settings.with_overrides(tuning={"api_url": "ftp://nowhere.example"})  # (ends once it has a key)
    ask = TuneAsk(model_ref=mlp["ref"], p99_bound_ms=100.0, device_kinds=("cpu",), ask_id=queued["ask_id"])
    [ended] = run_tuning(unreachable, store, ask, Caller(tenant="test", owner="test", role="admin"))
    assert "taken" not in ended.error and "ftp://nowhere.example" in ended.error, ended.error
    assert authenticate(store, squatter)["tenant"] == "team-b"  # (nor is another tenant's key deleted)


def test_an_ask_the_cache_answers_keeps_the_cached_sweep_and_claims_nothing(api: Api, store: Store, mlp: dict,
                                                                            zoo_dir: Path) -> None:
    """A claim must not replace the cached sweep it would be answered from, nor hold a releaser thread."""
    _heartbeat(store)
    results.save(store, Tuning(model_ref=mlp["ref"], device_kind="cpu", method="quick", p99_bound_ms=120,
                               status=results.DONE, finished_at=time.time(), ask_id="before"))
    assert api.post("/v1/models/mlp/tune", json={}).status_code == 202
    [cached] = api.get("/v1/models/mlp/tune").get_json()["tunings"]
    assert cached["status"] == "done" and cached["ask_id"] == "before"
    assert api.post("/v1/models", json={"name": "mlp-2", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201
    assert api.post("/v1/models/mlp-2/tune", json={}).status_code == 202


def ended(store: Store, model_ref: str) -> None:
    """The model's queued sweep, as a releaser leaves it once done."""
    for tuning in results.read_model(store, model_ref):
        results.save(store, replace(tuning, status=results.DONE, updated_at=time.time()))


def test_a_tenant_plans_at_most_its_sweep_seconds_a_day_and_a_refused_ask_costs_none(
        client: FlaskClient, store: Store, zoo_dir: Path) -> None:
    """One sweep runs at a time for every tenant: a tenant's back-to-back hour-long sweeps kept the others'
    from ever starting. Past `tuning.tenant_sweep_seconds` (7,200 s a UTC day) its next is a 429 until the
    day's end; an ask refused for another reason (the slot taken) costs none of its seconds."""
    owner = Api(client, create_api_key(store, "alice", "user", tenant="team-a"))
    for name in ("mlp-a", "mlp-b"):
        own = zoo_dir / "team-a" / f"{name}.onnx"
        own.parent.mkdir(exist_ok=True)
        shutil.copy(zoo_dir / "mlp.onnx", own)
        assert owner.post("/v1/models", json={"name": name, "path": str(own)}).status_code == 201
    _heartbeat(store)
    long = {"cell_seconds": 60, "settle_seconds": 30, "concurrencies": [1], "batch_sizes": list(range(1, 12)),
            "delays_ms": [0, 1, 2], "streams": [1]}  # (planned 3,150 s)

    first = owner.post("/v1/models/mlp-a/tune", json=long)
    slot_taken = owner.post("/v1/models/mlp-b/tune", json=long)  # (the one sweep slot: 429, no seconds spent)
    ended(store, first.get_json()["model_ref"])
    second = owner.post("/v1/models/mlp-b/tune", json=long)
    ended(store, second.get_json()["model_ref"])
    third = owner.post("/v1/models/mlp-a/tune", json=long)

    assert first.status_code == 202 and first.get_json()["planned_seconds"] == 3150, first.get_json()
    assert slot_taken.status_code == 429 and "release_threads" in slot_taken.get_json()["error"]
    assert second.status_code == 202, second.get_json()  # (6,300 s of 7,200)
    assert third.status_code == 429 and "tuning.tenant_sweep_seconds" in third.get_json()["error"], third.get_json()
    assert int(third.headers["Retry-After"]) <= 86_400


def test_a_sweep_longer_than_a_tenant_s_whole_day_is_a_400(client: FlaskClient, store: Store, zoo_dir: Path,
                                                          settings: Settings) -> None:
    """No day would take it: a 429 to retry at midnight would never end."""
    from sits_api.app import create_app
    small = create_app(settings.with_overrides(tuning={"tenant_sweep_seconds": "10m"}), store=store).test_client()
    owner = Api(small, create_api_key(store, "alice", "user", tenant="team-a"))
    own = zoo_dir / "team-a" / "mlp-c.onnx"
    own.parent.mkdir(exist_ok=True)
    shutil.copy(zoo_dir / "mlp.onnx", own)
    assert owner.post("/v1/models", json={"name": "mlp-c", "path": str(own)}).status_code == 201
    _heartbeat(store)

    long = owner.post("/v1/models/mlp-c/tune", json={"cell_seconds": 60, "settle_seconds": 30, "concurrencies": [1],
                                                     "batch_sizes": list(range(1, 12)), "delays_ms": [0],
                                                     "streams": [1]})  # (planned about 1,170 s)
    assert long.status_code == 400 and "tuning.tenant_sweep_seconds" in long.get_json()["error"], long.get_json()
