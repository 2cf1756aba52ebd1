"""Each tenant's job index (`keys.jobs_of_tenant`): written at a job's creation, back-filled by reaper
passes for jobs stored before it, left by retention, and what `list_jobs(tenant=...)` reads, so that
`limit` counts the tenant's own newest jobs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.jobs import stops as job_stops
from broker.jobs.retention import forget_ended_jobs
from broker.state.store import Store
from tests.broker.broker_helpers import NOW, job_spec


def create(store: Store, job_id: str, *, at: float, owner: str, tenant: str = "") -> None:
    spec = dataclasses.replace(job_spec(job_id, rows_total=1, chunk_size=1), owner=owner, tenant=tenant)
    job_fills.create_job(store, spec, now=at)


def listed(store: Store, **filters: Any) -> list[str]:
    return [job.id for job in job_lists.list_jobs(store, now=NOW + 100, **filters)]


@pytest.mark.parametrize("indexed", [True, False], ids=["tenant-index", "scan-before-the-index-is-built"])
def test_a_tenant_s_list_is_its_newest_jobs_however_many_other_tenants_are_newer(
        store: Store, monkeypatch: pytest.MonkeyPatch, indexed: bool) -> None:
    monkeypatch.setattr(job_lists, "LIST_SCAN_PAGE", 2)  # acme's jobs lie several pages down the index
    for i in range(3):
        create(store, f"ja{i}", at=NOW + i, owner="alice", tenant="acme")
    for i in range(6):
        create(store, f"jg{i}", at=NOW + 10 + i, owner="gary", tenant="globex")
    create(store, "jold", at=NOW + 20, owner="acme")  # stored before tenants: its owner's name is its tenant
    create(store, "jnone", at=NOW + 30, owner="")  # no owner: an admin's alone, no tenant's
    job_stops.stop_job(store, "ja0", status="cancelled", error="", now=NOW + 50)
    if indexed:
        assert job_lists.index_job_owners(store) and job_lists.index_job_tenants(store)  # as a reaper pass does
    assert store.client.zrevrange(store.keys.jobs_of_tenant("acme"), 0, -1) == ["jold", "ja2", "ja1", "ja0"]

    assert listed(store, tenant="acme", limit=2) == ["jold", "ja2"]
    assert listed(store, tenant="acme", owner="alice", limit=2) == ["ja2", "ja1"]
    assert listed(store, tenant="acme", status="cancelled", limit=1) == ["ja0"]
    assert listed(store, tenant="globex", limit=1) == ["jg5"]
    assert listed(store, tenant="initech") == []
    assert listed(store, limit=1) == ["jnone"]  # no tenant: every job, as before


def test_reaper_passes_index_jobs_stored_before_the_tenant_indexes_a_page_at_a_time(store: Store) -> None:
    for i, (owner, tenant) in enumerate([("alice", "acme"), ("gary", "globex"), ("bob", "acme"), ("acme", ""),
                                         ("", "acme")]):
        create(store, f"j{i}", at=NOW + min(i, 2), owner=owner, tenant=tenant)
    store.client.delete(store.keys.jobs_of_tenant("acme"), store.keys.jobs_of_tenant("globex"))  # as before

    assert not job_lists.index_job_tenants(store, limit=4)  # a full page: more may follow
    assert not store.client.exists(store.keys.tenant_index_built)
    assert listed(store, tenant="acme") == ["j3", "j2", "j0"]  # the scan, meanwhile
    assert job_lists.index_job_tenants(store, limit=4)

    assert store.client.zrange(store.keys.jobs_of_tenant("acme"), 0, -1, withscores=True) == [
        ("j0", NOW), ("j2", NOW + 2), ("j3", NOW + 2)]  # j4 has no owner: in no tenant's index
    assert store.client.zrange(store.keys.jobs_of_tenant("globex"), 0, -1) == ["j1"]
    assert listed(store, tenant="acme", limit=2) == ["j3", "j2"]


def test_retention_takes_a_forgotten_job_out_of_its_tenant_s_index(store: Store) -> None:
    create(store, "jgone", at=NOW - 10, owner="alice", tenant="acme")
    create(store, "jkept", at=NOW - 10, owner="alice", tenant="acme")
    job_stops.stop_job(store, "jgone", status="cancelled", error="", now=NOW - 9)

    assert forget_ended_jobs(store, now=NOW, retention=5) == ["jgone"]
    assert store.client.zrange(store.keys.jobs_of_tenant("acme"), 0, -1) == ["jkept"]


def test_naming_another_tenant_s_key_as_owner_costs_what_naming_no_key_does(store: Store) -> None:
    """A tenant admin's `?owner=` of another tenant's key reads the caller's own tenant's jobs, not that key's
    (thousands of them would take time to walk and tell that the key exists and how busy it is)."""
    for i in range(2):
        create(store, f"ja{i}", at=NOW + i, owner="alice", tenant="acme")
    for i in range(1_500):
        create(store, f"jg{i}", at=NOW + 10 + i / 1000, owner="gary", tenant="globex")
    assert job_lists.index_job_owners(store) and job_lists.index_job_tenants(store)

    def commands_of(**filters: Any) -> tuple[list[str], int]:
        before = store.client.info("stats")["total_commands_processed"]
        ids = listed(store, **filters)
        return ids, store.client.info("stats")["total_commands_processed"] - before - 1  # (less the INFO)

    other, other_cost = commands_of(tenant="acme", owner="gary", limit=1)
    missing, missing_cost = commands_of(tenant="acme", owner="nobody", limit=1)
    assert other == missing == []
    assert other_cost == missing_cost, (other_cost, missing_cost)
    assert listed(store, tenant="acme", owner="alice", limit=5) == ["ja1", "ja0"]  # a key of its own is found


def test_a_key_s_own_jobs_are_listed_whatever_a_key_of_its_name_in_another_tenant_holds(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key name is its tenant's, and so is the index of its jobs: globex's `alice`, however busy, neither
    hides acme's `alice`'s jobs (a shared index walked to its bound found none of them) nor costs its list time."""
    for i in range(2):
        create(store, f"ja{i}", at=NOW + i, owner="alice", tenant="acme")
    assert job_lists.index_job_owners(store) and job_lists.index_job_tenants(store)

    def commands_of(**filters: Any) -> tuple[list[str], int]:
        before = store.client.info("stats")["total_commands_processed"]
        ids = listed(store, **filters)
        return ids, store.client.info("stats")["total_commands_processed"] - before - 1  # (less the INFO)

    alone = commands_of(tenant="acme", owner="alice")
    for i in range(1_200):
        create(store, f"jg{i}", at=NOW + 10 + i / 1000, owner="alice", tenant="globex")
    monkeypatch.setattr(job_lists, "LIST_SCAN_JOBS", 1_000)

    assert commands_of(tenant="acme", owner="alice") == alone == (["ja1", "ja0"], alone[1])
    assert listed(store, tenant="globex", owner="alice", limit=2) == ["jg1199", "jg1198"]


def test_the_owner_pass_indexes_by_tenant_and_drops_the_indexes_of_names_of_whichever_tenant(store: Store) -> None:
    """Releases before key names were their tenant's kept one index per name (`keys.names_jobs`): the pass that
    builds the per-tenant ones deletes it, so nothing is left that nothing reads."""
    create(store, "ja", at=NOW, owner="alice", tenant="acme")
    create(store, "jg", at=NOW + 1, owner="alice", tenant="globex")
    store.client.delete(store.keys.owner_jobs("acme", "alice"), store.keys.owner_jobs("globex", "alice"))
    store.client.zadd(store.keys.names_jobs("alice"), {"ja": NOW, "jg": NOW + 1})

    assert job_lists.index_job_owners(store)

    assert store.client.zrange(store.keys.owner_jobs("acme", "alice"), 0, -1) == ["ja"]
    assert store.client.zrange(store.keys.owner_jobs("globex", "alice"), 0, -1) == ["jg"]
    assert not store.client.exists(store.keys.names_jobs("alice"))
