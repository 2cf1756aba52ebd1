"""The OpenAPI document a client generator can use: valid, every answer and error typed by a named schema,
and the API's real answers valid against those schemas (so the document cannot drift from the views)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from flask.testing import FlaskClient
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from werkzeug.test import TestResponse

from broker.jobs.job_record import JobRecord
from broker.online import requests
from broker.online.records import RequestRecord
from broker.state.store import Store
from sits_api.http.bodies.jobs import Job, RequestResult
from tests.api.api_helpers import Api
from tests.leasing import lease_items

READY_ANSWERS = {"/readyz", "/v2/health/ready", "/v2/models/{name}/ready",
                 "/v2/models/{name}/versions/{version}/ready"}
"""The routes whose non-2xx answers may be their readiness rather than an `Error`."""


@pytest.fixture
def document(client: FlaskClient) -> dict[str, Any]:
    return dict(client.get("/openapi.json").get_json())


class Conformance:
    """Checks real answers against the schema the document gives their route, method and status."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.registry = Registry().with_resource("urn:sits", Resource.from_contents(
            document, default_specification=DRAFT202012))
        self.checked: set[tuple[str, str, int]] = set()

    def check(self, method: str, path: str, response: TestResponse) -> TestResponse:
        """`response`, once its JSON body is valid against the document's schema for `path` (a template)."""
        operation = self.document["paths"][path][method]
        answer = operation["responses"].get(str(response.status_code))
        assert answer is not None, f"{method.upper()} {path} answered an undocumented {response.status_code}"
        if response.status_code != 204:
            schema = answer["content"]["application/json"]["schema"]
            assert "$ref" in schema or "anyOf" in schema, f"{method.upper()} {path}: an untyped answer {schema}"
            pointer = "/".join(part.replace("~", "~0").replace("/", "~1") for part in (
                "paths", path, method, "responses", str(response.status_code), "content", "application/json", "schema"))
            validator = jsonschema.Draft202012Validator({"$ref": f"urn:sits#/{pointer}"}, registry=self.registry)
            problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                        for e in validator.iter_errors(response.get_json())]
            assert not problems, f"{method.upper()} {path} {response.status_code}: {problems[:5]}"
        self.checked.add((method, path, response.status_code))
        return response


def test_the_served_document_is_a_valid_openapi_3_1_document(document: dict[str, Any]) -> None:
    validate(document)  # openapi-spec-validator: raises on the first rule broken


def test_every_answer_and_request_body_is_a_named_schema_and_every_error_is_error(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            where = f"{method.upper()} {path}"
            assert operation["operationId"], where
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            assert body is None or body["schema"]["$ref"].rsplit("/", 1)[1] in schemas, where
            for code, answer in operation["responses"].items():
                json_body = answer.get("content", {}).get("application/json")
                if code == "204" or (path == "/metrics" and code == "200"):
                    continue
                refs = [one["$ref"] for one in json_body["schema"].get("anyOf", [json_body["schema"]])]
                assert all(ref.rsplit("/", 1)[1] in schemas for ref in refs), (where, code)
                if code >= "400" and path not in READY_ANSWERS:
                    assert refs == ["#/components/schemas/Error"], (where, code)
    assert set(schemas["Error"]["required"]) == {"error", "code"}
    assert {"inputs"} == set(schemas["InferRequest"]["required"])
    assert {"name", "shape", "datatype"} <= set(schemas["InferInput"]["required"])
    assert {"name"} == set(schemas["KeyCreation"]["required"])


def test_the_job_and_request_schemas_name_every_field_of_their_records() -> None:
    assert set(Job.model_fields) == {item.name for item in dataclasses.fields(JobRecord)} - {"extra"}
    assert set(RequestResult.model_fields) == {item.name for item in dataclasses.fields(RequestRecord)} | {
        "latency_ms"}


def test_real_answers_are_valid_against_the_document(api: Api, store: Store, document: dict[str, Any],
                                                      mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    conform = Conformance(document)
    get = lambda path, template=None, **kw: conform.check("get", template or path, api.get(path, **kw))  # noqa: E731

    job = conform.check("post", "/v1/jobs", api.post("/v1/jobs", json={
        "model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "out")})).get_json()
    get(f"/v1/jobs/{job['id']}", "/v1/jobs/{job_id}")
    get("/v1/jobs")
    get("/v1/jobs/j000000000000", "/v1/jobs/{job_id}")  # 404: an Error
    get("/v1/jobs?limit=0", "/v1/jobs")  # 400
    conform.check("delete", "/v1/jobs/{job_id}", api.delete(f"/v1/jobs/{job['id']}"))
    conform.check("post", "/v1/jobs/{job_id}/resume", api.post(f"/v1/jobs/{job['id']}/resume"))
    conform.check("get", "/v1/jobs", api.client.get("/v1/jobs"))  # 401: no key
    get("/v1/models")
    get("/v1/models/mlp", "/v1/models/{ref}")
    get(f"/v1/models/mlp@{mlp['version']}", "/v1/models/{ref}")
    for path in ("/healthz", "/readyz", "/v1/status", "/v1/policy", "/v1/routes", "/v1/tenants", "/v1/keys",
                 "/v1/usage", "/v1/usage?by=model", "/v1/schedules", "/v2", "/v2/health/live", "/v2/health/ready",
                 "/v2/models/stats"):
        get(path, path.split("?")[0])
    for template in ("/v2/models/{name}", "/v2/models/{name}/ready", "/v2/models/{name}/config",
                     "/v2/models/{name}/stats"):
        get(template.format(name="mlp"), template)
        get(template.format(name="nothing"), template)  # 404
    conform.check("put", "/v1/policy", api.put("/v1/policy", json={"alpha": 0.5}))
    conform.check("put", "/v1/routes", api.put("/v1/routes", json={"model": "mlp", "split": {mlp["version"]: 1.0}}))
    conform.check("put", "/v1/tenants/{name}", api.put("/v1/tenants/acme", json={"guaranteed_share": 0.2}))
    get("/v1/tenants/acme", "/v1/tenants/{name}")
    made = conform.check("post", "/v1/keys", api.post("/v1/keys", json={"name": "alice", "tenant": "acme"}))
    conform.check("post", "/v1/keys", api.post("/v1/keys", json={"name": "alice", "role": "root"}))  # 400
    conform.check("get", "/v1/status", api.client.get("/v1/status", headers={
        "Authorization": f"Bearer {made.get_json()['key']}"}))  # without the Redis URL
    conform.check("delete", "/v1/keys/{name}", api.delete("/v1/keys/alice"))
    conform.check("post", "/v1/sla/analysis", api.post("/v1/sla/analysis", json={
        "tasks": [{"name": "a", "period_ms": 100, "wcet_ms": 10}, {"name": "b", "period_ms": 50, "wcet_ms": 5}]}))
    schedule = {"name": "nightly", "cron": "30 17 * * *", "job": {
        "model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "nightly" / "{slot}")}}
    conform.check("post", "/v1/schedules", api.post("/v1/schedules", json=schedule))
    conform.check("post", "/v1/schedules/{name}/run", api.post("/v1/schedules/nightly/run"))
    get("/v1/schedules/nightly", "/v1/schedules/{name}")
    conform.check("post", "/v1/schedules/{name}/pause", api.post("/v1/schedules/nightly/pause"))
    get("/v1/schedules/plan?slots=2", "/v1/schedules/plan")

    queued = conform.check("post", "/v1/requests", api.post("/v1/requests", json={
        "model": "mlp", "inputs": {"features": [[0.5] * 64]}})).get_json()
    get(f"/v1/requests/{queued['id']}", "/v1/requests/{request_id}")
    ref = f"mlp@{mlp['version']}"
    answered = _answered_by_a_stand_in_worker(store, ref, lambda: api.post("/v2/models/mlp/infer", json={
        "inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}))
    conform.check("post", "/v2/models/{name}/infer", answered)
    done = _answered_by_a_stand_in_worker(store, ref, lambda: api.post(
        "/v1/requests?wait=true", json={"model": "mlp", "inputs": {"features": [[0.5] * 64]}}))
    conform.check("post", "/v1/requests", done)
    get(f"/v1/requests/{done.get_json()['id']}", "/v1/requests/{request_id}")

    assert {("post", "/v2/models/{name}/infer", 200), ("post", "/v1/requests", 200),
            ("get", "/v1/jobs/{job_id}", 200), ("get", "/v1/jobs/{job_id}", 404)} <= conform.checked


def _answered_by_a_stand_in_worker(store: Store, ref: str, send: Any) -> TestResponse:
    """`send()`'s answer, every request of `ref` completed by a thread standing in for a worker, as the v2
    conformance tests do (no worker runs in the API tests)."""
    sent = threading.Event()

    def worker() -> None:
        while not sent.is_set():
            leased = lease_items(store, ref, now=time.time(), lease_seconds=30, max_items=16)
            results = [requests.RequestResult(item, outputs={"logits": np.full((1, 10), 0.5, dtype=np.float32)})
                       for item in leased if "req" in item.payload]  # (the job's chunks wait in the same queue)
            if results:
                requests.complete_requests(store, results, now=time.time(), keep_seconds=60, batch_size=1,
                                           worker="w")
            time.sleep(0.005)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        response = send()
    finally:
        sent.set()
        thread.join(timeout=10)
    assert response.status_code == 200, response.get_json()
    return response
