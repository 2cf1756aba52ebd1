"""A/B routes through the API: `PUT /v1/routes` sends a bare model name to versions by weight (sticky per
user), by user group and by kind of call; jobs follow them unless they pin a version; a change is
seen within a second; a route is capped, and a call reads only its own model's route. Real Redis, the
Flask test client (no worker: requests are queued, not run)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import onnx
import pytest
from flask.testing import FlaskClient

from broker.models.routing import MAX_GROUPS, MAX_SPLIT_ARMS, ROUTES_TTL_SECONDS, RouteTable
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.tenancy import ab_routes
from sits_worker.model.zoo import build_model
from tests.api.api_helpers import Api, error_of

FEATURES = {"features": [[0.5] * 64]}


@pytest.fixture
def two_versions(api: Api, tmp_path: Path) -> tuple[str, str]:
    """Two versions of the zoo MLP (weights of seeds 0 and 1) registered as 'abmlp' (a name of its own:
    the API process keeps a bare name's record a moment, and other tests' 'mlp' has one version)."""
    versions = []
    for seed in (0, 1):
        path = tmp_path / f"mlp-seed{seed}.onnx"
        onnx.save(build_model("mlp", seed=seed), str(path))
        response = api.post("/v1/models", json={"name": "abmlp", "path": str(path)})
        assert response.status_code == 201, response.get_json()
        versions.append(response.get_json()["version"])
    return versions[0], versions[1]


def _version_of(api: Api, user: str | None = None, group: str | None = None, model: str = "abmlp") -> str:
    response = api.client.post("/v1/requests", json={"model": model, "inputs": FEATURES},
                               headers=api.as_user(user, group))
    assert response.status_code == 202, response.get_json()
    return response.get_json()["model_version"]


def test_a_split_sends_its_share_of_2000_requests_to_each_arm_and_each_user_always_to_one(
        api: Api, two_versions: tuple[str, str]) -> None:
    first, second = two_versions
    put = api.put("/v1/routes", json={"model": "abmlp", "split": {first: 0.8, second: 0.2}})
    assert put.status_code == 200, put.get_json()

    chosen = [_version_of(api, user=f"user-{n % 500}") for n in range(2000)]  # 500 users, 4 requests each

    assert abs(chosen.count(first) / len(chosen) - 0.8) <= 0.03
    by_user: dict[int, set[str]] = {}
    for n, version in enumerate(chosen):
        by_user.setdefault(n % 500, set()).add(version)
    assert all(len(arms) == 1 for arms in by_user.values())


def test_a_group_rule_overrides_the_split_and_a_keys_own_group_beats_the_header(
        api: Api, client: FlaskClient, store: Store, two_versions: tuple[str, str]) -> None:
    first, second = two_versions
    assert api.put("/v1/routes", json={"model": "abmlp", "split": {first: 1.0},
                                       "groups": {"beta": second}}).status_code == 200
    tester = Api(client, create_api_key(store, "tester", "user", group="beta"))
    outsider = Api(client, create_api_key(store, "outsider", "user", group="stable"))

    assert _version_of(api, user="u1") == first
    assert _version_of(api, user="u1", group="beta") == second
    assert _version_of(tester) == second
    assert _version_of(outsider, group="beta") == first  # its key's group, not the header, counts
    assert _version_of(api, user="u1", model=f"abmlp@{first}") == first  # a pinned version is never routed


def test_jobs_follow_the_route_for_jobs_unless_they_pin_a_version(
        api: Api, two_versions: tuple[str, str], mlp_input: Path, tmp_path: Path) -> None:
    first, second = two_versions
    assert api.put("/v1/routes", json={"model": "abmlp", "split": {first: 1.0},
                                       "paths": {"jobs": second}}).status_code == 200

    def job_version(model: str, folder: str) -> str:
        response = api.post("/v1/jobs", json={"model": model, "input_batch": str(mlp_input),
                                              "output_dir": str(tmp_path / folder)})
        assert response.status_code == 201, response.get_json()
        return response.get_json()["model_version"]

    assert job_version("abmlp", "routed") == second
    assert job_version(f"abmlp@{first}", "pinned") == first
    assert _version_of(api, user="u") == first  # the jobs rule is not the requests'


def test_a_changed_route_is_seen_within_a_second_and_a_deleted_one_leaves_the_newest_version(
        api: Api, two_versions: tuple[str, str]) -> None:
    first, second = two_versions
    assert api.put("/v1/routes", json={"model": "abmlp", "split": {first: 1.0}}).status_code == 200
    time.sleep(ROUTES_TTL_SECONDS + 0.1)
    assert _version_of(api, user="u") == first

    assert api.put("/v1/routes", json={"model": "abmlp", "split": {second: 1.0}}).status_code == 200
    time.sleep(ROUTES_TTL_SECONDS + 0.1)
    assert _version_of(api, user="u") == second
    assert api.get("/v1/routes").get_json() == {"routes": [{"model": "abmlp", "split": {second: 1.0}, "groups": {},
                                                             "paths": {}}]}

    assert api.delete("/v1/routes/abmlp").status_code == 204
    time.sleep(ROUTES_TTL_SECONDS + 0.1)
    assert _version_of(api, user="u") == second  # the newest registered
    assert api.delete("/v1/routes/abmlp").status_code == 404


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"model": "abmlp", "split": {"nope": 1.0}}, 400, "has no version nope"),
    ({"model": "ghost", "split": {"abc": 1.0}}, 404, "not registered"),
    ({"model": "abmlp", "split": {"a": 0.5}}, 400, "sum to 1"),
    ({"model": "abmlp"}, 400, "needs a split, groups or paths"),
])
def test_a_bad_route_is_refused_saying_what_to_fix(api: Api, two_versions: tuple[str, str], body: dict[str, Any],
                                                   status: int, says: str) -> None:
    response = api.put("/v1/routes", json=body)

    assert response.status_code == status and says in error_of(response)


def test_only_admins_change_routes_and_a_bad_group_header_is_a_400(
        api: Api, client: FlaskClient, store: Store, two_versions: tuple[str, str]) -> None:
    user = Api(client, create_api_key(store, "someone", "user"))
    first, _ = two_versions

    assert user.put("/v1/routes", json={"model": "abmlp", "split": {first: 1.0}}).status_code == 403
    assert user.get("/v1/routes").status_code == 403
    response = client.post("/v1/requests", json={"model": "abmlp", "inputs": FEATURES},
                           headers=user.as_user(group="no spaces"))
    assert response.status_code == 400 and "X-SITS-Group" in error_of(response)


def test_a_route_past_its_caps_is_a_400_naming_the_field_and_the_cap_and_nothing_is_stored(
        api: Api, store: Store, two_versions: tuple[str, str]) -> None:
    first, _ = two_versions
    too_many = {f"group{n}": first for n in range(MAX_GROUPS + 1)}
    arms = {f"{first}{n}": 1 / (MAX_SPLIT_ARMS + 1) for n in range(MAX_SPLIT_ARMS + 1)}

    for body, says in [({"model": "abmlp", "groups": too_many}, f"groups: Value error, a route names {MAX_GROUPS}"),
                       ({"model": "abmlp", "groups": {"no spaces": first}}, "group 'no spaces' must be letters"),
                       ({"model": "abmlp", "split": arms}, f"split: Value error, a split weighs {MAX_SPLIT_ARMS}")]:
        response = api.put("/v1/routes", json=body)
        assert response.status_code == 400 and says in error_of(response), error_of(response)
    assert store.client.hlen(store.keys.routes) == 0
    assert api.put("/v1/routes", json={"model": "abmlp", "groups": dict(list(too_many.items())[:MAX_GROUPS])}
                   ).status_code == 200  # the cap itself is fine


def test_a_bare_name_call_reads_only_its_own_route_not_the_other_tenants(
        api: Api, store: Store, two_versions: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = two_versions
    others = {f"evil{n}": json.dumps({"model": f"evil{n}", "groups": {f"g{k:063d}": "v" for k in range(MAX_GROUPS)}})
              for n in range(20)}
    store.client.hset(store.keys.routes, mapping=others)  # (as if PUT by other tenants, at the caps)
    assert api.put("/v1/routes", json={"model": "abmlp", "split": {second: 1.0}}).status_code == 200
    client, sent = store.client, []  # (the test client serves in this thread: its Redis client is this one)
    send = client.execute_command

    def counted(*args: Any, **options: Any) -> Any:
        sent.append(args)
        return send(*args, **options)

    monkeypatch.setattr(client, "execute_command", counted)
    monkeypatch.setattr(ab_routes, "_TABLE", RouteTable(clock=lambda: 0.0))  # (no re-read however slow the calls)
    assert {_version_of(api, user=f"u{n}") for n in range(20)} == {second}

    on_routes = [args for args in sent if store.keys.routes in args]
    assert on_routes == [("HSTRLEN", store.keys.routes, "abmlp"), ("HGET", store.keys.routes, "abmlp")]


def test_a_route_stored_over_the_size_cap_before_it_is_not_followed_and_is_deleted(
        api: Api, store: Store, two_versions: tuple[str, str]) -> None:
    first, second = two_versions
    huge = {"model": "abmlp", "groups": {f"g{n}": first for n in range(20_000)}}  # about 600 KiB, as stored once
    store.client.hset(store.keys.routes, "abmlp", json.dumps(huge))

    assert _version_of(api, user="u") == second  # (not followed: the newest, as without a route)
    assert _version_of(api, user="u", model=f"abmlp@{first}") == first  # a pinned version still runs
    assert api.get("/v1/routes").get_json() == {"routes": []}
    assert api.delete("/v1/routes/abmlp").status_code == 204
    assert _version_of(api, user="u") == second  # the newest again, at once in this process
