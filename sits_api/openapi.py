"""The OpenAPI 3.1 document of the REST API, with request schemas taken from the pydantic models."""

from __future__ import annotations

from typing import Any

from broker.models.routing import Route
from broker.queueing.policy import ORDERINGS, POLICY_RANGES
from broker.queueing.scoring import Weights
from broker.sla.task_sets import TaskSet
from broker.tenants.settings import Tenant
from sits_api.schedules.bodies import PlanAsk, SchedulePatch, ScheduleSubmission
from sits_api.schemas import MAX_JOBS_LISTED, JobSubmission, ModelRegistration, OnlineRequest

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}, "code": {"type": "string"}}}


def _responses(*codes: int, ok: str = "OK") -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for code in codes:
        if code < 400:
            responses[str(code)] = {"description": ok, "content": {"application/json": {"schema": {"type": "object"}}}}
        else:
            responses[str(code)] = {"description": "error", "content": {"application/json": {"schema": _ERROR}}}
    return responses


def _body(model: type) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}  # type: ignore[attr-defined]


def openapi_document() -> dict[str, Any]:
    """The document served at `/openapi.json`."""
    job_id = [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    model_ref = [{"name": "ref", "in": "path", "required": True, "schema": {"type": "string"},
                  "description": "name or name@version"}]
    def path_params(*names: str) -> list[dict[str, Any]]:
        return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names]

    task_set = TaskSet.model_json_schema(ref_template="#/components/schemas/{model}")
    shared_schemas = task_set.pop("$defs", {})
    binary = {"schema": {"type": "string", "format": "binary"}}
    owned = ("A user key sees only what it submitted: another key's answers 404, as an unknown id does; "
             "an admin key sees everything.")
    header_length = {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                     "schema": {"type": "integer", "minimum": 0},
                     "description": "Triton's binary tensor data extension: the byte length of the JSON at the "
                                    "start of the body (binary tensors follow it); without it the body is JSON"}
    # 429: a full queue, 503: the model's breakers open on every worker (docs/failures.md); both with Retry-After
    v2_infer_responses = _responses(200, 400, 401, 404, 413, 415, 429, 503, 504)
    v2_infer_responses["200"]["content"]["application/octet-stream"] = binary
    v2_infer = {"summary": "Open Inference Protocol (KServe v2) inference; parameters.priority, .timeout (us)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}},
                                                              "application/octet-stream": binary},
                                "description": "v2 JSON or, in Triton's binary tensor data extension, the JSON "
                                               "(its byte length in header Inference-Header-Content-Length) "
                                               "followed by the binary tensors' bytes"},
                "responses": v2_infer_responses}
    v2_config = {"summary": "Triton model configuration (max_batch_size, input/output dims, dynamic_batching)",
                 "responses": _responses(200, 400, 401, 404)}
    v2_stats = {"summary": "Triton's statistics extension: online request counts and times (ns) per model "
                           "version; metrics keys and admins",
                "responses": _responses(200, 400, 401, 403, 404)}
    v2_paths: dict[str, Any] = {
        "/v2/models/stats": {"get": v2_stats},
        "/v2/models/{name}/stats": {"get": v2_stats | {"parameters": path_params("name")}},
        "/v2/models/{name}/versions/{version}/stats": {"get": v2_stats | {"parameters": path_params("name",
                                                                                                   "version")}},
        "/v2": {"get": {"summary": "v2 server metadata: name, version, the Triton extensions implemented",
                        "security": [], "responses": _responses(200)}},
        "/v2/health/live": {"get": {"summary": "v2 liveness", "security": [], "responses": _responses(200)}},
        "/v2/health/ready": {"get": {"summary": "v2 readiness", "security": [], "responses": _responses(200, 503)}},
        "/v2/models/{name}": {"get": {"summary": "v2 model metadata", "parameters": path_params("name"),
                                      "responses": _responses(200, 400, 401, 404)}},
        "/v2/models/{name}/versions/{version}": {"get": {"summary": "v2 model metadata of one version",
                                                         "parameters": path_params("name", "version"),
                                                         "responses": _responses(200, 400, 401, 404)}},
        "/v2/models/{name}/ready": {"get": {"summary": "v2 model readiness: 400 while no worker is alive",
                                            "parameters": path_params("name"),
                                            "responses": _responses(200, 400, 401, 404)}},
        "/v2/models/{name}/versions/{version}/ready": {
            "get": {"summary": "v2 readiness of one version", "parameters": path_params("name", "version"),
                    "responses": _responses(200, 400, 401, 404)}},
        "/v2/models/{name}/config": {"get": v2_config | {"parameters": path_params("name")}},
        "/v2/models/{name}/versions/{version}/config": {"get": v2_config | {"parameters": path_params("name",
                                                                                                      "version")}},
        "/v2/models/{name}/infer": {"post": v2_infer | {"parameters": [*path_params("name"), header_length]}},
        "/v2/models/{name}/versions/{version}/infer": {
            "post": v2_infer | {"parameters": [*path_params("name", "version"), header_length]}},
    }
    return _with_common_errors({
        "openapi": "3.1.0",
        "info": {"title": "SITS", "version": "1",
                 "description": "Scalable Inference Task Scheduler. Request bodies may be sent with "
                                "Content-Encoding gzip or deflate (415 for any other), within "
                                "api.max_body_bytes once decompressed (413)."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": shared_schemas},
        "security": [{"bearer": []}],
        "paths": {
            "/healthz": {"get": {"summary": "liveness", "security": [], "responses": _responses(200)}},
            "/readyz": {"get": {"summary": "readiness (Redis reachable)", "security": [],
                                "responses": _responses(200, 503)}},
            "/v1/status": {"get": {"summary": "workers, queues, jobs by status", "responses": _responses(200, 401)}},
            "/metrics": {"get": {"summary": "Prometheus metrics: queues, workers, memory, jobs by status, requests "
                                            "and job rows served (counts only; a metrics or admin key)",
                                 "responses": {"200": {"description": "Prometheus text exposition (OpenMetrics "
                                                                      "when the Accept header asks for it)",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}},
                                               **_responses(401, 403, 503)}}},
            "/v1/models": {
                "get": {"summary": "list model versions; owner and file paths (path, source_path): to the "
                                   "keys that own the name and admins, null to other keys",
                        "responses": _responses(200, 401)},
                "post": {"summary": "register a model", "requestBody": _body(ModelRegistration),
                         "description": "A new name becomes the tenant's (the key's name), or no tenant's when "
                                        "the key is an admin; a version under another tenant's name is a 403, "
                                        "as is one under a name no tenant owns (an admin key's, or registered "
                                        "before names had owners) unless the key is an admin. Also 403: a "
                                        "path outside the model roots. The registration runs off the request "
                                        "threads: done within models.registration_wait, a 201 with the version; "
                                        "else a 202 with a registration id to poll.",
                         "responses": _responses(201, 202, 400, 401, 403, 404, 413, 422, 429)},
            },
            "/v1/models/registrations/{registration_id}": {
                "get": {"summary": "a registration that answered 202: running, registered (with the version) or "
                                   "failed (with its error); the caller's own",
                        "parameters": path_params("registration_id"), "responses": _responses(200, 401, 404)}},
            "/v1/models/{ref}": {"get": {"summary": "one model", "parameters": model_ref,
                                         "responses": _responses(200, 400, 401, 404)}},
            "/v1/jobs": {
                "get": {"summary": "list jobs: a user key its own, an admin key all (or one owner's)",
                        "responses": _responses(200, 400, 401, 403),
                        "parameters": [{"name": "status", "in": "query", "schema": {"type": "string"}},
                                       {"name": "limit", "in": "query",
                                        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_JOBS_LISTED}},
                                       {"name": "owner", "in": "query", "schema": {"type": "string"},
                                        "description": "key name whose jobs to list; a user key may "
                                                       "name only itself (403 otherwise)"}]},
                "post": {"summary": "submit an offline job", "requestBody": _body(JobSubmission),
                         "description": "409 while an active job holds output_dir (named only to a key that "
                                        "may see it) or when it holds a finished job's results.",
                         "responses": _responses(201, 400, 401, 403, 404, 409, 413, 415)},
            },
            "/v1/jobs/{job_id}": {
                "get": {"summary": "job status and progress", "description": owned, "parameters": job_id,
                        "responses": _responses(200, 401, 404)},
                "delete": {"summary": "cancel a job", "description": owned, "parameters": job_id,
                           "responses": _responses(200, 401, 404)},
            },
            "/v1/requests": {
                "post": {"summary": "one online inference request (202, or 200 with the result when waiting)",
                         "requestBody": _body(OnlineRequest),
                         "parameters": [{"name": "wait", "in": "query", "schema": {"type": "boolean"}}],
                         "responses": _responses(200, 202, 400, 401, 404, 413, 415, 429, 503)},
            },
            "/v1/requests/{request_id}": {
                "get": {"summary": "a request's status and outputs", "description": owned,
                        "parameters": [{"name": "request_id", "in": "path", "required": True,
                                        "schema": {"type": "string"}}],
                        "responses": _responses(200, 401, 404)},
            },
            "/v1/policy": {
                "get": {"summary": "the live scoring weights and queue ordering", "responses": _responses(200, 401)},
                "put": {"summary": "admin: hot-update weights/ordering; waiting items are re-scored in slices",
                        "requestBody": {"required": True,
                                        "content": {"application/json": {"schema": _policy_schema()}}},
                        "responses": _responses(200, 400, 401, 403)},
            },
            "/v1/routes": {
                "get": {"summary": "admin: the A/B routes of bare model names (tenant-admin: its tenant's)",
                        "responses": _responses(200, 401, 403)},
                "put": {"summary": "admin, or tenant-admin for its tenant's model names: set a model's A/B route "
                                   "(split by weight, groups, kinds of call)",
                        "requestBody": {"required": True,
                                        "content": {"application/json": {"schema": Route.model_json_schema()}}},
                        "responses": _responses(200, 400, 401, 403, 404)},
            },
            "/v1/routes/{model}": {
                "delete": {"summary": "admin, or tenant-admin for its tenant's model names: remove a model's route",
                           "parameters": path_params("model"),
                           "responses": _responses(204, 401, 403, 404)},
            },
            "/v1/tenants": {
                "get": {"summary": "admin: every tenant with its share, limit and quotas",
                        "responses": _responses(200, 401, 403)},
            },
            "/v1/tenants/{name}": {
                "get": {"summary": "a tenant's record (admins, and its own tenant's keys)",
                        "parameters": path_params("name"), "responses": _responses(200, 401, 403, 404)},
                "put": {"summary": "admin: create or replace a tenant (shares sum to at most 1)",
                        "parameters": path_params("name"),
                        "requestBody": {"required": True,
                                        "content": {"application/json": {"schema": Tenant.model_json_schema()}}},
                        "responses": _responses(200, 400, 401, 403, 409)},
                "delete": {"summary": "admin: remove a tenant's record (its keys keep working, with no share)",
                           "parameters": path_params("name"), "responses": _responses(204, 401, 403, 404, 409)},
            },
            "/v1/keys": {
                "post": {"summary": "admin or tenant-admin: make an API key (answered once); a tenant admin only "
                                    "of its own tenant, as tenant-admin, user or viewer",
                         "responses": _responses(201, 400, 401, 403)},
                "get": {"summary": "admin: every key's name, role, tenant and group; tenant-admin: its tenant's",
                        "responses": _responses(200, 401, 403)},
            },
            "/v1/keys/{name}": {
                "delete": {"summary": "admin or tenant-admin: delete the keys of that name (within 5 s)",
                           "parameters": path_params("name"), "responses": _responses(200, 401, 403, 404)},
            },
            "/v1/usage": {
                "get": {"summary": "chargeback: device-seconds, rows, requests, jobs, queue time and cost per tenant",
                        "description": "Query: tenant, from and to (UTC dates, YYYY-MM-DD), by (model, key or day). "
                                       "A non-admin key sees only its own tenant.",
                        "responses": _responses(200, 400, 401, 403)},
            },
            "/v1/sla/analysis": {
                "post": {"summary": "schedulability of a periodic task set: utilisation and the Liu-Layland "
                                    "bound, each task's response time, feasible or not",
                         "requestBody": {"required": True, "content": {"application/json": {"schema": task_set}}},
                         "description": "A task's wcet_ms is given, or derived from a model's measured profile "
                                        "(P99 per mini-batch) and rows: 404 for an unknown model, 409 for one "
                                        "without a measured profile or profiled on another device kind.",
                         "responses": _responses(200, 400, 401, 404, 409)},
            },
            **_schedule_paths(path_params("name")),
            "/v1/jobs/{job_id}/resume": {
                "post": {"summary": "re-queue the unfinished chunks", "description": owned, "parameters": job_id,
                         "responses": _responses(202, 400, 401, 404, 409)},
            },
            **v2_paths,
        },
    })


def _plan_params() -> list[dict[str, Any]]:
    """The query parameters of `GET /v1/schedules/plan`: the fields of `PlanAsk`."""
    schema = PlanAsk.model_json_schema()["properties"]
    return [{"name": name, "in": "query", "required": False, "description": field.get("description", ""),
             "schema": {"type": "integer" if name == "slots" else "string"}} for name, field in schema.items()]


def _schedule_paths(name: list[dict[str, Any]]) -> dict[str, Any]:
    """`/v1/schedules` (docs/schedules.md): a schedule is named within the caller's tenant; an admin key names
    another tenant's with `?tenant=`."""
    tenant = [{"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"},
               "description": "admin keys: the tenant whose schedule to address (default the key's own)"}]
    steer = "Another tenant's schedule answers 404, as a missing one does; a viewer key's change, 403."
    return {
        "/v1/schedules": {
            "get": {"summary": "the schedules the key may read (a user key its own; an admin key every tenant's, "
                               "or ?tenant='s)", "parameters": tenant, "responses": _responses(200, 400, 401)},
            "post": {"summary": "make a schedule: a job released at each slot of a cron expression or a period",
                     "requestBody": _body(ScheduleSubmission),
                     "description": "What it would submit is checked as a job submitted now at its next slot: "
                                    "the model and the tenant's rights to it, the priority, both paths inside the "
                                    "key's roots (403); after names schedules of this tenant, with no loop. 409 "
                                    "for a name taken, 429 past beat.max_schedules_per_tenant.",
                     "responses": _responses(201, 400, 401, 403, 404, 409, 429)},
        },
        "/v1/schedules/plan": {
            "get": {"summary": "the staggering plan of a window's runs: each schedule's release offset and slot cap, "
                               "each run's predicted finish, the fleet's peak before and after; changes nothing",
                    "parameters": [*_plan_params(), *tenant],
                    "description": "Runs are learnt from each schedule's last released job; one that never ran is "
                                   "listed in left_out. An admin key plans every tenant's (or ?tenant='s).",
                    "responses": _responses(200, 400, 401)},
            "post": {"summary": "the same plan, stored on the schedules the key may change (release_offset, "
                                "slot_cap)", "parameters": tenant, "requestBody": _body(PlanAsk),
                     "responses": _responses(200, 400, 401)},
        },
        "/v1/schedules/{name}": {
            "get": {"summary": "a schedule with its recent runs: slot, job id, status, predicted and actual finish",
                    "description": steer, "parameters": [*name, *tenant], "responses": _responses(200, 400, 401, 404)},
            "patch": {"summary": "change some fields of a schedule (checked again as a new one is)",
                      "description": steer, "parameters": [*name, *tenant], "requestBody": _body(SchedulePatch),
                      "responses": _responses(200, 400, 401, 403, 404)},
            "delete": {"summary": "delete a schedule and its runs (the jobs it released stay)", "description": steer,
                       "parameters": [*name, *tenant], "responses": _responses(204, 400, 401, 403, 404)},
        },
        "/v1/schedules/{name}/pause": {
            "post": {"summary": "release no slot until it resumes", "description": steer,
                     "parameters": [*name, *tenant], "responses": _responses(200, 400, 401, 403, 404)}},
        "/v1/schedules/{name}/resume": {
            "post": {"summary": "release its slots again from the next one (none passed while paused is caught up)",
                     "description": steer, "parameters": [*name, *tenant],
                     "responses": _responses(200, 400, 401, 403, 404)}},
        "/v1/schedules/{name}/run": {
            "post": {"summary": "release one run now, outside its slots: the run, released or refused with its "
                                "reason", "description": steer, "parameters": [*name, *tenant],
                     "responses": _responses(201, 400, 401, 403, 404, 409, 503)}},
    }


def _with_common_errors(document: dict[str, Any]) -> dict[str, Any]:
    """Every operation that takes a key may answer 403: a `metrics` key reads `GET /metrics` only. And
    every operation that reads a body may answer 408: a body that stops arriving (`api.body_timeout`)."""
    for operations in document["paths"].values():
        for operation in operations.values():
            if operation.get("security") != [] and "401" in operation["responses"]:
                operation["responses"].setdefault("403", _responses(403)["403"])
            if "requestBody" in operation:
                operation["responses"].setdefault("408", _responses(408)["408"])
    return document


def _policy_schema() -> dict[str, Any]:
    """PUT /v1/policy's body: the ordering and each weight or threshold with the range it accepts."""
    defaults = Weights()
    properties: dict[str, Any] = {"ordering": {"type": "string", "enum": list(ORDERINGS)}}
    for name, (low, high) in POLICY_RANGES.items():
        kind = "integer" if isinstance(getattr(defaults, name), int) else "number"
        properties[name] = {"type": kind, "minimum": low, "maximum": high}
    return {"type": "object", "properties": properties, "additionalProperties": False}
