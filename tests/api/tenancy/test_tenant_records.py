"""Tenants over the API: records (GET/PUT/DELETE /v1/tenants), roles by tenant, models a tenant may
use, `max_queued` and `max_inflight` (429 + Retry-After, REST and v2), default priorities, and the
usage report (`GET /v1/usage`, `sitsctl usage`), each tenant seeing only its own (real Redis, no worker)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from flask import Flask
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.apikeys import create_api_key
from broker.tenants.usage import BillEntry
from sits_api.app import create_app
from sits_api.cli.main import cli
from tests.api.api_helpers import Api, error_of, make_settings, tenant_copy

ROW = [0.25] * 64
V2 = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    return make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        tenants={"acme": {"guaranteed_share": 0.7, "limit": 1.2, "preemption_target": "5ms", "max_queued": 2,
                          "max_inflight": 1, "default_priority": 12},
                 "globex": {"guaranteed_share": 0.3, "limit": 3.0, "models": ["convnet"]}},
        fair_share={"price_per_device_hour": {"cpu": 3600.0}})


@pytest.fixture
def app(settings: Settings, store: Store) -> Flask:
    return create_app(settings, store=store)


def key(client: FlaskClient, store: Store, name: str, role: str, tenant: str = "") -> Api:
    return Api(client, create_api_key(store, name, role, tenant=tenant))


def request_body() -> dict[str, Any]:
    return {"model": "mlp", "inputs": {"features": [ROW]}}


def test_tenants_are_listed_with_their_source_and_changed_live_by_an_admin(api: Api, client: FlaskClient,
                                                                           store: Store) -> None:
    listed = api.get("/v1/tenants").get_json()["tenants"]
    assert [(t["name"], t["guaranteed_share"], t["source"]) for t in listed] == [("acme", 0.7, "config"),
                                                                                 ("globex", 0.3, "config")]
    assert listed[0]["preemption_target"] == 0.005

    put = api.put("/v1/tenants/initech", json={"tier": "bronze", "max_queued": 5})
    assert put.status_code == 200 and put.get_json()["source"] == "api", put.get_json()
    too_much = api.put("/v1/tenants/initech", json={"guaranteed_share": 0.2})
    assert too_much.status_code == 400
    assert "tenant 'initech': guaranteed shares sum to 1.200" in error_of(too_much)
    fixed = api.put("/v1/tenants/acme", json={"guaranteed_share": 0.1})
    assert fixed.status_code == 409 and "set in the configuration file" in error_of(fixed)
    assert api.put("/v1/tenants/initech", json={"limit": "lots"}).status_code == 400

    own = key(client, store, "ivan", "viewer", tenant="initech")
    assert own.get("/v1/tenants/initech").get_json()["tier"] == "bronze"
    assert own.get("/v1/tenants/acme").status_code == 403
    assert own.get("/v1/tenants").status_code == 403
    assert api.delete("/v1/tenants/initech").status_code == 204
    assert api.get("/v1/tenants/initech").status_code == 404


def test_a_viewer_reads_its_tenant_s_work_and_steers_or_submits_nothing(client: FlaskClient, store: Store,
                                                                        mlp: dict[str, Any], mlp_input: Path,
                                                                        tmp_path: Path) -> None:
    alice = key(client, store, "alice", "user", tenant="acme")
    boss = key(client, store, "boss", "tenant-admin", tenant="acme")
    viewer = key(client, store, "vic", "viewer", tenant="acme")
    outsider = key(client, store, "gary", "tenant-admin", tenant="globex")
    job = alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(tenant_copy(mlp_input, tmp_path, "acme")),
                                       "output_dir": str(tmp_path / "acme" / "out")}).get_json()
    assert job["tenant"] == "acme" and job["priority"] == 12  # the tenant's default_priority

    assert viewer.get(f"/v1/jobs/{job['id']}").status_code == 200
    assert [j["id"] for j in viewer.get("/v1/jobs").get_json()["jobs"]] == [job["id"]]
    refused = viewer.delete(f"/v1/jobs/{job['id']}")
    assert refused.status_code == 403 and "'viewer' role" in error_of(refused)
    assert viewer.post("/v1/requests", json=request_body()).status_code == 403
    assert outsider.get(f"/v1/jobs/{job['id']}").status_code == 404  # another tenant's: as if unknown
    assert outsider.delete(f"/v1/jobs/{job['id']}").status_code == 404
    assert boss.delete(f"/v1/jobs/{job['id']}").get_json()["status"] == "cancelled"  # its tenant's, not its own


def test_a_tenant_uses_only_its_models(client: FlaskClient, store: Store, mlp: dict[str, Any]) -> None:
    gary = key(client, store, "gary", "user", tenant="globex")

    refused = gary.post("/v1/requests", json=request_body())
    assert refused.status_code == 403 and "may use only the models convnet" in error_of(refused)
    assert gary.post("/v2/models/mlp/infer", json=V2).status_code == 403


def test_max_queued_answers_429_with_retry_after_over_rest_and_v2(client: FlaskClient, store: Store,
                                                                  mlp: dict[str, Any]) -> None:
    alice = key(client, store, "alice", "user", tenant="acme")
    bob = key(client, store, "bob", "user", tenant="acme")  # one tenant, two keys: one count
    assert alice.post("/v1/requests", json=request_body()).status_code == 202
    assert bob.post("/v1/requests", json=request_body()).status_code == 202

    rest = alice.post("/v1/requests", json=request_body())
    v2 = bob.post("/v2/models/mlp/infer", json=V2)
    for refused in (rest, v2):
        assert refused.status_code == 429, refused.get_json()
        assert int(refused.headers["Retry-After"]) >= 1
        assert "tenant 'acme' has 2 requests not answered yet" in error_of(refused)
    other = key(client, store, "carol", "user")  # a tenant of her own, without a record: no cap
    assert other.post("/v1/requests", json=request_body()).status_code == 202
    metrics = Api(client, create_api_key(store, "prom", "metrics")).get("/metrics").get_data(as_text=True)
    assert 'sits_requests_rejected_total{model="mlp",reason="tenant_full"' in metrics


def test_max_inflight_answers_429_for_a_second_active_job(client: FlaskClient, store: Store, mlp: dict[str, Any],
                                                          mlp_input: Path, tmp_path: Path) -> None:
    alice = key(client, store, "alice", "user", tenant="acme")
    acme_input, acme_folder = tenant_copy(mlp_input, tmp_path, "acme"), tmp_path / "acme"
    first = alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(acme_input),
                                         "output_dir": str(acme_folder / "one")})
    assert first.status_code == 201

    second = alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(acme_input),
                                          "output_dir": str(acme_folder / "two")})
    assert second.status_code == 429 and second.headers["Retry-After"]
    assert "tenant 'acme' has 1 jobs queued or running, its limit (tenants.acme.max_inflight)" in error_of(second)
    assert alice.delete(f"/v1/jobs/{first.get_json()['id']}").status_code == 200
    third = alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(acme_input),
                                         "output_dir": str(acme_folder / "two")})
    assert third.status_code == 201, error_of(third)  # the cancelled job's place was freed
    resumed = alice.post(f"/v1/jobs/{first.get_json()['id']}/resume")
    assert resumed.status_code == 429 and "max_inflight" in error_of(resumed)  # cancel and resume is no way past it
    assert alice.get(f"/v1/jobs/{first.get_json()['id']}").get_json()["status"] == "cancelled"


def test_a_tenant_at_max_inflight_is_refused_before_its_input_is_read(client: FlaskClient, store: Store,
                                                                      mlp: dict[str, Any], mlp_input: Path,
                                                                      tmp_path: Path) -> None:
    alice = key(client, store, "alice", "user", tenant="acme")
    acme_input, acme_folder = tenant_copy(mlp_input, tmp_path, "acme"), tmp_path / "acme"
    assert alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(acme_input),
                                        "output_dir": str(acme_folder / "one")}).status_code == 201
    unread = acme_folder / "unread.csv"
    unread.write_text("f0,f1\n1,2,3\n")  # (read, a 400: a row of three values under a header of two)
    refused = alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(unread),
                                           "output_dir": str(acme_folder / "two")})
    assert refused.status_code == 429 and "max_inflight" in error_of(refused)  # a parse of it costs nothing


def test_usage_is_reported_per_tenant_and_each_tenant_sees_only_its_own(api: Api, client: FlaskClient,
                                                                        store: Store) -> None:
    now = time.time()
    tenant_usage.note_usage(store, [BillEntry("acme", "alice", "mlp@v1", "cpu", 1.5, 30, 3, 0.25),
                                    BillEntry("globex", "gary", "mlp@v1", "cpu", 0.5, 10, 1, 0.0)],
                            now=now, half_life=30)
    alice = key(client, store, "alice", "user", tenant="acme")

    everyone = api.get("/v1/usage").get_json()
    assert [(row["tenant"], row["device_seconds"], row["cost"]) for row in everyone["usage"]] == [
        ("acme", 1.5, 1.5), ("globex", 0.5, 0.5)]  # 3,600 per cpu-hour: 1 a second
    assert everyone["currency"] == "USD" and everyone["from"] == everyone["to"]
    own = alice.get("/v1/usage?by=key").get_json()["usage"]
    assert own == [{"tenant": "acme", "tier": "standard", "key": "alice", "device_seconds": 1.5, "rows": 30,
                    "requests": 3, "failed": 0, "jobs": 0, "queue_seconds": 0.25, "cost": 1.5}]
    assert alice.get("/v1/usage?tenant=globex").status_code == 404
    assert api.get("/v1/usage?by=week").status_code == 400
    assert api.get("/v1/usage?from=soon").status_code == 400
    metrics = Api(client, create_api_key(store, "prom", "metrics")).get("/metrics").get_data(as_text=True)
    assert 'sits_tenant_device_seconds_total{tenant="acme"} 1.5' in metrics
    assert 'sits_tenant_guaranteed_share{tenant="globex"} 0.3' in metrics
    assert 'sits_tenant_info{tenant="acme",tier="standard"} 1.0' in metrics  # (bills and dashboards by tier)
    share = re.search(r'sits_tenant_usage_share\{tenant="acme"\} ([0-9.e-]+)', metrics)
    assert share and float(share.group(1)) == pytest.approx(0.75)  # of the recent device time


def test_sitsctl_usage_prints_a_table_json_and_csv(served_api: str, api: Api, store: Store,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tenant_usage.note_usage(store, [BillEntry("acme", "alice", "mlp@v1", "cpu", 2.0, 20, 2, 0.5)], now=time.time(),
                            half_life=30)
    monkeypatch.setenv("SITS_API_URL", served_api)
    monkeypatch.setenv("SITS_API_KEY", api.headers["Authorization"].split()[1])
    runner = CliRunner()

    table = runner.invoke(cli, ["usage"])
    as_json = runner.invoke(cli, ["usage", "--json", "--by", "model"])
    as_csv = runner.invoke(cli, ["usage", "--csv", "--tenant", "acme"])

    assert table.exit_code == 0 and "acme" in table.output and "2.000" in table.output, table.output
    assert json.loads(as_json.output)["usage"][0]["model"] == "mlp@v1"
    rows = list(csv.reader(io.StringIO(as_csv.output)))
    assert rows[0][:5] == ["tenant", "device_seconds", "rows", "requests", "failed"]
    assert rows[1][:5] == ["acme", "2.0", "20", "2", "0"]


def test_a_tenant_admin_makes_lists_and_revokes_only_its_own_tenant_s_keys(api: Api, client: FlaskClient,
                                                                            store: Store) -> None:
    boss = key(client, store, "boss", "tenant-admin", tenant="acme")
    made = boss.post("/v1/keys", json={"name": "dora", "role": "viewer", "tenant": "acme"})
    assert made.status_code == 201, made.get_json()
    dora = Api(client, made.get_json()["key"])
    assert dora.get("/v1/usage").status_code == 200  # the new key works, as a viewer of acme
    assert dora.post("/v1/keys", json={"name": "eve", "tenant": "acme"}).status_code == 403

    outside = boss.post("/v1/keys", json={"name": "mallory", "tenant": "globex"})
    assert outside.status_code == 403 and "its own tenant ('acme')" in error_of(outside)
    promoted = boss.post("/v1/keys", json={"name": "root2", "role": "admin", "tenant": "acme"})
    assert promoted.status_code == 403 and "not 'admin'" in error_of(promoted)
    assert boss.post("/v1/keys", json={"name": "x", "colour": "red"}).status_code == 400
    key(client, store, "gary", "user", tenant="globex")

    assert [k["name"] for k in boss.get("/v1/keys").get_json()["keys"]] == ["boss", "dora"]
    assert {k["name"] for k in api.get("/v1/keys").get_json()["keys"]} >= {"boss", "dora", "gary", "test"}
    assert all("key" not in k for k in api.get("/v1/keys").get_json()["keys"])
    assert boss.delete("/v1/keys/gary").status_code == 404  # another tenant's: not its to see
    assert boss.delete("/v1/keys/dora").get_json() == {"revoked": 1}
    assert dora.get("/v1/usage").status_code == 401  # revoked: at once in this process
    assert key(client, store, "uma", "user", tenant="acme").get("/v1/keys").status_code == 403


def test_a_tenant_admin_routes_its_tenant_s_model_names_only(api: Api, client: FlaskClient, store: Store,
                                                              zoo_dir: Path, tmp_path: Path) -> None:
    alice = key(client, store, "alice", "user", tenant="acme")
    boss = key(client, store, "boss", "tenant-admin", tenant="acme")
    other = key(client, store, "gary", "tenant-admin", tenant="globex")
    acme_model = tenant_copy(zoo_dir / "mlp.onnx", tmp_path, "acme")  # (its models lie in its folder)
    first = alice.post("/v1/models", json={"name": "acme-mlp", "path": str(acme_model)}).get_json()
    assert api.post("/v1/models", json={"name": "shared-mlp", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201
    route = {"model": "acme-mlp", "split": {first["version"]: 1.0}}

    assert boss.put("/v1/routes", json=route).status_code == 200  # registered by a key of its tenant
    refused = other.put("/v1/routes", json=route)
    assert refused.status_code == 403 and "may not route model 'acme-mlp'" in error_of(refused)
    assert boss.put("/v1/routes", json={"model": "shared-mlp", "split": {first["version"]: 1.0}}).status_code == 403
    assert [r["model"] for r in boss.get("/v1/routes").get_json()["routes"]] == ["acme-mlp"]
    assert other.get("/v1/routes").get_json()["routes"] == []
    assert alice.put("/v1/routes", json=route).status_code == 403  # a user key routes nothing
    assert other.delete("/v1/routes/acme-mlp").status_code == 403
    assert boss.delete("/v1/routes/acme-mlp").status_code == 204


def mlp_version(zoo_dir: Path, tmp_path: Path, tenant: str, seed: int) -> Path:
    """An MLP file of its own weights (so a version of its own) in `tenant`'s model folder."""
    import onnx

    from sits_worker.model.zoo import build_model
    folder = tmp_path / tenant
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(build_model("mlp", seed=seed), str(folder / f"mlp-{seed}.onnx"))
    return folder / f"mlp-{seed}.onnx"


def test_a_tenant_stores_at_most_its_model_versions_and_bytes_and_a_refused_copy_is_not_kept(
        api: Api, client: FlaskClient, store: Store, settings: Settings, zoo_dir: Path, tmp_path: Path) -> None:
    """Each new graph a tenant registers is a copy on the folder every host shares: past its
    `max_model_versions` or `max_model_bytes` it is refused (403 `models_at_limit`), its copy removed; other
    tenants and admin keys are not held by it."""
    assert api.put("/v1/tenants/initech", json={"max_model_versions": 2}).status_code == 200
    alice, gary = key(client, store, "alice", "user", "initech"), key(client, store, "gary", "user", "umbrella")
    for seed in (1, 2):
        made = alice.post("/v1/models", json={"name": f"initech-{seed}", "path": str(mlp_version(zoo_dir, tmp_path,
                                                                                             "initech", seed))})
        assert made.status_code == 201 and made.get_json()["stored_bytes"] > 60_000, error_of(made)

    third = alice.post("/v1/models", json={"name": "initech-1",
                                         "path": str(mlp_version(zoo_dir, tmp_path, "initech", 3))})

    assert third.status_code == 403 and third.get_json()["code"] == "models_at_limit", third.get_json()
    assert "max_model_versions" in error_of(third)
    assert sorted(path.parent.name for path in (settings.paths.store() / "initech-1").glob("*/model.onnx")) == [
        alice.get("/v1/models/initech-1").get_json()["version"]]  # (the refused version's copy is gone)
    assert gary.post("/v1/models", json={"name": "umbrella-1", "path": str(mlp_version(
        zoo_dir, tmp_path, "umbrella", 3))}).status_code == 201
    assert api.post("/v1/models", json={"name": "initech-1", "path": str(mlp_version(
        zoo_dir, tmp_path, "initech", 4))}).status_code == 201  # (an admin adds to a tenant's name beyond its cap)

    assert api.put("/v1/tenants/initech", json={"max_model_versions": 0, "max_model_bytes": 200_000}).status_code == 200
    big = alice.post("/v1/models", json={"name": "initech-2",
                                         "path": str(mlp_version(zoo_dir, tmp_path, "initech", 5))})
    assert big.status_code == 403 and "max_model_bytes" in error_of(big)


def test_registrations_at_once_cannot_each_pass_the_model_cap_against_the_others_absence(
        api: Api, client: FlaskClient, store: Store, zoo_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations sent at once each pass the early check before any of them is stored; the cap is counted
    again in the transaction that writes. Here the early check is made to pass, as a racing one's does."""
    from sits_api.intake import services
    assert api.put("/v1/tenants/initech", json={"max_model_versions": 1}).status_code == 200
    alice = key(client, store, "alice", "user", "initech")
    assert alice.post("/v1/models", json={"name": "initech-1", "path": str(mlp_version(
        zoo_dir, tmp_path, "initech", 1))}).status_code == 201
    monkeypatch.setattr(services.registry, "check_model_room", lambda *_, **__: None)

    second = alice.post("/v1/models", json={"name": "initech-2",
                                         "path": str(mlp_version(zoo_dir, tmp_path, "initech", 2))})

    assert second.status_code == 403 and second.get_json()["code"] == "models_at_limit"
    assert [model["name"] for model in alice.get("/v1/models").get_json()["models"]] == ["initech-1"]


def test_a_tenant_s_active_jobs_hold_at_most_its_max_queued_chunks(
        api: Api, client: FlaskClient, store: Store, mlp: dict[str, Any], tmp_path: Path) -> None:
    """Jobs cut into one-row chunks put a few hundred bytes a chunk in the Redis every tenant writes to: a
    tenant's 64 jobs of 100,000 chunks filled a 1 GiB Redis (every tenant's next write a 503). Past its
    `max_queued_chunks` a job is a 429 to retry once one ends (a 400 when it alone is larger); resuming a
    cancelled job takes its chunks' room again."""
    assert api.put("/v1/tenants/initech", json={"max_queued_chunks": 10}).status_code == 200
    alice, gary = key(client, store, "alice", "user", "initech"), key(client, store, "gary", "user", "umbrella")
    for tenant in ("initech", "umbrella"):
        (tmp_path / tenant).mkdir(exist_ok=True)
        np.save(tmp_path / tenant / "rows.npy", np.ones((8, 64), np.float32))

    def job(who: Api, tenant: str, name: str, chunk_size: int = 1) -> Any:
        return who.post("/v1/jobs", json={"model": "mlp", "input_batch": str(tmp_path / tenant / "rows.npy"),
                                          "output_dir": str(tmp_path / tenant / name), "chunk_size": chunk_size})

    first = job(alice, "initech", "one")  # 8 chunks
    second = job(alice, "initech", "two")  # 8 more: 16 of 10
    whole = job(alice, "initech", "two", chunk_size=2)  # 4 more: 12 of 10

    assert first.status_code == 201, error_of(first)
    assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
    assert "has 8 chunks in its jobs queued or running" in error_of(second) and "max_queued_chunks" in error_of(second)
    assert whole.status_code == 429
    assert job(gary, "umbrella", "one").status_code == 201  # (another tenant's room is its own)
    assert api.put("/v1/tenants/initech", json={"max_queued_chunks": 6}).status_code == 200
    too_large = job(alice, "initech", "three")
    assert too_large.status_code == 400 and "give a larger chunk_size" in error_of(too_large)
    assert api.put("/v1/tenants/initech", json={"max_queued_chunks": 10}).status_code == 200
    assert alice.delete(f"/v1/jobs/{first.get_json()['id']}").status_code == 200
    assert job(alice, "initech", "two", chunk_size=2).status_code == 201  # (the cancelled job's room is free)
    resumed = alice.post(f"/v1/jobs/{first.get_json()['id']}/resume")
    assert resumed.status_code == 429 and "max_queued_chunks" in error_of(resumed)


def test_a_submit_refused_after_its_place_was_taken_holds_none_of_its_tenant_s_room(
        api: Api, client: FlaskClient, store: Store, mlp: dict[str, Any], tmp_path: Path) -> None:
    """A job refused once its place was taken (its output folder held by another job) is never written: its
    place, and its chunks, were kept for a minute, and the tenant's next job was a 429 it had room for."""
    assert api.put("/v1/tenants/initech", json={"max_queued_chunks": 10}).status_code == 200
    alice = key(client, store, "alice", "user", "initech")
    (tmp_path / "initech").mkdir()
    np.save(tmp_path / "initech" / "rows.npy", np.ones((8, 64), np.float32))

    def job(name: str, chunk_size: int) -> Any:
        return alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(tmp_path / "initech" / "rows.npy"),
                                            "output_dir": str(tmp_path / "initech" / name), "chunk_size": chunk_size})

    first = job("one", 4)  # 2 chunks, holding folder "one"
    refused = job("one", 1)  # 8 chunks, into the held folder
    after = job("two", 1)  # 8 chunks: 2 + 8 of 10

    assert first.status_code == 201 and refused.status_code == 409
    assert after.status_code == 201, error_of(after)


def test_a_submit_under_a_taken_job_id_keeps_the_place_of_the_job_that_holds_it(
        app: Flask, api: Api, client: FlaskClient, store: Store, mlp: dict[str, Any], tmp_path: Path) -> None:
    """A schedule's second release of a slot submits under the same job id and is refused (409): giving back
    its place would have freed the place of the job that holds it, one more job past `max_inflight`."""
    from broker.errors import Conflict
    from sits_api.intake import services
    from sits_api.schemas import JobSubmission
    state = app.extensions["sits"]
    assert api.put("/v1/tenants/initech", json={"max_inflight": 2}).status_code == 200
    alice = key(client, store, "alice", "user", "initech")
    (tmp_path / "initech").mkdir()
    np.save(tmp_path / "initech" / "rows.npy", np.ones((8, 64), np.float32))

    def body(name: str) -> dict[str, Any]:
        return {"model": "mlp", "input_batch": str(tmp_path / "initech" / "rows.npy"),
                "output_dir": str(tmp_path / "initech" / name)}

    caller = {"name": "alice", "role": "user", "tenant": "initech"}
    for _ in range(2):
        try:
            services.submit_job(state.settings, store, state.dispatcher, JobSubmission.model_validate(body("one")),
                                caller=caller, now=time.time(), tenants=state.tenants, job_id="twin")
        except Conflict:
            pass  # (the second: its id is taken)

    assert [alice.post("/v1/jobs", json=body(name)).status_code for name in ("two", "three")] == [201, 429]


def test_a_tenant_admin_neither_lists_nor_revokes_admin_and_metrics_keys_named_as_its_tenant(
        api: Api, client: FlaskClient, store: Store) -> None:
    """Admin and metrics keys are no tenant's members: one named as a tenant was listed to, and revoked by,
    that tenant's admin keys (its record's tenant read as its name). An admin key so named is refused now; one
    stored before that rule is written here by hand."""
    boss = key(client, store, "boss", "tenant-admin", "initech")
    made = api.post("/v1/keys", json={"name": "initech", "role": "metrics"})
    assert made.status_code == 201, error_of(made)
    store.client.hset(store.keys.api_keys, hashlib.sha256(b"sits_old-admin").hexdigest(),
                      json.dumps({"name": "initech", "role": "admin"}))
    ops = Api(client, api.post("/v1/keys", json={"name": "ops-initech", "role": "admin"}).get_json()["key"])

    listed = boss.get("/v1/keys").get_json()["keys"]
    revoked = boss.delete("/v1/keys/initech")

    assert [(k["name"], k["role"]) for k in listed] == [("boss", "tenant-admin")]
    assert revoked.status_code == 404
    assert sorted(k["role"] for k in api.get("/v1/keys").get_json()["keys"] if k["name"] == "initech") == [
        "admin", "metrics"]
    assert ops.get("/v1/tenants").status_code == 200


def test_status_shows_a_tenant_s_key_its_own_and_shared_models_and_jobs_only(
        api: Api, client: FlaskClient, store: Store, mlp: dict[str, Any], zoo_dir: Path, tmp_path: Path) -> None:
    """`/v1/status` showed any key every model's queue depth: another tenant's private model names and
    traffic. A tenant's key sees the models its tenant owns and those no tenant owns; an admin all."""
    alice, peek = key(client, store, "alice", "user", "initech"), key(client, store, "peek", "viewer", "umbrella")
    private = tenant_copy(zoo_dir / "mlp.onnx", tmp_path, "initech")
    made = alice.post("/v1/models", json={"name": "initech-fraud", "path": str(private)})
    assert made.status_code == 201, error_of(made)
    for model in ("initech-fraud", "mlp"):
        assert alice.post("/v1/requests", json={"model": model, "inputs": {"features": [ROW]}}).status_code == 202
    private_ref = made.get_json()["ref"]
    from broker.queueing import workers
    workers.record_heartbeat(store, "w@h", {"device": "cpu", "streams": 1, "models_loaded": [private_ref, mlp["ref"]],
                                            "oom": {"ceilings": {private_ref: 8, mlp["ref"]: 4}}}, now=time.time())

    answer = peek.get("/v1/status")
    theirs, own, everyone = answer.get_json(), alice.get("/v1/status").get_json(), api.get("/v1/status").get_json()

    assert set(theirs["queues"]) == {mlp["ref"]} and theirs["jobs"] == {}
    assert "initech-fraud" not in answer.text  # (nor in a worker's loaded models or OOM ceilings)
    assert theirs["workers"][0]["oom"]["ceilings"] == {mlp["ref"]: 4}
    assert set(own["queues"]) == {mlp["ref"], made.get_json()["ref"]}
    assert set(everyone["queues"]) == {mlp["ref"], made.get_json()["ref"]}


def test_a_process_trusts_a_bounded_number_of_keys_and_none_checked_across_a_revoke(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant minting and using keys without end grew every API process's trusted keys without end; and a
    call in flight while its key was revoked put the key back, trusted for another 5 s."""
    from broker.errors import Unauthorized
    from broker.tenants.apikeys import create_api_key, revoke_api_keys
    from sits_api.tenancy import known_keys as known
    keys = known.KnownKeys(most=3)
    for n in range(5):
        keys.identity(store, create_api_key(store, f"k{n}", "user", tenant="initech"))
    assert len(keys) == 3

    racing = create_api_key(store, "racing", "user", tenant="initech")
    checked = known.authenticate

    def revoked_meanwhile(store_: Store, key_: str | None) -> dict[str, Any]:
        identity = checked(store_, key_)  # (read before the revoke below)
        revoke_api_keys(store_, "racing")
        keys.forget("racing")
        return identity

    monkeypatch.setattr(known, "authenticate", revoked_meanwhile)
    keys.identity(store, racing)  # (the call in flight)
    monkeypatch.undo()
    with pytest.raises(Unauthorized):
        keys.identity(store, racing)  # (checked again: revoked)
    kept = len(keys)
    keys.forget("no-such-name")  # (a revoke of another name leaves the trusted keys be)
    keys.forget("k4", "globex")  # (and so does one of another tenant's key of the same name)
    assert len(keys) == kept == 3
    keys.forget("k4", "initech")
    assert len(keys) == 2
