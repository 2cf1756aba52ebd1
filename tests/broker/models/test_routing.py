"""A/B routing decisions: groups, then the kind of call, then a sticky split; routes stored in Redis
and read again within a second. Real Redis, a fixed clock."""

from __future__ import annotations

import pytest

from broker.errors import BadInput, NotFound
from broker.models.routing import (
    Route,
    RouteTable,
    choose_version,
    delete_route,
    load_routes,
    parse_route,
    place,
    routed_ref,
    save_route,
)
from broker.state.store import Store

SPLIT = {"model": "convnet", "split": {"aaa": 0.8, "bbb": 0.2}}


def test_a_split_sends_each_share_of_users_to_its_arm_and_each_user_always_to_the_same() -> None:
    route = parse_route(SPLIT)
    chosen = [choose_version(route, user=f"user-{n}", group=None, call="v1") for n in range(4000)]

    assert abs(chosen.count("aaa") / len(chosen) - 0.8) < 0.03
    assert all(choose_version(route, user=f"user-{n}", group=None, call="v2") == chosen[n] for n in range(200))
    assert 0.0 <= place("convnet", "someone") < 1.0 and place("convnet", "a") != place("mlp", "a")


def test_a_group_rule_overrides_the_kind_of_call_which_overrides_the_split() -> None:
    route = parse_route({**SPLIT, "groups": {"beta": "bbb"}, "paths": {"jobs": "aaa"}})

    assert choose_version(route, user="u", group="beta", call="jobs") == "bbb"
    assert choose_version(route, user="u", group="other", call="jobs") == "aaa"
    assert {choose_version(route, user=f"u{n}", group=None, call="v1") for n in range(100)} == {"aaa", "bbb"}
    assert choose_version(None, user="u", group=None, call="v1") is None
    assert choose_version(parse_route({"model": "m", "groups": {"beta": "bbb"}}), user="u", group=None,
                          call="v1") is None  # no rule applies: the newest version


def test_a_weight_of_zero_gets_nobody_and_a_changed_split_moves_only_users_across_the_boundary() -> None:
    users = [f"user-{n}" for n in range(1000)]
    before = {u: choose_version(parse_route(SPLIT), user=u, group=None, call="v1") for u in users}
    after = {u: choose_version(parse_route({"model": "convnet", "split": {"aaa": 0.7, "bbb": 0.3}}), user=u,
                               group=None, call="v1") for u in users}
    only_a = parse_route({"model": "convnet", "split": {"aaa": 1.0, "bbb": 0.0}})

    assert all(after[u] == "bbb" for u in users if before[u] == "bbb")  # nobody leaves the growing arm
    assert {choose_version(only_a, user=u, group=None, call="v1") for u in users} == {"aaa"}


@pytest.mark.parametrize(("body", "says"), [
    ({"model": "convnet", "split": {"aaa": 0.8, "bbb": 0.3}}, "sum to 1"),
    ({"model": "convnet", "split": {"aaa": -0.5, "bbb": 1.5}}, "0 or more"),
    ({"model": "convnet"}, "needs a split, groups or paths"),
    ({"model": "convnet", "paths": {"v3": "aaa"}}, "paths.v3"),
    ({"model": "convnet", "split": {"aaa": 1}, "weights": {}}, "weights"),
    (["convnet"], "a JSON object"),
])
def test_an_invalid_route_is_refused_saying_what_is_wrong(body: object, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        parse_route(body)


def test_routes_are_stored_checked_against_the_registered_versions_and_deleted(store: Store) -> None:
    route = parse_route(SPLIT)
    with pytest.raises(BadInput, match="has no version bbb"):
        save_route(store, route, known_versions={"aaa"})
    save_route(store, route, known_versions={"aaa", "bbb"})

    assert load_routes(store) == {"convnet": route}
    delete_route(store, "convnet")
    assert load_routes(store) == {}
    with pytest.raises(NotFound, match="no route"):
        delete_route(store, "convnet")


def test_a_process_sees_a_changed_route_once_its_table_is_older_than_its_ttl(store: Store) -> None:
    now = [0.0]
    table = RouteTable(ttl_seconds=0.5, clock=lambda: now[0])
    everyone_to_b = Route(model="convnet", split={"bbb": 1.0})

    assert routed_ref(table, store, "convnet", user="u", group=None, call="v1") == "convnet"
    save_route(store, everyone_to_b, known_versions={"bbb"})
    now[0] = 0.4
    assert routed_ref(table, store, "convnet", user="u", group=None, call="v1") == "convnet"  # still kept
    now[0] = 0.6
    assert routed_ref(table, store, "convnet", user="u", group=None, call="v1") == "convnet@bbb"
    assert routed_ref(table, store, "convnet@aaa", user="u", group=None, call="v1") == "convnet@aaa"  # pinned
