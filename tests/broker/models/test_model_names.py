"""Model names belong to the tenant that registered them first: only its keys and admins add versions.

The check and the claim are one transaction with the write (`registry.save_model_version`), so of
tenants registering one new name at once exactly one gets it; the others are refused as later ones are.
A name an admin key registers first belongs to no tenant: admin keys alone add versions to it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from broker.errors import Forbidden
from broker.models import registry
from broker.state.store import Store

ALICE = {"name": "alice", "role": "user"}
BOB = {"name": "bob", "role": "user"}
ADMIN = {"name": "root", "role": "admin"}


def version(name: str, version_id: str) -> dict[str, Any]:
    return {"name": name, "version": version_id, "ref": f"{name}@{version_id}", "registered_at": 1.0}


def stored_versions(store: Store) -> list[str]:
    return sorted(store.client.hkeys(store.keys.model_versions))


def test_a_new_name_becomes_its_registrant_s_and_every_version_carries_that_owner(store: Store) -> None:
    first = registry.save_model_version(store, version("mlp", "a1"), registrant=ALICE)
    second = registry.save_model_version(store, version("mlp", "b2"), registrant=ADMIN)  # an admin adds one

    assert first.owner == second.owner == "alice"
    assert store.client.hget(store.keys.model_owners, "mlp") == "alice"
    assert sorted((r.version, r.owner) for r in registry.list_model_versions(store)) == [("a1", "alice"),
                                                                                                ("b2", "alice")]
    assert registry.get_model(store, "mlp").owner == "alice"


def test_another_user_s_version_under_a_taken_name_is_forbidden_and_stores_nothing(store: Store) -> None:
    registry.save_model_version(store, version("mlp", "a1"), registrant=ALICE)

    for attempt in (version("mlp", "b2"), version("mlp", "a1")):  # a new version, and the same one again
        with pytest.raises(Forbidden) as refused:
            registry.save_model_version(store, attempt, registrant=BOB)
        assert refused.value.message == "model name 'mlp' is registered by another tenant; choose another name"
        with pytest.raises(Forbidden):
            registry.check_may_register(store, "mlp", BOB)

    assert stored_versions(store) == ["mlp@a1"]
    assert registry.get_model(store, "mlp").version == "a1"
    registry.check_may_register(store, "mlp", ALICE)
    registry.check_may_register(store, "mlp", ADMIN)
    registry.check_may_register(store, "cnn", BOB)  # a new name is anyone's


def test_a_name_registered_before_names_had_owners_takes_versions_from_admins_only(store: Store) -> None:
    registry.save_model_version(store, version("mlp", "a1"))  # as before: no registrant, no owner

    with pytest.raises(Forbidden, match="belongs to no tenant .* before model names had owners.*only an admin key"):
        registry.save_model_version(store, version("mlp", "b2"), registrant=ALICE)
    added = registry.save_model_version(store, version("mlp", "b2"), registrant=ADMIN)

    assert added.owner is None and not store.client.hexists(store.keys.model_owners, "mlp")  # not claimed
    assert [r.owner for r in registry.list_model_versions(store)] == [None, None]
    with pytest.raises(Forbidden):
        registry.check_may_register(store, "mlp", ALICE)


def test_a_new_name_registered_by_an_admin_key_belongs_to_no_tenant(store: Store) -> None:
    """Not to the admin key's name: a user key of that name (one created before a name was kept to
    one role) would own every name the admin registered."""
    first = registry.save_model_version(store, version("mlp", "a1"), registrant=ADMIN)
    second = registry.save_model_version(store, version("mlp", "b2"), registrant=ADMIN)

    assert first.owner is None and second.owner is None
    assert not store.client.hexists(store.keys.model_owners, "mlp")
    for user in (ALICE, {"name": ADMIN["name"], "role": "user"}):
        with pytest.raises(Forbidden) as refused:
            registry.save_model_version(store, version("mlp", "c3"), registrant=user)
        assert refused.value.message == ("model name 'mlp' belongs to no tenant (registered by an admin key, or "
                                         "before model names had owners), so only an admin key may add versions "
                                         "to it; choose another name")
        with pytest.raises(Forbidden):
            registry.check_may_register(store, "mlp", user)
    assert stored_versions(store) == ["mlp@a1", "mlp@b2"] and registry.get_model(store, "mlp").version == "b2"
    assert registry.name_claimant(ALICE) == "alice" and registry.name_claimant(ADMIN) is None


@pytest.mark.parametrize(("first", "refusal", "owner"), [
    (BOB, "registered by another tenant", "bob"),
    (ADMIN, "belongs to no tenant", None),
], ids=["another-tenant", "an-admin"])
def test_a_name_registered_between_the_check_and_the_write_is_refused_on_the_retry(
        store: Store, monkeypatch: pytest.MonkeyPatch, first: dict[str, Any], refusal: str, owner: str | None) -> None:
    """Another key registers the new name after Alice's transaction read it free, before it wrote: her
    write is not applied (WATCH on the owners and on `model-latest`, which alone marks a name an admin
    key registered), and her second look finds the name taken: Bob's, or no tenant's."""
    check = registry._refuse_a_name_of_another
    calls: list[str] = []

    def another_gets_in_first(registrant: dict[str, Any], name: str, **seen: Any) -> None:
        calls.append(registrant["name"])
        check(registrant, name, **seen)
        if calls == ["alice"]:
            registry.save_model_version(store, version("mlp", "b2"), registrant=first)

    monkeypatch.setattr(registry, "_refuse_a_name_of_another", another_gets_in_first)

    with pytest.raises(Forbidden, match=refusal):
        registry.save_model_version(store, version("mlp", "a1"), registrant=ALICE)

    assert calls == ["alice", first["name"], "alice"]
    assert store.client.hget(store.keys.model_owners, "mlp") == owner
    assert stored_versions(store) == ["mlp@b2"] and registry.get_model(store, "mlp").owner == owner


def test_of_tenants_registering_one_new_name_at_once_exactly_one_gets_it(store: Store) -> None:
    tenants = [{"name": f"tenant{n}", "role": "user"} for n in range(8)]
    start = threading.Barrier(len(tenants))
    outcomes: dict[str, str] = {}

    def register(tenant: dict[str, Any]) -> None:
        start.wait()
        try:
            registry.save_model_version(store, version("shared", tenant["name"]), registrant=tenant)
            outcomes[tenant["name"]] = "registered"
        except Forbidden:
            outcomes[tenant["name"]] = "forbidden"

    threads = [threading.Thread(target=register, args=(tenant,)) for tenant in tenants]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    [winner] = [name for name, outcome in outcomes.items() if outcome == "registered"]
    assert len(outcomes) == len(tenants)
    assert store.client.hget(store.keys.model_owners, "shared") == winner
    assert stored_versions(store) == [f"shared@{winner}"]
    assert registry.get_model(store, "shared").owner == winner


def test_registering_a_version_again_keeps_a_profile_a_worker_wrote_meanwhile(store: Store) -> None:
    """The record is built from the stored one inside the transaction: a measured profile that lands
    between the registration's look and its write is kept, not overwritten by an earlier read."""
    registry.save_model_version(store, version("mlp", "v1"), registrant=ALICE)
    seen: list[dict[str, Any] | None] = []

    def again(existing: dict[str, Any] | None) -> dict[str, Any]:
        seen.append(existing)
        if len(seen) == 1:  # a worker's profile lands after the first look: the write must be retried
            registry.update_model_version(store, "mlp@v1", {"profile": {"points": [1]}})
        return (existing or {}) | {"name": "mlp", "version": "v1", "source_path": "/again.onnx"}

    record = registry.save_model_version(store, version("mlp", "v1"), registrant=ALICE, based_on=again)

    assert len(seen) == 2 and "profile" not in (seen[0] or {}) and (seen[1] or {})["profile"] == {"points": [1]}
    assert record.profile == {"points": [1]} and record.source_path == "/again.onnx"
    assert registry.get_model(store, "mlp@v1").profile == {"points": [1]}


def test_a_name_is_its_tenant_s_so_another_user_of_the_tenant_adds_versions_and_another_tenant_may_not(
        store: Store) -> None:
    acme_alice, acme_carol = {"name": "alice", "role": "user", "tenant": "acme"}, {"name": "carol", "role": "user",
                                                                                   "tenant": "acme"}
    evil_alice = {"name": "alice", "role": "user", "tenant": "evil"}  # (a key stored before names were unique)
    registry.save_model_version(store, version("mlp", "a1"), registrant=acme_alice)

    assert registry.save_model_version(store, version("mlp", "b2"), registrant=acme_carol).owner == "acme"
    with pytest.raises(Forbidden, match="another tenant"):
        registry.save_model_version(store, version("mlp", "c3"), registrant=evil_alice)


def test_names_owned_by_a_key_s_name_move_to_its_tenant_once(store: Store) -> None:
    """Before names were their tenant's, `model-owners` held the registering key's name."""
    from broker.tenants.apikeys import create_api_key

    create_api_key(store, "alice", "user", tenant="acme")
    create_api_key(store, "solo", "user")  # a tenant of one key, named as the key
    create_api_key(store, "root", "admin")
    store.client.hset(store.keys.model_owners, mapping={"mlp": "alice", "cnn": "solo", "old": "gone-key",
                                                         "lm": "acme"})
    for name in ("mlp", "cnn", "old", "lm"):
        store.client.hset(store.keys.model_latest, name, "v1")

    assert registry.own_names_by_tenant(store) == 4
    assert store.client.hgetall(store.keys.model_owners) == {"mlp": "acme", "cnn": "solo", "lm": "acme"}
    create_api_key(store, "acme", "user", tenant="other")  # a key named like a tenant, made later
    assert registry.own_names_by_tenant(store) == 0  # once: an owner is a tenant from now on
    assert store.client.hget(store.keys.model_owners, "lm") == "acme"
    with pytest.raises(Forbidden, match="belongs to no tenant"):  # a key that is gone: admins' alone now
        registry.save_model_version(store, version("old", "v2"), registrant={"name": "x", "role": "user"})
