"""Tenants: a user key sees and steers only the jobs and requests submitted under its name, an admin key all.

Another tenant's job or request answers 404 with the very message an unknown id gets (nothing
tells that it exists), and changes nothing in Redis; records stored without an owner (before
owners were checked) are an admin's alone. A 409 over an output folder names the job holding it
only to a key that may see it, and a folder another tenant's job used (in any status) is not a user
key's to take. Models are shared, but a model name is its first registrant's:
another tenant's new version under it would change what the owner's bare name runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.errors import Unauthorized
from broker.models import registry
from broker.online import requests
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key, owns
from sits_api.cli.main import cli
from sits_worker.model.zoo import build_model
from tests.api.api_helpers import Api, error_of, make_settings, shared_roots

OWNERS = ("alice", "bob", "prometheus")
"""The tenants of the module's user keys (one key, or two, each): they share the test's folders, as an
admin may configure them to, so that what keeps them apart here is who owns the work (each tenant's own
folder, the default, is tested in tests/security)."""


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    return make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        tenants={name: shared_roots(tmp_path, zoo_dir) for name in OWNERS})


@pytest.fixture
def alice(client: FlaskClient, store: Store) -> Api:
    return Api(client, create_api_key(store, "alice", "user"))


@pytest.fixture
def bob(client: FlaskClient, store: Store) -> Api:
    return Api(client, create_api_key(store, "bob", "user"))


def submit_job(api: Api, mlp_input: Path, output_dir: Path, **extra: Any) -> dict[str, Any]:
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                          "output_dir": str(output_dir), **extra})
    assert response.status_code == 201, error_of(response)
    return response.get_json()


def submit_request(api: Api) -> str:
    response = api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": [[0.5] * 64]}})
    assert response.status_code == 202, error_of(response)
    return response.get_json()["id"]


def listed_ids(api: Api, query: str = "") -> list[str]:
    response = api.get("/v1/jobs" + query)
    assert response.status_code == 200, error_of(response)
    return [job["id"] for job in response.get_json()["jobs"]]


def job_state(store: Store, job_id: str, model_ref: str) -> tuple[dict[str, str], list[str], list[str]]:
    """Everything a cancel or resume would change: the job hash, its model's queue, the item payloads."""
    client = store.client
    return (client.hgetall(store.keys.job(job_id)), client.zrange(store.keys.ready(model_ref), 0, -1),
            sorted(client.hkeys(store.keys.items)))


def assert_hidden_like_an_unknown_id(hidden: Any, unknown: Any, hidden_id: str, unknown_id: str) -> None:
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.get_json()["code"] == unknown.get_json()["code"]
    assert error_of(hidden).replace(hidden_id, "ID") == error_of(unknown).replace(unknown_id, "ID")


def test_owns_lets_a_user_key_have_only_its_own_name_s_records_and_an_admin_all() -> None:
    alice, admin = {"name": "alice", "role": "user"}, {"name": "root", "role": "admin"}

    assert owns(alice, "alice")
    assert not owns(alice, "bob")
    assert not owns(alice, None) and not owns(alice, "")  # stored without an owner: admins only
    assert not owns({"name": "", "role": "user"}, "")
    assert all(owns(admin, owner) for owner in ("alice", "bob", None, ""))
    assert not owns({"name": "alice", "role": "metrics"}, "alice")  # a scrape key owns nothing, whatever its name


def test_a_metrics_key_may_share_a_name_with_a_tenant_or_admins_and_gets_none_of_their_records(
        client: FlaskClient, store: Store) -> None:
    tenant = create_api_key(store, "prometheus", "user")  # e.g. made before the metrics role existed
    scraper = create_api_key(store, "prometheus", "metrics")
    create_api_key(store, "root", "admin")
    create_api_key(store, "root", "metrics")

    job_list = client.get("/v1/jobs", headers={"Authorization": f"Bearer {scraper}"})
    assert job_list.status_code == 403
    assert client.get("/metrics", headers={"Authorization": f"Bearer {scraper}"}).status_code == 200
    assert client.get("/metrics", headers={"Authorization": f"Bearer {tenant}"}).status_code == 403
    with pytest.raises(ValueError, match="key name 'prometheus' is a tenant's: an admin key of that name would act"):
        create_api_key(store, "prometheus", "admin")  # the rule still holds between tenants and admins


def test_a_tenant_named_like_an_admin_key_case_aside_is_refused_and_so_is_the_other_way_round(store: Store) -> None:
    """An admin acts as the tenant of its name: that tenant's keys would own the admin's work."""
    create_api_key(store, "root", "admin")
    for name, tenant in (("root", ""), ("alice", "root"), ("alice", "ROOT")):
        with pytest.raises(ValueError, match="is named like an admin key"):
            create_api_key(store, name, "user", tenant=tenant)
    create_api_key(store, "root", "user", tenant="acme")  # (a member of acme named root owns nothing of the admin's)
    create_api_key(store, "carol", "tenant-admin", tenant="Initech")
    with pytest.raises(ValueError, match="is a tenant's"):
        create_api_key(store, "initech", "admin")


def test_two_tenants_may_each_have_a_key_of_one_name_and_neither_reaches_the_other_s_work(
        client: FlaskClient, store: Store, admin_key: str, mlp: dict[str, Any]) -> None:
    """Key names are their tenant's: a tenant admin making `alice` learns nothing of another tenant's `alice`
    (a 400 "taken" told it one existed), and the two keys' records stay apart, tenants compared first."""
    admin = Api(client, admin_key)
    acme_admin = Api(client, admin.post("/v1/keys", json={"name": "boss", "role": "tenant-admin",
                                                          "tenant": "acme"}).get_json()["key"])
    created = admin.post("/v1/keys", json={"name": "alice", "tenant": "globex"})
    assert created.status_code == 201, error_of(created)
    also = acme_admin.post("/v1/keys", json={"name": "alice", "tenant": "acme"})
    assert also.status_code == 201, error_of(also)
    acme_alice, globex_alice = Api(client, also.get_json()["key"]), Api(client, created.get_json()["key"])
    request_id = submit_request(acme_alice)

    assert acme_alice.get(f"/v1/requests/{request_id}").status_code == 200
    assert globex_alice.get(f"/v1/requests/{request_id}").status_code == 404
    assert [key["tenant"] for key in acme_admin.get("/v1/keys").get_json()["keys"]] == ["acme", "acme"]
    assert acme_admin.delete("/v1/keys/alice").get_json() == {"revoked": 1}
    assert globex_alice.get("/v1/jobs").status_code == 200  # (acme's revoke left globex's alice alone)
    assert sorted((key["name"], key["tenant"]) for key in admin.get("/v1/keys").get_json()["keys"]) == [
        ("alice", "globex"), ("boss", "acme"), ("test", "test")]


def test_a_key_an_older_api_process_made_while_it_revoked_another_is_listed_and_revoked_by_its_tenant(
        store: Store) -> None:
    """A rotation on an older API process during an upgrade (one key made, one revoked, in the hash alone) leaves
    the count of keys the sets hold right: the new key was in no set, so its tenant admin's revoke missed it while
    it kept working. The set that lists the revoked key shows the sets are stale: they are built again."""
    from broker.tenants.apikeys import authenticate, list_api_keys, revoke_api_keys
    create_api_key(store, "alice", "user", tenant="acme")
    carol = create_api_key(store, "carol", "user", tenant="acme")
    bob = "sits_made-by-an-older-api-process"
    store.client.hset(store.keys.api_keys, hashlib.sha256(bob.encode()).hexdigest(),
                      json.dumps({"name": "bob", "role": "user", "tenant": "acme"}))
    store.client.hdel(store.keys.api_keys, hashlib.sha256(carol.encode()).hexdigest())

    assert [key["name"] for key in list_api_keys(store, "acme", members_only=True)] == ["alice", "bob"]
    assert revoke_api_keys(store, "bob", "acme", members_only=True) == 1
    with pytest.raises(Unauthorized):
        authenticate(store, bob)


def test_an_admin_s_revoke_of_a_name_several_tenants_hold_names_the_tenant_or_is_a_409(
        api: Api, store: Store) -> None:
    """Names are their tenant's: an operator revoking acme's `ops` without `?tenant=` revoked every tenant's `ops`,
    and the admin key `ops` too."""
    from broker.tenants.apikeys import authenticate
    operator = create_api_key(store, "ops", "admin")
    for tenant in ("acme", "globex"):
        create_api_key(store, "ops", "user", tenant=tenant)

    refused = api.delete("/v1/keys/ops")
    assert refused.status_code == 409 and "?tenant=" in error_of(refused)
    assert api.delete("/v1/keys/ops?tenant=acme").get_json() == {"revoked": 1}
    assert authenticate(store, operator)["name"] == "ops"
    assert sorted(key["tenant"] for key in api.get("/v1/keys").get_json()["keys"] if key["name"] == "ops") == [
        "globex", "ops"]


def test_a_user_s_job_list_is_its_own_whatever_a_key_of_its_name_in_another_tenant_holds(
        client: FlaskClient, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Globex's busy `alice` shared acme's `alice`'s job index: acme's list walked globex's jobs to its bound and
    showed none of its own. Each tenant's key name now has an index of its own."""
    import dataclasses

    from broker.jobs import fills as job_fills
    from broker.jobs import lists as job_lists
    from tests.broker.broker_helpers import NOW, job_spec
    acme_alice = Api(client, create_api_key(store, "alice", "user", tenant="acme"))
    for number, (tenant, count) in enumerate((("acme", 2), ("globex", 1_200))):
        for i in range(count):
            spec = job_spec(f"j{tenant[0]}{i}", rows_total=1, chunk_size=1)
            job_fills.create_job(store, dataclasses.replace(spec, owner="alice", tenant=tenant),
                                 now=NOW + 10 * number + i / 1000)
    assert job_lists.index_job_owners(store) and job_lists.index_job_tenants(store)
    monkeypatch.setattr(job_lists, "LIST_SCAN_JOBS", 1_000)

    assert listed_ids(acme_alice) == ["ja1", "ja0"]


def test_a_tenant_s_key_changes_read_none_of_the_other_tenants_keys(store: Store) -> None:
    """Counted by Redis itself: a tenant's create, list and revoke read its own set and the admins', never the
    hash of every key, so another tenant's many keys cost it nothing and tell it nothing."""
    from broker.tenants.apikeys import list_api_keys, revoke_api_keys
    for number in range(30):
        create_api_key(store, f"user{number}", "user", tenant="globex")
    store.client.config_resetstat()

    create_api_key(store, "alice", "user", tenant="acme")
    assert [key["name"] for key in list_api_keys(store, "acme", members_only=True)] == ["alice"]
    assert revoke_api_keys(store, "alice", "acme", members_only=True) == 1

    stats = store.client.info("commandstats")
    assert "cmdstat_hgetall" not in stats and "cmdstat_hvals" not in stats and "cmdstat_hscan" not in stats
    assert stats["cmdstat_hmget"]["calls"] >= 2


def test_keys_stored_before_the_tenant_sets_are_listed_and_revoked_by_their_tenant(store: Store) -> None:
    """Keys written into the hash alone (before the per-tenant sets, or by an older API process) are put in
    their sets at the next key change, and one revoked outside them is dropped from its set's reads."""
    from broker.tenants.apikeys import list_api_keys, revoke_api_keys
    create_api_key(store, "alice", "user", tenant="acme")
    for name, record in (("sits_old_bob", {"name": "bob", "role": "user", "tenant": "acme"}),
                         ("sits_old_carl", {"name": "carl", "role": "viewer"}),
                         ("sits_old_root", {"name": "root", "role": "admin"})):
        store.client.hset(store.keys.api_keys, hashlib.sha256(name.encode()).hexdigest(), json.dumps(record))
    assert [key["name"] for key in list_api_keys(store, "acme", members_only=True)] == ["alice", "bob"]
    assert [key["name"] for key in list_api_keys(store, "carl")] == ["carl"]
    assert [key["name"] for key in list_api_keys(store, "root")] == ["root"]
    assert list_api_keys(store, "root", members_only=True) == []
    store.client.hdel(store.keys.api_keys, hashlib.sha256(b"sits_old_bob").hexdigest())  # an older process's revoke
    assert [key["name"] for key in list_api_keys(store, "acme")] == ["alice"]
    assert revoke_api_keys(store, "bob", "acme") == 0
    assert revoke_api_keys(store, "alice", "acme") == 1
    assert list_api_keys(store, "acme") == []


def test_a_key_without_a_name_or_with_spaces_around_it_cannot_be_created(store: Store) -> None:
    with pytest.raises(ValueError, match="needs a name"):
        create_api_key(store, "  ", "user")
    with pytest.raises(ValueError, match="'alice ' starts or ends with spaces; give it as 'alice'"):
        create_api_key(store, "alice ", "user")


# --- one job ---------------------------------------------------------------------------------------


def test_a_user_reads_its_own_job_with_its_owner_and_another_s_answers_404_as_an_unknown_id(
        alice: Api, bob: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit_job(alice, mlp_input, tmp_path / "out")

    own = alice.get(f"/v1/jobs/{job['id']}")
    assert own.status_code == 200 and own.get_json()["owner"] == "alice"
    assert_hidden_like_an_unknown_id(bob.get(f"/v1/jobs/{job['id']}"), bob.get("/v1/jobs/jnope"), job["id"], "jnope")


def test_another_user_s_cancel_answers_404_and_changes_nothing(
        alice: Api, bob: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit_job(alice, mlp_input, tmp_path / "out", chunk_size=4)
    before = job_state(store, job["id"], mlp["ref"])

    response = bob.delete(f"/v1/jobs/{job['id']}")

    assert_hidden_like_an_unknown_id(response, bob.delete("/v1/jobs/jnope"), job["id"], "jnope")
    assert job_state(store, job["id"], mlp["ref"]) == before
    assert alice.get(f"/v1/jobs/{job['id']}").get_json()["status"] == "queued"


def test_another_user_s_resume_answers_404_and_changes_nothing(
        alice: Api, bob: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit_job(alice, mlp_input, tmp_path / "out", chunk_size=4)
    assert alice.delete(f"/v1/jobs/{job['id']}").status_code == 200
    before = job_state(store, job["id"], mlp["ref"])

    response = bob.post(f"/v1/jobs/{job['id']}/resume")

    assert_hidden_like_an_unknown_id(response, bob.post("/v1/jobs/jnope/resume"), job["id"], "jnope")
    assert job_state(store, job["id"], mlp["ref"]) == before
    assert before[0]["status"] == "cancelled" and before[1] == []


def test_a_user_cancels_and_resumes_its_own_job(
        alice: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit_job(alice, mlp_input, tmp_path / "out", chunk_size=4)

    cancelled = alice.delete(f"/v1/jobs/{job['id']}")
    resumed = alice.post(f"/v1/jobs/{job['id']}/resume")

    assert cancelled.status_code == 200 and cancelled.get_json()["status"] == "cancelled"
    assert resumed.status_code == 202 and resumed.get_json()["status"] == "queued"


def test_an_admin_reads_cancels_and_resumes_any_user_s_job(
        api: Api, alice: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit_job(alice, mlp_input, tmp_path / "out", chunk_size=4)

    assert api.get(f"/v1/jobs/{job['id']}").get_json()["owner"] == "alice"
    assert api.delete(f"/v1/jobs/{job['id']}").get_json()["status"] == "cancelled"
    assert api.post(f"/v1/jobs/{job['id']}/resume").status_code == 202


# --- listing jobs ----------------------------------------------------------------------------------


@pytest.fixture
def three_tenants_jobs(api: Api, alice: Api, bob: Api, mlp: dict[str, Any], mlp_input: Path,
                       tmp_path: Path) -> dict[str, list[str]]:
    """Jobs, oldest first: alice, bob, alice, admin ('test'), bob; each owner's ids newest first."""
    owners: dict[str, list[str]] = {"alice": [], "bob": [], "test": []}
    for n, (name, key) in enumerate([("alice", alice), ("bob", bob), ("alice", alice), ("test", api), ("bob", bob)]):
        owners[name].insert(0, submit_job(key, mlp_input, tmp_path / f"out{n}")["id"])
    return owners


def test_a_user_lists_only_its_own_jobs(
        alice: Api, bob: Api, three_tenants_jobs: dict[str, list[str]]) -> None:
    assert listed_ids(alice) == three_tenants_jobs["alice"]
    assert listed_ids(bob) == three_tenants_jobs["bob"]
    assert listed_ids(alice, "?owner=alice") == three_tenants_jobs["alice"]


def test_a_user_s_limit_is_its_newest_jobs_not_the_newest_overall_filtered(
        alice: Api, api: Api, three_tenants_jobs: dict[str, list[str]]) -> None:
    # the newest two jobs overall are bob's and the admin's
    assert listed_ids(alice, "?limit=1") == three_tenants_jobs["alice"][:1]
    assert listed_ids(api, "?owner=alice&limit=1") == three_tenants_jobs["alice"][:1]


def test_a_user_naming_another_owner_answers_403(alice: Api, three_tenants_jobs: dict[str, list[str]]) -> None:
    response = alice.get("/v1/jobs?owner=bob")

    assert response.status_code == 403
    assert "may list only its own jobs" in error_of(response)


def test_an_admin_lists_every_job_and_filters_by_owner(
        api: Api, three_tenants_jobs: dict[str, list[str]]) -> None:
    every = listed_ids(api)

    assert sorted(every) == sorted(sum(three_tenants_jobs.values(), []))
    assert listed_ids(api, "?owner=bob") == three_tenants_jobs["bob"]
    assert listed_ids(api, "?owner=nobody") == []
    assert {job["owner"] for job in api.get("/v1/jobs").get_json()["jobs"]} == {"alice", "bob", "test"}


@pytest.mark.parametrize("query", ["?owner=", "?owner=%20"])
def test_an_empty_owner_filter_answers_400(api: Api, query: str) -> None:
    response = api.get("/v1/jobs" + query)

    assert response.status_code == 400
    assert "owner must be the name of an API key" in error_of(response)


def test_owner_and_status_filters_combine(
        api: Api, alice: Api, three_tenants_jobs: dict[str, list[str]]) -> None:
    newest_of_alice = three_tenants_jobs["alice"][0]
    alice.delete(f"/v1/jobs/{newest_of_alice}")

    assert listed_ids(alice, "?status=cancelled") == [newest_of_alice]
    assert listed_ids(alice, "?status=queued") == three_tenants_jobs["alice"][1:]
    assert listed_ids(api, "?status=cancelled&owner=bob") == []


# --- online requests -------------------------------------------------------------------------------


def test_a_request_s_outputs_are_read_by_its_submitter_and_admins_only(
        api: Api, alice: Api, bob: Api, store: Store, mlp: dict[str, Any]) -> None:
    request_id = submit_request(alice)
    # as a worker leaves a finished request (no worker runs in these tests)
    store.client.hset(store.keys.request(request_id), mapping={
        "status": "succeeded", "finished_at": 1.0e10,
        "outputs": json.dumps({"logits": requests.pack_array(np.ones((1, 10), dtype=np.float32))})})

    own, admin = alice.get(f"/v1/requests/{request_id}"), api.get(f"/v1/requests/{request_id}")

    assert own.status_code == 200 and own.get_json()["owner"] == "alice"
    assert own.get_json()["outputs"] == {"logits": [[1.0] * 10]}
    assert admin.status_code == 200 and admin.get_json() == own.get_json()
    assert_hidden_like_an_unknown_id(bob.get(f"/v1/requests/{request_id}"), bob.get("/v1/requests/rnope"),
                                     request_id, "rnope")


# --- output folders held by another tenant's job ------------------------------------------------


def test_a_folder_held_by_another_tenant_s_active_job_answers_409_without_naming_that_job(
        api: Api, alice: Api, bob: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    held = submit_job(alice, mlp_input, tmp_path / "out")
    body = {"model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "out")}

    refused = bob.post("/v1/jobs", json=body)

    assert refused.status_code == 409
    assert error_of(refused) == (f"output_dir {(tmp_path / 'out').resolve()} is in use by another tenant's "
                                 "active job; choose another folder")
    assert held["id"] not in refused.text and "alice" not in refused.text
    for caller in (alice, api):  # the job's own tenant, and an admin, are told which job and how to free it
        response = caller.post("/v1/jobs", json=body)
        assert response.status_code == 409 and f"in use by job {held['id']} (queued)" in error_of(response)
        assert f"cancel {held['id']} first" in error_of(response)
    for inside in (tmp_path / "out" / "sub", tmp_path / "out" / ".parts" / held["id"]):  # its parts live there
        nested = bob.post("/v1/jobs", json=body | {"output_dir": str(inside)})
        assert nested.status_code == 409 and "alice" not in nested.text, error_of(nested)


def test_a_folder_another_tenant_s_stopped_job_used_answers_409_and_stays_for_that_job_s_resume(
        alice: Api, bob: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """Bob's cancelled job's parts are his resumable work; a job of Alice's finishing in his folder
    would leave a manifest that blocks his resume (and once removed his parts with hers)."""
    bobs = submit_job(bob, mlp_input, tmp_path / "out")
    bob.delete(f"/v1/jobs/{bobs['id']}")
    body = {"model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "out")}

    refused = alice.post("/v1/jobs", json=body)

    assert refused.status_code == 409
    assert error_of(refused) == (f"output_dir {(tmp_path / 'out').resolve()} was last used by another tenant's job, "
                                 "whose parts or results may still be there; choose another folder")
    assert bobs["id"] not in refused.text and "bob" not in refused.text
    assert listed_ids(alice) == []  # no job of hers was made
    assert bob.post(f"/v1/jobs/{bobs['id']}/resume").status_code == 202
    another_key_of_bob = Api(bob.client, create_api_key(store, "bob", "user"))
    bob.delete(f"/v1/jobs/{bobs['id']}")
    assert submit_job(another_key_of_bob, mlp_input, tmp_path / "out")["owner"] == "bob"  # his tenant's folder


def test_resuming_into_a_folder_an_admin_s_job_took_answers_409_without_naming_it(
        api: Api, bob: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """An admin key may take any stopped job's folder; the owner's resume is then refused, and not
    told which job took it."""
    bobs = submit_job(bob, mlp_input, tmp_path / "out")
    bob.delete(f"/v1/jobs/{bobs['id']}")
    admins = submit_job(api, mlp_input, tmp_path / "out")

    while_active = bob.post(f"/v1/jobs/{bobs['id']}/resume")
    api.delete(f"/v1/jobs/{admins['id']}")  # and once the folder holds its job's results
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"job": admins["id"]}))
    with_results = bob.post(f"/v1/jobs/{bobs['id']}/resume")

    assert while_active.status_code == 409 and "in use by another tenant's active job" in error_of(while_active)
    assert with_results.status_code == 409
    assert "now holds the results of another job; submit this job again" in error_of(with_results)
    assert all(admins["id"] not in r.text for r in (while_active, with_results))
    by_admin = api.post(f"/v1/jobs/{bobs['id']}/resume")
    assert by_admin.status_code == 409 and f"results of job {admins['id']}" in error_of(by_admin)


# --- model names -----------------------------------------------------------------------------------


def mlp_file(tmp_path: Path, seed: int, folder: str = "models") -> Path:
    """An MLP file (under `tmp_path/folder`); another seed is another version."""
    path = tmp_path / folder / f"mlp-{seed}.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        onnx.save(build_model("mlp", seed=seed), str(path))
    return path


def register(api: Api, name: str, path: Path) -> Any:
    return api.post("/v1/models", json={"name": name, "path": str(path)})


def test_a_new_model_name_becomes_its_tenant_s_and_every_model_record_shows_the_owner(
        api: Api, alice: Api, bob: Api, tmp_path: Path) -> None:
    first = register(alice, "scorer", mlp_file(tmp_path, 0))
    newer = register(alice, "scorer", mlp_file(tmp_path, 1))
    by_admin = register(api, "scorer", mlp_file(tmp_path, 2))  # admins may add versions to any name

    for response in (first, newer, by_admin):
        assert response.status_code == 201, error_of(response)
        assert response.get_json()["owner"] == "alice"
    for caller in (alice, api):
        assert [(m["owner"], m["latest"]) for m in caller.get("/v1/models").get_json()["models"]] == [
            ("alice", False), ("alice", False), ("alice", True)]
        assert caller.get(f"/v1/models/scorer@{first.get_json()['version']}").get_json()["owner"] == "alice"
    # another user key uses the model, but is not told whose name it is
    listed, newest = bob.get("/v1/models"), bob.get("/v1/models/scorer")
    assert [m["owner"] for m in listed.get_json()["models"]] == [None, None, None]
    assert newest.get_json()["owner"] is None and newest.get_json()["version"] == by_admin.get_json()["version"]
    assert "alice" not in listed.text and "alice" not in newest.text


def test_another_tenant_s_model_records_show_no_file_paths(
        api: Api, alice: Api, bob: Api, store: Store, tmp_path: Path) -> None:
    """The registered path names the registrant's folders (here its tenant's name); the stored copy's
    and a fused graph's are the server's. Keys that own the name, and admins, see them all."""
    source = mlp_file(tmp_path, 0, folder="models/alice/private")
    registered = register(alice, "scorer", source).get_json()
    ref = registered["ref"]
    fused = str(Path(registered["path"]).with_name("model.fused.onnx"))
    registry.update_model_version(store, ref, {"fusion": {"path": fused, "node_count": 3}})  # as the profiler does

    for caller in (alice, api):
        record = caller.get(f"/v1/models/{ref}").get_json()
        assert (record["source_path"], record["path"], record["fusion"]["path"]) == (
            str(source), registered["path"], fused)
    seen = [bob.get("/v1/models"), bob.get("/v1/models/scorer"), bob.get(f"/v1/models/{ref}"),
            bob.get("/v2/models/scorer"), bob.get(f"/v2/models/scorer/versions/{registered['version']}"),
            bob.get("/v2/models/scorer/config")]
    assert all(response.status_code == 200 for response in seen)
    for response in seen:
        assert "alice" not in response.text and str(tmp_path) not in response.text
        assert "private" not in response.text and "model.onnx" not in response.text
    [listed] = seen[0].get_json()["models"]
    for record in (listed, seen[1].get_json()):
        assert (record["owner"], record["source_path"], record["path"], record["fusion"]) == (
            None, None, None, {"path": None, "node_count": 3})


def test_another_tenant_s_version_under_a_taken_name_answers_403_without_naming_it_and_changes_nothing(
        alice: Api, bob: Api, store: Store, settings: Any, tmp_path: Path) -> None:
    """The very file the owner registered is refused too: registering rewrites the version's record
    (its source path, profiling), which is the owner's to change."""
    mine = register(alice, "scorer", mlp_file(tmp_path, 0)).get_json()
    before = (store.client.hgetall(store.keys.model_versions), store.client.hgetall(store.keys.model_latest))

    for path in (mlp_file(tmp_path, 1), mlp_file(tmp_path, 0)):  # a new version, and alice's very file
        response = register(bob, "scorer", path)
        assert response.status_code == 403 and response.get_json()["code"] == "forbidden"
        assert error_of(response) == "model name 'scorer' is registered by another tenant; choose another name"
        assert "alice" not in response.text

    assert (store.client.hgetall(store.keys.model_versions), store.client.hgetall(store.keys.model_latest)) == before
    assert [folder.name for folder in (settings.paths.store() / "scorer").iterdir()] == [mine["version"]]
    assert register(bob, "bob-scorer", mlp_file(tmp_path, 1)).get_json()["owner"] == "bob"


@pytest.mark.parametrize("same_file", [False, True], ids=["another-version", "the-winner-s-file"])
def test_a_registrant_that_loses_a_new_name_s_race_leaves_no_copy_the_winner_does_not_use(
        alice: Api, bob: Api, store: Store, settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        same_file: bool) -> None:
    """Bob's early check passed before alice claimed the name (as when both register it at once): his
    refused registration removes the copy it stored, unless alice's record points at that same copy."""
    mine = register(alice, "scorer", mlp_file(tmp_path, 0)).get_json()
    if same_file:  # alice's copy is there already: bob's registration wrote nothing of its own
        stored = Path(mine["path"])
    monkeypatch.setattr(registry, "check_may_register", lambda *_: None)

    response = register(bob, "scorer", mlp_file(tmp_path, 0 if same_file else 1))

    assert response.status_code == 403 and "registered by another tenant" in error_of(response)
    assert [folder.name for folder in (settings.paths.store() / "scorer").iterdir()] == [mine["version"]]
    if same_file:
        assert stored.is_file() and alice.get(f"/v1/models/{mine['ref']}").status_code == 200
    assert not list((settings.paths.store() / "scorer" / mine["version"]).glob(".*.tmp"))


def test_models_stay_shared_another_tenant_runs_a_model_by_its_name(
        alice: Api, bob: Api, mlp_input: Path, tmp_path: Path) -> None:
    register(alice, "scorer", mlp_file(tmp_path, 0))

    request = bob.post("/v1/requests", json={"model": "scorer", "inputs": {"features": [[0.5] * 64]}})
    job = bob.post("/v1/jobs", json={"model": "scorer", "input_batch": str(mlp_input),
                                     "output_dir": str(tmp_path / "out")})

    assert request.status_code == 202, error_of(request)
    assert job.status_code == 201 and job.get_json()["owner"] == "bob", error_of(job)
    assert bob.get("/v2/models/scorer").status_code == 200


def test_a_model_name_registered_before_names_had_owners_takes_versions_from_admin_keys_only(
        api: Api, alice: Api, store: Store, tmp_path: Path) -> None:
    legacy = register(api, "legacy", mlp_file(tmp_path, 0)).get_json()
    # as a name and a record saved before names had owners
    store.client.hdel(store.keys.model_owners, "legacy")
    record = json.loads(store.client.hget(store.keys.model_versions, legacy["ref"]))
    del record["owner"]
    store.client.hset(store.keys.model_versions, legacy["ref"], json.dumps(record))

    refused = register(alice, "legacy", mlp_file(tmp_path, 1))
    by_admin = register(api, "legacy", mlp_file(tmp_path, 1))

    assert refused.status_code == 403
    assert "belongs to no tenant (registered by an admin key, or before model names had owners), so only an admin " \
           "key may add versions" in error_of(refused)
    assert by_admin.status_code == 201 and by_admin.get_json()["owner"] is None
    assert alice.get(f"/v1/models/{legacy['ref']}").get_json()["owner"] is None
    assert [m["owner"] for m in alice.get("/v1/models").get_json()["models"]] == [None, None]
    assert register(alice, "legacy", mlp_file(tmp_path, 2)).status_code == 403  # the admin's version claimed nothing


def test_a_new_model_name_registered_by_an_admin_key_belongs_to_no_tenant(
        api: Api, alice: Api, client: FlaskClient, store: Store, tmp_path: Path) -> None:
    """Not to the admin key's name ('test'): a user key of that name, as one created before a name was
    kept to one role, would add versions to every name the admin registered."""
    namesake = "sits_a-user-key-named-like-the-admin-key"
    store.client.hset(store.keys.api_keys, hashlib.sha256(namesake.encode()).hexdigest(),
                      json.dumps({"name": "test", "role": "user"}))

    first = register(api, "shared-scorer", mlp_file(tmp_path, 0))
    newer = register(api, "shared-scorer", mlp_file(tmp_path, 1))

    assert first.status_code == newer.status_code == 201, error_of(first)
    assert first.get_json()["owner"] is None and newer.get_json()["owner"] is None
    assert not store.client.hexists(store.keys.model_owners, "shared-scorer")
    for user in (alice, Api(client, namesake)):
        refused = register(user, "shared-scorer", mlp_file(tmp_path, 2))
        assert refused.status_code == 403 and "belongs to no tenant" in error_of(refused)
        record = user.get("/v1/models/shared-scorer").get_json()
        assert record["owner"] is None and record["source_path"] is None  # used by all, owned by none
    assert api.get("/v1/models/shared-scorer").get_json()["source_path"] == str(mlp_file(tmp_path, 1))


# --- records stored before owners were checked -----------------------------------------------------


def test_jobs_and_requests_stored_without_an_owner_are_seen_by_admins_only(
        api: Api, alice: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job_id = submit_job(api, mlp_input, tmp_path / "out")["id"]
    request_id = submit_request(api)
    store.client.hdel(store.keys.job(job_id), "owner")
    store.client.hset(store.keys.request(request_id), "owner", "")  # both forms an older record may have

    assert alice.get(f"/v1/jobs/{job_id}").status_code == 404
    assert alice.delete(f"/v1/jobs/{job_id}").status_code == 404
    assert alice.get(f"/v1/requests/{request_id}").status_code == 404
    assert listed_ids(alice) == []
    assert api.get(f"/v1/jobs/{job_id}").get_json()["owner"] is None
    assert api.get(f"/v1/requests/{request_id}").get_json()["owner"] is None
    assert listed_ids(api) == [job_id]


# --- status ---------------------------------------------------------------------------------------


def test_status_shows_a_user_a_shared_model_s_counts_but_no_other_tenant_s_jobs_ids_nor_the_redis_url(
        api: Api, alice: Api, bob: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit_job(alice, mlp_input, tmp_path / "out")
    request_id = submit_request(alice)

    response = bob.get("/v1/status")

    assert response.status_code == 200
    overview = response.get_json()
    assert overview["jobs"] == {} and overview["queues"][mlp["ref"]]["ready"] == 2  # (its own jobs: none)
    assert alice.get("/v1/status").get_json()["jobs"] == {"queued": 1}
    assert "redis_url" not in overview
    assert job["id"] not in response.text and request_id not in response.text and "alice" not in response.text
    assert "redis_url" in api.get("/v1/status").get_json()


# --- sitsctl --------------------------------------------------------------------------------------


def test_sitsctl_job_list_passes_owner_through(
        served_api: str, admin_key: str, three_tenants_jobs: dict[str, list[str]], tmp_path: Path) -> None:
    env = {"SITS_HOME": str(tmp_path / "home"), "SITS_API_URL": served_api, "SITS_API_KEY": admin_key,
           "SITS_CONFIG": None}

    result = CliRunner().invoke(cli, ["job", "list", "--owner", "bob", "--json"], env=env)
    by_tenant = CliRunner().invoke(cli, ["job", "list", "--tenant", "alice", "--json"], env=env)

    assert result.exit_code == 0, result.output
    assert [job["id"] for job in json.loads(result.output)["jobs"]] == three_tenants_jobs["bob"]
    assert [job["id"] for job in json.loads(by_tenant.output)["jobs"]] == three_tenants_jobs["alice"]


def test_a_tenant_filter_is_an_admin_s_choice_and_another_tenant_named_by_a_user_lists_none(
        api: Api, alice: Api, three_tenants_jobs: dict[str, list[str]]) -> None:
    assert listed_ids(api, "?tenant=bob") == three_tenants_jobs["bob"]
    assert listed_ids(api, "?tenant=bob&owner=bob") == three_tenants_jobs["bob"]
    assert listed_ids(alice, "?tenant=alice") == three_tenants_jobs["alice"]
    assert listed_ids(alice, "?tenant=bob") == listed_ids(alice, "?tenant=no-such-tenant") == []


def test_sitsctl_model_register_prints_the_403_for_another_tenant_s_name(
        served_api: str, alice: Api, store: Store, tmp_path: Path) -> None:
    assert register(alice, "scorer", mlp_file(tmp_path, 0)).status_code == 201
    env = {"SITS_HOME": str(tmp_path / "home"), "SITS_API_URL": served_api,
           "SITS_API_KEY": create_api_key(store, "bob", "user"), "SITS_CONFIG": None}

    result = CliRunner().invoke(cli, ["model", "register", "--name", "scorer", "--path", str(mlp_file(tmp_path, 1))],
                                env=env)

    output = " ".join(result.output.split())
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), output
    assert "Traceback" not in output
    assert "error: 403: model name 'scorer' is registered by another tenant; choose another name" in output


def test_sitsctl_key_create_refuses_a_user_key_of_the_tenant_an_admin_key_acts_as(
        redis_server: Any, store: Store, admin_key: str, tmp_path: Path) -> None:
    """The admin fixture's key is named 'test': a user key of tenant 'test' (its name's, given no tenant) would own
    the admin's jobs."""
    config = tmp_path / "sits-config.yaml"
    config.write_text(json.dumps({"redis": {"url": redis_server.url, "key_prefix": store.keys.prefix}}))
    env = {"SITS_HOME": str(tmp_path / "home"), "SITS_REDIS_URL": None, "SITS_CONFIG": None}
    stored = store.client.hgetall(store.keys.api_keys)

    result = CliRunner().invoke(cli, ["key", "create", "--name", "test", "--config", str(config)], env=env)

    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in output, output
    assert "tenant 'test' is named like an admin key" in output
    assert store.client.hgetall(store.keys.api_keys) == stored



def test_a_key_change_that_keeps_meeting_other_writes_is_a_429_not_a_loop(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant making keys without pause breaks every other key change's transaction; each tried again for
    ever. Here every EXEC meets a write since its WATCH (its 1,000th would pass)."""
    import redis as redis_py

    from broker.errors import QueueFull
    met = {"writes": 0}
    execute = redis_py.client.Pipeline.execute

    def after_a_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.watching and met["writes"] < 1000:
            met["writes"] += 1
            self.reset()
            raise redis_py.WatchError("a key was written meanwhile")
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(redis_py.client.Pipeline, "execute", after_a_write)
    with pytest.raises(QueueFull, match="send it again"):
        create_api_key(store, "carol", "user", tenant="acme")
    assert met["writes"] == 20
