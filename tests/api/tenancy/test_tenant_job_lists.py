"""`GET /v1/jobs?limit=N` of a tenant-admin, viewer or user key is its tenant's newest N, however many jobs
other tenants submitted since (real Redis, no worker): read from the tenant's own job index, not the
newest jobs of all tenants filtered afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.jobs import lists as job_lists
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from tests.api.api_helpers import Api, error_of, two_tenants_sharing_roots
from tests.api.api_helpers import tenant_key as key


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    return two_tenants_sharing_roots(redis_server, store, tmp_path, zoo_dir)


def listed_ids(api: Api, query: str) -> list[str]:
    response = api.get("/v1/jobs" + query)
    assert response.status_code == 200, error_of(response)
    return [job["id"] for job in response.get_json()["jobs"]]


@pytest.mark.parametrize("indexed", [True, False], ids=["tenant-index", "scan-before-the-index-is-built"])
def test_a_tenant_s_limit_is_its_newest_jobs_however_many_other_tenants_submitted_since(
        client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        indexed: bool) -> None:
    alice = key(client, store, "alice", "user", "acme")
    boss, viewer = key(client, store, "boss", "tenant-admin", "acme"), key(client, store, "vic", "viewer", "acme")
    gary = key(client, store, "gary", "user", "globex")

    def submit(api: Api, name: str) -> str:
        response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                              "output_dir": str(tmp_path / name)})
        assert response.status_code == 201, error_of(response)
        return str(response.get_json()["id"])

    acme = [submit(alice, f"acme{n}") for n in range(3)]
    globex = [submit(gary, f"globex{n}") for n in range(4)]  # newer than every job of acme's
    assert boss.delete(f"/v1/jobs/{acme[0]}").status_code == 200
    if indexed:
        assert job_lists.index_job_owners(store) and job_lists.index_job_tenants(store)  # as a reaper pass does

    newest_two = [acme[2], acme[1]]
    assert listed_ids(boss, "?limit=2") == newest_two
    assert listed_ids(viewer, "?limit=2") == newest_two
    assert listed_ids(alice, "?limit=2") == newest_two
    assert listed_ids(boss, "?owner=alice&limit=2") == newest_two
    assert listed_ids(boss, "?status=cancelled&limit=1") == [acme[0]]
    assert listed_ids(viewer, "?status=queued&limit=5") == newest_two
    assert listed_ids(gary, "?limit=2") == [globex[3], globex[2]]
