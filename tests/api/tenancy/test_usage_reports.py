"""`GET /v1/usage` as each role may read it: a user key sees its own key's rows by key, and a tenant runs one
report of whole bills at a time (429 + Retry-After), an admin key uncounted (real Redis, no worker)."""

from __future__ import annotations

import time

from flask.testing import FlaskClient

from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.usage import BillEntry
from tests.api.api_helpers import Api, error_of, tenant_key


def bill(store: Store) -> None:
    """Today's bills: acme's keys alice and bob, and globex's gary."""
    tenant_usage.note_usage(store, [BillEntry("acme", "alice", "mlp@v1", "cpu", 1.5, 30, 3),
                                    BillEntry("acme", "bob", "mlp@v2", "cpu", 0.5, 10, 1),
                                    BillEntry("globex", "gary", "mlp@v1", "cpu", 2.0, 20, 2)],
                            now=time.time(), half_life=30)


def keys_shown(caller: Api) -> list[str]:
    answer = caller.get("/v1/usage?by=key")
    assert answer.status_code == 200, answer.get_json()
    return [row["key"] for row in answer.get_json()["usage"]]


def test_by_key_a_user_sees_its_own_key_s_rows_and_a_viewer_or_tenant_admin_every_key_s(
        client: FlaskClient, store: Store) -> None:
    bill(store)

    assert keys_shown(tenant_key(client, store, "alice", "user", "acme")) == ["alice"]
    assert keys_shown(tenant_key(client, store, "carol", "user", "acme")) == []  # (it ran nothing)
    assert keys_shown(tenant_key(client, store, "vera", "viewer", "acme")) == ["alice", "bob"]
    assert keys_shown(tenant_key(client, store, "boss", "tenant-admin", "acme")) == ["alice", "bob"]
    alice_totals = tenant_key(client, store, "alice2", "user", "acme").get("/v1/usage").get_json()["usage"]
    assert [row["device_seconds"] for row in alice_totals] == [2.0]  # its tenant's totals, as before


def test_a_second_report_of_whole_bills_of_a_tenant_while_one_runs_is_a_429(api: Api, client: FlaskClient,
                                                                              store: Store) -> None:
    bill(store)
    boss = tenant_key(client, store, "boss", "tenant-admin", "acme")
    alice = tenant_key(client, store, "alice", "user", "acme")

    with tenant_usage.one_report_at_a_time(store, "acme", clock=lambda: 0.0):  # one of acme's runs (no rest after)
        busy = boss.get("/v1/usage?by=model")
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert "usage report" in error_of(busy)
        assert alice.get("/v1/usage?by=device").status_code == 429
        assert boss.get("/v1/usage?by=key").status_code == 429
        assert boss.get("/v1/usage?by=day").status_code == 200  # reads the totals alone: not counted
        assert alice.get("/v1/usage?by=key").status_code == 200  # its own key's fields alone
        assert tenant_key(client, store, "gary", "user", "globex").get("/v1/usage?by=model").status_code == 200
        assert api.get("/v1/usage?by=model").status_code == 200  # an operator's
    assert boss.get("/v1/usage?by=model").status_code == 200


def test_a_report_refused_while_its_tenant_s_place_rests_is_told_to_retry_when_the_rest_ends(
        client: FlaskClient, store: Store) -> None:
    """A rest of three times the report's run was answered Retry-After: 1, so a client that obeyed it got 429 again."""
    bill(store)
    boss = tenant_key(client, store, "boss", "tenant-admin", "acme")
    ticks = iter([0.0, 2.5])
    with tenant_usage.one_report_at_a_time(store, "acme", clock=lambda: next(ticks)):  # a run of 2.5 s: 7.5 s rest
        pass

    busy = boss.get("/v1/usage?by=model")

    assert busy.status_code == 429 and 7 <= int(busy.headers["Retry-After"]) <= 8
