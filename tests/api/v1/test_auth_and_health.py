"""Bearer-key auth, the public health and OpenAPI endpoints, and GET /v1/status."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.config.settings import Settings
from broker.queueing import workers
from broker.state.embedded import free_port
from broker.state.keys import Keys
from broker.state.store import Store
from sits_api.app import create_app
from tests.api.api_helpers import Api, error_of

# --- auth -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/status", "/v1/models", "/v1/jobs", "/v1/jobs/jx", "/v1/models/mlp"])
def test_a_request_without_a_key_answers_401_saying_how_to_send_one(client: FlaskClient, path: str) -> None:
    response = client.get(path)

    assert response.status_code == 401
    assert "Authorization: Bearer <key>" in error_of(response)
    assert response.get_json()["code"] == "unauthorized"


def test_a_post_without_a_key_answers_401_before_the_body_is_read(client: FlaskClient) -> None:
    response = client.post("/v1/jobs", data="{not json", content_type="application/json")

    assert response.status_code == 401


def test_a_wrong_key_answers_401_saying_where_keys_come_from(client: FlaskClient, admin_key: str) -> None:
    response = client.get("/v1/status", headers={"Authorization": "Bearer sits_not-a-real-key"})

    assert response.status_code == 401
    assert "unknown API key" in error_of(response) and "SITS_API_KEY" in error_of(response)


def test_a_key_whose_record_is_damaged_answers_401_not_500(client: FlaskClient, store: Store) -> None:
    from broker.tenants.apikeys import _digest

    store.client.hset(store.keys.api_keys, _digest("sits_damaged"), "not json")
    response = client.get("/v1/status", headers={"Authorization": "Bearer sits_damaged"})

    assert response.status_code == 401 and "damaged" in error_of(response)


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer ", "Token sits_x"])
def test_a_header_that_is_not_a_bearer_key_answers_401(client: FlaskClient, header: str) -> None:
    response = client.get("/v1/status", headers={"Authorization": header})

    assert response.status_code == 401
    assert "missing API key" in error_of(response)


def test_a_valid_key_is_accepted(api: Api) -> None:
    assert api.get("/v1/status").status_code == 200


def test_the_bearer_scheme_is_case_insensitive(client: FlaskClient, admin_key: str) -> None:
    response = client.get("/v1/status", headers={"Authorization": f"bearer {admin_key}"})

    assert response.status_code == 200, error_of(response)


# --- health and OpenAPI ----------------------------------------------------------------------


def test_healthz_needs_no_key(client: FlaskClient) -> None:
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.get_json() == {"status": "ok"}


def test_readyz_needs_no_key_and_counts_live_workers(client: FlaskClient, store: Store) -> None:
    workers.record_heartbeat(store, "w-alive", {"streams": 1}, now=time.time())
    workers.record_heartbeat(store, "w-stale", {"streams": 1}, now=time.time() - 60)

    response = client.get("/readyz")

    assert response.status_code == 200
    assert response.get_json() == {"status": "ready", "workers_alive": 1}


@pytest.fixture
def unreachable_redis_app(settings: Settings) -> Flask:
    """The app over a Redis port where nothing listens."""
    client = redis.Redis(host="127.0.0.1", port=free_port(), decode_responses=True, socket_connect_timeout=1,
                         retry=Retry(NoBackoff(), 0))  # fail at once instead of redis-py's backoff retries
    return create_app(settings, store=Store(client=client, keys=Keys(prefix="gone")))


def test_readyz_answers_503_when_redis_is_unreachable(unreachable_redis_app: Flask) -> None:
    response = unreachable_redis_app.test_client().get("/readyz")

    assert response.status_code == 503
    assert response.get_json()["status"] == "unavailable"
    assert response.get_json()["error"]


def test_an_authenticated_request_answers_503_not_500_when_redis_is_unreachable(
        unreachable_redis_app: Flask) -> None:
    response = unreachable_redis_app.test_client().get("/v1/status", headers={"Authorization": "Bearer sits_x"})

    assert response.status_code == 503
    assert response.get_json()["code"] == "connection_lost"


def test_a_write_refused_by_a_full_redis_answers_503_saying_so_not_500(
        api: Api, store: Store, mlp: dict[str, Any]) -> None:
    store.client.config_set("maxmemory", "1")  # Redis holds more than that already: every write is refused
    try:
        request = api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": [[0.0] * 64]}})
        status = api.get("/v1/status")
    finally:
        store.client.config_set("maxmemory", "0")

    assert request.status_code == 503 and request.get_json()["code"] == "store_full", request.get_json()
    assert "Redis is full" in error_of(request)
    assert status.status_code == 200  # reads go on


def test_openapi_json_needs_no_key_and_is_an_openapi_3_1_document(client: FlaskClient) -> None:
    response = client.get("/openapi.json")

    assert response.status_code == 200
    document = response.get_json()
    assert document["openapi"] == "3.1.0"
    assert document["info"]["title"] and document["info"]["version"]
    assert {"/v1/jobs", "/v1/models", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/resume", "/v1/models/{ref}",
            "/v1/status", "/healthz", "/readyz"} <= set(document["paths"])
    assert document["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    keyed = [operation for operations in document["paths"].values() for operation in operations.values()
             if operation.get("security") != []]
    assert keyed and all("403" in operation["responses"] for operation in keyed)  # (a metrics key reads /metrics only)
    submission_ref = document["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    submission = document["components"]["schemas"][submission_ref["$ref"].rsplit("/", 1)[1]]
    assert {"model", "input_batch", "output_dir"} <= set(submission["required"])
    assert submission["properties"]["priority"]["maximum"] == 15


def test_openapi_operations_are_well_formed(client: FlaskClient) -> None:
    # (tests/api/test_openapi_document.py validates the whole document with openapi-spec-validator)
    document = client.get("/openapi.json").get_json()
    for path, item in document["paths"].items():
        assert path.startswith("/")
        templated = set(re.findall(r"{(\w+)}", path))
        for method, operation in item.items():
            assert method in {"get", "post", "put", "patch", "delete"}, (path, method)
            assert operation["responses"], (path, method)
            for code, answer in operation["responses"].items():
                assert re.fullmatch(r"[1-5]\d\d", code) and answer["description"], (path, method, code)
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert declared == templated, (path, method)
            assert all(p["required"] for p in operation.get("parameters", []) if p["in"] == "path")


def test_every_api_route_is_documented_with_its_methods(app: Flask, client: FlaskClient) -> None:
    document = client.get("/openapi.json").get_json()
    for rule in app.url_map.iter_rules():
        if rule.endpoint in ("static", "health.openapi"):
            continue
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        assert path in document["paths"], path
        methods = {m.lower() for m in rule.methods or ()} - {"head", "options"}
        assert methods <= set(document["paths"][path]), (path, methods)


def test_public_endpoints_are_marked_without_security(client: FlaskClient) -> None:
    paths = client.get("/openapi.json").get_json()["paths"]

    assert paths["/healthz"]["get"]["security"] == []
    assert paths["/readyz"]["get"]["security"] == []
    assert paths["/v2"]["get"]["security"] == [] and paths["/v2/health/live"]["get"]["security"] == []
    assert "security" not in paths["/v1/jobs"]["post"]  # the document-wide bearer requirement applies


def test_an_unknown_route_answers_a_json_404_naming_the_path(api: Api) -> None:
    response = api.get("/v2/nothing")

    assert response.status_code == 404
    assert error_of(response).startswith("no API route for GET /v2/nothing:")
    assert response.get_json()["code"] == "not_found"


def test_an_id_holding_a_slash_is_told_that_ids_are_one_path_segment(api: Api) -> None:
    response = api.get("/v1/jobs/a%2Fb")  # decoded before routing: /v1/jobs/a/b matches no route

    assert response.status_code == 404
    assert "no API route for GET /v1/jobs/a/b" in error_of(response) and "one path segment" in error_of(response)


def test_a_wrong_method_answers_a_json_405_naming_the_methods_the_path_takes(api: Api) -> None:
    response = api.client.put("/v1/jobs", headers=api.headers, json={})

    assert response.status_code == 405
    assert error_of(response) == "/v1/jobs does not take PUT; it takes GET, POST"
    assert response.headers["Allow"] == "GET, POST"


# --- status -------------------------------------------------------------------------------


def test_status_shows_workers_queues_and_jobs_by_status(
        api: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    workers.record_heartbeat(store, "w1", {"device": "cpu", "streams": 2}, now=time.time())
    job = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                     "output_dir": str(tmp_path / "out"), "chunk_size": 4}).get_json()

    response = api.get("/v1/status")

    assert response.status_code == 200
    status = response.get_json()
    assert [(w["name"], w["alive"], w["device"]) for w in status["workers"]] == [("w1", True, "cpu")]
    assert status["queues"] == {mlp["ref"]: {"ready": 3, "inflight": 0}}
    assert status["jobs"] == {"queued": 1}
    assert status["tickets"] == 2  # one batch ticket per live stream slot
    assert status["policy"] == "graph-aware-backfill"

    api.delete(f"/v1/jobs/{job['id']}")
    after = api.get("/v1/status").get_json()
    assert after["jobs"] == {"cancelled": 1}
    assert after["queues"][mlp["ref"]]["ready"] == 0


def test_status_of_an_empty_system_lists_nothing(api: Api) -> None:
    status = api.get("/v1/status").get_json()

    assert status["workers"] == [] and status["queues"] == {} and status["jobs"] == {}


def test_the_policy_body_is_documented_with_every_key_and_range_the_server_accepts(client: FlaskClient) -> None:
    from dataclasses import fields

    from broker.queueing.policy import ORDERINGS, POLICY_RANGES
    from broker.queueing.scoring import Weights

    document = client.get("/openapi.json").get_json()
    ref = document["paths"]["/v1/policy"]["put"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]

    assert set(schema["properties"]) == {field.name for field in fields(Weights)} | {"ordering"}
    assert schema["properties"]["ordering"]["enum"] == list(ORDERINGS) and schema["additionalProperties"] is False
    for name, (low, high) in POLICY_RANGES.items():
        assert (schema["properties"][name]["minimum"], schema["properties"][name]["maximum"]) == (low, high)
    assert schema["properties"]["express_level"]["type"] == "integer"
    assert schema["properties"]["alpha"]["type"] == "number"
