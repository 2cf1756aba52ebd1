"""Tenants: a user key sees and steers only the jobs and requests submitted under its name, an admin key all.

Another tenant's job or request answers 404 with the very message an unknown id gets (nothing
tells that it exists), and changes nothing in Redis; records stored without an owner (before
owners were checked) are an admin's alone.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from api_helpers import Api, error_of
from click.testing import CliRunner
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.serving import make_server

from broker import requests
from broker.apikeys import create_api_key, owns
from broker.store import Store
from sits_api.cli.main import cli


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


def test_a_key_without_a_name_cannot_be_created(store: Store) -> None:
    with pytest.raises(ValueError, match="needs a name"):
        create_api_key(store, "  ", "user")


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


def test_status_shows_a_user_counts_but_no_other_tenant_s_ids_nor_the_redis_url(
        api: Api, alice: Api, bob: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit_job(alice, mlp_input, tmp_path / "out")
    request_id = submit_request(alice)

    response = bob.get("/v1/status")

    assert response.status_code == 200
    overview = response.get_json()
    assert overview["jobs"] == {"queued": 1} and overview["queues"][mlp["ref"]]["ready"] == 2
    assert "redis_url" not in overview
    assert job["id"] not in response.text and request_id not in response.text and "alice" not in response.text
    assert "redis_url" in api.get("/v1/status").get_json()


# --- sitsctl --------------------------------------------------------------------------------------


@pytest.fixture
def served_api(app: Flask) -> Iterator[str]:
    """The app on a real port, as sitsctl talks HTTP."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(timeout=5)


def test_sitsctl_job_list_passes_owner_through(
        served_api: str, admin_key: str, three_tenants_jobs: dict[str, list[str]], tmp_path: Path) -> None:
    env = {"SITS_HOME": str(tmp_path / "home"), "SITS_API_URL": served_api, "SITS_API_KEY": admin_key,
           "SITS_CONFIG": None}

    result = CliRunner().invoke(cli, ["job", "list", "--owner", "bob", "--json"], env=env)

    assert result.exit_code == 0, result.output
    assert [job["id"] for job in json.loads(result.output)["jobs"]] == three_tenants_jobs["bob"]
