"""A key name is one tenant's: the walls between tenants compare tenants first, then names."""

from __future__ import annotations

import pytest

from broker.state.store import Store
from broker.tenants import apikeys


def test_a_key_name_another_tenant_has_is_refused_and_one_tenant_may_have_several_keys_of_a_name(
        store: Store) -> None:
    apikeys.create_api_key(store, "alice", "user", tenant="acme")

    with pytest.raises(ValueError, match="'alice' is taken by a key of another tenant"):
        apikeys.create_api_key(store, "alice", "user", tenant="evil")
    with pytest.raises(ValueError, match="another tenant"):
        apikeys.create_api_key(store, "alice", "tenant-admin")  # (its tenant: its own name, 'alice')
    apikeys.create_api_key(store, "alice", "viewer", tenant="acme")  # a second key of acme's alice
    apikeys.create_api_key(store, "alice", "metrics")  # metrics keys own nothing: their names are free
    assert {(key["name"], key["tenant"]) for key in apikeys.list_api_keys(store) if key["role"] != "metrics"} == {
        ("alice", "acme")}


def test_a_key_of_one_tenant_named_like_a_key_of_another_owns_none_of_its_work_or_names() -> None:
    """Such keys exist where they were made before names were unique, or were written by hand."""
    acme_alice = {"name": "alice", "role": "user", "tenant": "acme"}
    evil_alice = {"name": "alice", "role": "user", "tenant": "evil"}
    evil_admin = {"name": "mallory", "role": "tenant-admin", "tenant": "evil"}

    assert apikeys.owns(acme_alice, "alice", "acme") and not apikeys.owns(evil_alice, "alice", "acme")
    assert not apikeys.may_read(evil_alice, "alice", "acme") and not apikeys.owns(evil_admin, "alice", "acme")
    assert not apikeys.owns(evil_alice, "alice", None)  # a record from before tenants: its owner's name was its tenant
    assert apikeys.owns_name(acme_alice, "acme") and not apikeys.owns_name(evil_alice, "acme")
    assert not apikeys.owns_name(evil_alice, None) and apikeys.owns_name({"name": "ops", "role": "admin"}, None)
