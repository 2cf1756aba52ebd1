"""A key name is its tenant's: the walls between tenants compare tenants first, then names."""

from __future__ import annotations

import pytest

from broker.state.store import Store
from broker.tenants import apikeys


def test_two_tenants_may_each_have_a_key_of_a_name_and_one_tenant_several(store: Store) -> None:
    apikeys.create_api_key(store, "alice", "user", tenant="acme")
    apikeys.create_api_key(store, "alice", "user", tenant="evil")
    apikeys.create_api_key(store, "alice", "tenant-admin")  # (its tenant: its own name, 'alice')
    apikeys.create_api_key(store, "alice", "viewer", tenant="acme")  # a second key of acme's alice
    apikeys.create_api_key(store, "alice", "metrics")  # metrics keys own nothing: their names are free
    assert sorted((key["name"], key["tenant"], key["role"]) for key in apikeys.list_api_keys(store)
                  if key["role"] != "metrics") == [("alice", "acme", "user"), ("alice", "acme", "viewer"),
                                                   ("alice", "alice", "tenant-admin"), ("alice", "evil", "user")]
    assert [key["role"] for key in apikeys.list_api_keys(store, "acme")] == ["user", "viewer"]


def test_a_key_of_one_tenant_named_like_a_key_of_another_owns_none_of_its_work_or_names() -> None:
    """Two tenants may each have a key of one name."""
    acme_alice = {"name": "alice", "role": "user", "tenant": "acme"}
    evil_alice = {"name": "alice", "role": "user", "tenant": "evil"}
    evil_admin = {"name": "mallory", "role": "tenant-admin", "tenant": "evil"}

    assert apikeys.owns(acme_alice, "alice", "acme") and not apikeys.owns(evil_alice, "alice", "acme")
    assert not apikeys.may_read(evil_alice, "alice", "acme") and not apikeys.owns(evil_admin, "alice", "acme")
    assert not apikeys.owns(evil_alice, "alice", None)  # a record from before tenants: its owner's name was its tenant
    assert apikeys.owns_name(acme_alice, "acme") and not apikeys.owns_name(evil_alice, "acme")
    assert not apikeys.owns_name(evil_alice, None) and apikeys.owns_name({"name": "ops", "role": "admin"}, None)


@pytest.mark.parametrize("name", ["eve\ud800", "а" + "lice", "k" * 65, "a/b", "tab\tname", ".hidden"],
                         ids=["lone-surrogate", "cyrillic-look-alike", "too-long", "slash", "control", "dot-first"])
def test_a_key_name_is_short_plain_text(store: Store, name: str) -> None:
    """A name a person reads: no look-alike letters, no control or unencodable characters, no megabytes
    (every record a key submits carries its name)."""
    with pytest.raises(ValueError, match="must be letters, digits"):
        apikeys.create_api_key(store, name, "user", tenant="evil")
    apikeys.create_api_key(store, "eve.smith+ops@example.org", "user", tenant="evil")  # an e-mail address fits


def test_a_tenant_holds_at_most_its_share_of_keys(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apikeys, "MAX_KEYS_PER_TENANT", 3)
    for n in range(3):
        apikeys.create_api_key(store, f"k{n}", "user", tenant="evil")

    with pytest.raises(ValueError, match="holds 3 keys, the most a tenant may"):
        apikeys.create_api_key(store, "k3", "user", tenant="evil")
    apikeys.create_api_key(store, "a0", "user", tenant="acme")  # another tenant's count is its own
