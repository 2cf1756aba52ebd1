"""A/B routing decisions: groups, then the kind of call, then a sticky split; routes stored in Redis
and read again within a second, each call reading only its own model's route, bounded by the caps.
Real Redis (its commands counted where the cost is the point), a fixed clock."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from broker.errors import BadInput, NotFound
from broker.models.routing import (
    MAX_GROUPS,
    MAX_ROUTE_BYTES,
    MAX_SPLIT_ARMS,
    MAX_VERSION_CHARS,
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


def _counting(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every command this thread's client sends from now on (the real client sends it: Redis answers)."""
    client, sent = store.client, []
    send = client.execute_command

    def counted(*args: Any, **options: Any) -> Any:
        sent.append(args)
        return send(*args, **options)

    monkeypatch.setattr(client, "execute_command", counted)
    return sent


def _groups(count: int, version: str = "aaa") -> dict[str, str]:
    return {f"g{n:063d}": version for n in range(count)}


@pytest.mark.parametrize(("body", "says"), [
    ({"model": "m", "groups": _groups(MAX_GROUPS + 1)}, f"groups: .*{MAX_GROUPS} user groups at most, got 257"),
    ({"model": "m", "groups": {"no spaces": "aaa"}}, "groups: .*group 'no spaces' must be letters"),
    ({"model": "m", "groups": {"g" * 65: "aaa"}}, "groups: .*64 at most"),
    ({"model": "m", "split": {f"v{n}": 1 / 33 for n in range(33)}}, f"split: .*{MAX_SPLIT_ARMS} versions at most"),
    ({"model": "m", "paths": {"v1": "v" * (MAX_VERSION_CHARS + 1)}}, f"paths.v1: .*at most {MAX_VERSION_CHARS}"),
])
def test_a_route_past_its_caps_is_refused_naming_the_field_and_the_cap(body: dict[str, Any], says: str) -> None:
    with pytest.raises(BadInput, match=says):
        parse_route(body)
    assert parse_route({"model": "m", "groups": _groups(MAX_GROUPS)}).groups  # the cap itself is fine


def test_a_route_over_its_stored_size_is_refused_before_it_is_written(store: Store) -> None:
    wide = "é" * MAX_VERSION_CHARS  # (2 bytes a letter: within every count, not within the bytes)
    route = parse_route({"model": "m", "groups": _groups(MAX_GROUPS, wide)})

    with pytest.raises(BadInput, match=f"over the {MAX_ROUTE_BYTES} a route may"):
        save_route(store, route, known_versions={wide})
    assert store.client.hlen(store.keys.routes) == 0


def test_a_call_reads_only_its_own_models_route_once_per_ttl_however_many_others_are_stored(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in range(50):  # other tenants' routes, each at the caps
        save_route(store, parse_route({"model": f"evil{n}", "groups": _groups(MAX_GROUPS)}), known_versions={"aaa"})
    save_route(store, Route(model="mlp", split={"bbb": 1.0}), known_versions={"bbb"})
    now = [0.0]
    table = RouteTable(ttl_seconds=0.5, clock=lambda: now[0])
    sent = _counting(store, monkeypatch)

    assert [routed_ref(table, store, "mlp", user=f"u{n}", group=None, call="v1") for n in range(100)] == \
        ["mlp@bbb"] * 100
    assert sent == [("HSTRLEN", store.keys.routes, "mlp"), ("HGET", store.keys.routes, "mlp")]
    now[0] = 0.6
    assert routed_ref(table, store, "mlp", user="u", group=None, call="v1") == "mlp@bbb"
    assert [args[0] for args in sent] == ["HSTRLEN", "HGET"] * 2 and all(args[2] == "mlp" for args in sent)
    assert routed_ref(table, store, "x" * 10_000, user="u", group=None, call="v1") == "x" * 10_000
    assert len(sent) == 4  # a name no route may have is not looked up


def test_no_lock_is_held_while_a_route_is_read_so_a_slow_read_holds_up_no_other_call(store: Store) -> None:
    save_route(store, Route(model="fast", split={"aaa": 1.0}), known_versions={"aaa"})
    now = [0.0]
    table = RouteTable(ttl_seconds=0.5, clock=lambda: now[0])
    assert table.route(store, "fast") is not None
    now[0] = 1.0  # both routes are due to be read again
    reading, release, fast_done = threading.Event(), threading.Event(), threading.Event()

    def slow_call() -> None:
        client, send = store.client, store.client.execute_command

        def held_up(*args: Any, **options: Any) -> Any:
            reading.set()
            release.wait(30)
            return send(*args, **options)

        client.execute_command = held_up  # (this thread's own client: the other thread's is untouched)
        table.route(store, "slow")

    def fast_call() -> None:
        table.route(store, "fast")
        fast_done.set()

    slow = threading.Thread(target=slow_call)
    slow.start()
    try:
        assert reading.wait(30)
        fast = threading.Thread(target=fast_call)
        fast.start()
        assert fast_done.wait(30), "a call of another model waited for the slow read"
    finally:
        release.set()
        slow.join(30)


def test_a_route_stored_before_the_caps_is_followed_under_its_size_and_ignored_unread_over_it(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    old = {"model": "old", "groups": _groups(MAX_GROUPS + 44)}  # past today's cap, under the stored size
    huge = {"model": "huge", "groups": {f"g{n}": "aaa" for n in range(20_000)}}  # about 300 KiB
    store.client.hset(store.keys.routes, mapping={"old": json.dumps(old), "huge": json.dumps(huge)})
    table = RouteTable()
    sent = _counting(store, monkeypatch)

    assert routed_ref(table, store, "old", user="u", group=f"g{7:063d}", call="v1") == "old@aaa"
    assert table.route(store, "huge") is None  # (not followed: its name goes to its newest version)
    assert table.route(store, "huge") is None  # kept as not followed: not asked again within the ttl
    assert ("HGET", store.keys.routes, "huge") not in sent and len(sent) == 3
    assert set(load_routes(store)) == {"old"}  # a listing leaves it out, unread


def test_a_table_keeps_at_most_its_count_of_names_and_forgets_one_model_at_a_time(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    table = RouteTable(max_models=10)
    save_route(store, Route(model="a", split={"x": 1.0}), known_versions={"x"})
    for n in range(100):  # bare names are the callers' to choose
        table.route(store, f"name{n}")
    table.route(store, "a")
    save_route(store, Route(model="a", split={"y": 1.0}), known_versions={"y"})
    table.forget(store, "a")
    sent = _counting(store, monkeypatch)

    assert table.route(store, "a") == Route(model="a", split={"y": 1.0})
    assert table.route(store, "name99") is None and len(sent) == 2  # the other names stay kept
    assert table.route(store, "name0") is None and len(sent) == 3  # let go (asked again: an HSTRLEN of 0)
