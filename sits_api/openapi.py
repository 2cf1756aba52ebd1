"""The OpenAPI 3.1 document of the REST API: every request and answer schema generated from the pydantic
models that validate the requests (`sits_api.schemas`, ...) and type the answers (`sits_api.http.bodies`),
as named components a client generator turns into classes; every error is one `Error`."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from broker.jobs.records import ACTIVE_STATUSES, FINAL_STATUSES
from broker.models.routing import Route
from broker.queueing.policy import ORDERINGS, POLICY_RANGES
from broker.queueing.scoring import Weights
from broker.schedules.records import SCHEDULE_NAME
from broker.sla.task_sets import TaskSet
from broker.tenants.records import TENANT_PATTERN
from broker.tenants.settings import Tenant
from sits_api.http.bodies import admin, jobs, keys, models, schedules, v2
from sits_api.http.bodies.errors import Error
from sits_api.schedules.bodies import PlanAsk, SchedulePatch, ScheduleSubmission
from sits_api.schemas import MAX_JOBS_LISTED, JobSubmission, ModelRegistration, OnlineRequest
from sits_api.tuning import bodies as tuning_bodies

Mode = Literal["validation", "serialization"]
Answers = Mapping[int, type[BaseModel] | tuple[type[BaseModel], ...] | None]
"""An operation's answers other than errors: status -> the model of its JSON body (None: no body)."""

_REF = "#/components/schemas/{model}"
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again (a full queue, open "
                                               "breakers, a busy server)",
                                "schema": {"type": "integer", "minimum": 1}}}


class _Components:
    """The models the document names, generated together once every operation is written, so that a model
    met twice (a request's and an answer's) is one schema, and each has its class's name."""

    def __init__(self) -> None:
        self._wanted: dict[tuple[type[BaseModel], Mode], list[dict[str, Any]]] = {}
        self.extra: dict[str, Any] = {}
        """Schemas written by hand (what no model holds), by name."""

    def ref(self, model: type[BaseModel], mode: Mode = "serialization") -> dict[str, Any]:
        """A `$ref` to `model`'s schema, filled in by `schemas`."""
        holder: dict[str, Any] = {}
        self._wanted.setdefault((model, mode), []).append(holder)
        return holder

    def body(self, model: type[BaseModel]) -> dict[str, Any]:
        """A required JSON request body of `model`."""
        return {"required": True, "content": {"application/json": {"schema": self.ref(model, "validation")}}}

    def answers(self, ok: Answers, *errors: int) -> dict[str, Any]:
        """The responses of an operation: `ok`'s statuses with their models (a tuple: any one of them), and
        `errors` as `Error`."""
        responses: dict[str, Any] = {}
        for code, model in ok.items():
            responses[str(code)] = {"description": HTTPStatus(code).phrase}
            if isinstance(model, tuple):
                schema = {"anyOf": [self.ref(one) for one in model]}
                responses[str(code)]["content"] = {"application/json": {"schema": schema}}
            elif model is not None:
                responses[str(code)]["content"] = {"application/json": {"schema": self.ref(model)}}
        for code in errors:
            responses[str(code)] = self.error(code)
        return responses

    def error(self, code: int) -> dict[str, Any]:
        """An error response: the `Error` body (with `Retry-After` where one may come back later)."""
        answer = {"description": HTTPStatus(code).phrase, "content": {"application/json": {"schema": self.ref(Error)}}}
        return answer | ({"headers": copy.deepcopy(_RETRY_AFTER)} if code in (429, 503) else {})

    def schemas(self) -> dict[str, Any]:
        """Every named schema, the `$ref`s handed out pointed at them."""
        refs, top = models_json_schema(list(self._wanted), ref_template=_REF)
        for key, holders in self._wanted.items():
            for holder in holders:
                holder.update(refs[key])
        return {**top.get("$defs", {}), **self.extra}


@functools.cache
def _cached_document() -> dict[str, Any]:
    return _build_document()


def openapi_document() -> dict[str, Any]:
    """The document served at `/openapi.json` (built once; a copy each call)."""
    return copy.deepcopy(_cached_document())


def _build_document() -> dict[str, Any]:
    c = _Components()
    job_id = [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    model_ref = [{"name": "ref", "in": "path", "required": True, "schema": {"type": "string"},
                  "description": "name or name@version"}]
    def path_params(*names: str, pattern: str | None = None) -> list[dict[str, Any]]:
        schema = {"type": "string", **({"pattern": pattern} if pattern else {})}
        return [{"name": name, "in": "path", "required": True, "schema": schema} for name in names]

    def v2_params(*names: str) -> list[dict[str, Any]]:
        return path_params(*names, pattern="^[^@]+$")  # (a model and its version apart: `name@version` is v1's)

    binary = {"schema": {"type": "string", "format": "binary"}}
    owned = ("A user key sees only what it submitted: another key's answers 404, as an unknown id does; "
             "an admin key sees everything.")
    header_length = {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                     "schema": {"type": "integer", "minimum": 0},
                     "description": "Triton's binary tensor data extension: the byte length of the JSON at the "
                                    "start of the body (binary tensors follow it); without it the body is JSON"}
    # 429: a full queue, 503: the model's breakers open on every worker (docs/failures.md); both with Retry-After
    v2_infer_responses = c.answers({200: v2.InferResponse}, 400, 401, 404, 413, 415, 429, 503, 504)
    v2_infer_responses["200"]["content"]["application/octet-stream"] = binary
    v2_infer = {"summary": "Open Inference Protocol (KServe v2) inference; parameters.priority, .timeout (us)",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": c.ref(v2.InferRequest, "validation")},
                                            "application/octet-stream": binary},
                                "description": "v2 JSON or, in Triton's binary tensor data extension, the JSON "
                                               "(its byte length in header Inference-Header-Content-Length) "
                                               "followed by the binary tensors' bytes"},
                "responses": v2_infer_responses}
    v2_config = {"summary": "Triton model configuration (max_batch_size, input/output dims, dynamic_batching)",
                 "responses": c.answers({200: v2.ModelConfig}, 400, 401, 404)}
    v2_stats = {"summary": "Triton's statistics extension: online request counts and times (ns) per model "
                           "version; metrics keys and admins",
                "responses": c.answers({200: v2.ModelStatisticsList}, 400, 401, 403, 404)}
    # not ready is the readiness itself (400: no worker alive, 404: never registered); a bad name is an Error
    v2_ready: Answers = {200: v2.ModelReady, 400: (v2.ModelReady, Error), 404: (v2.ModelReady, Error)}
    from sits_api.http.bodies import repository as repo  # (the repository extension's bodies)

    v2_paths: dict[str, Any] = {
        "/v2/models/stats": {"get": v2_stats},
        "/v2/models/{name}/stats": {"get": v2_stats | {"parameters": v2_params("name")}},
        "/v2/models/{name}/versions/{version}/stats": {"get": v2_stats | {"parameters": v2_params("name", "version")}},
        "/v2": {"get": {"summary": "v2 server metadata: name, version, the Triton extensions implemented",
                        "security": [], "responses": c.answers({200: v2.ServerMetadata})}},
        "/v2/health/live": {"get": {"summary": "v2 liveness", "security": [],
                                    "responses": c.answers({200: v2.ServerLive})}},
        "/v2/health/ready": {"get": {"summary": "v2 readiness", "security": [],
                                     "responses": c.answers({200: v2.ServerReady, 503: v2.ServerReady})}},
        "/v2/models/{name}": {"get": {"summary": "v2 model metadata", "parameters": v2_params("name"),
                                      "responses": c.answers({200: v2.ModelMetadata}, 400, 401, 404)}},
        "/v2/models/{name}/versions/{version}": {"get": {"summary": "v2 model metadata of one version",
                                                         "parameters": v2_params("name", "version"),
                                                         "responses": c.answers({200: v2.ModelMetadata},
                                                                                400, 401, 404)}},
        "/v2/models/{name}/ready": {"get": {"summary": "v2 model readiness: 400 while no worker is alive",
                                            "parameters": v2_params("name"),
                                            "responses": c.answers(v2_ready, 401)}},
        "/v2/models/{name}/versions/{version}/ready": {
            "get": {"summary": "v2 readiness of one version", "parameters": v2_params("name", "version"),
                    "responses": c.answers(v2_ready, 401)}},
        "/v2/models/{name}/config": {"get": v2_config | {"parameters": v2_params("name")}},
        "/v2/models/{name}/versions/{version}/config": {
            "get": v2_config | {"parameters": v2_params("name", "version")}},
        "/v2/models/{name}/infer": {"post": v2_infer | {"parameters": [*v2_params("name"), header_length]}},
        "/v2/models/{name}/versions/{version}/infer": {
            "post": v2_infer | {"parameters": [*v2_params("name", "version"), header_length]}},
        # Triton's model repository extension (sits_api/v2/repository.py): admin keys
        "/v2/repository/index": {"post": {"summary": "Triton model repository index: [{name, version, state, "
                                                     "reason}]; body {\"ready\": true} lists the READY ones",
                                          "responses": c.answers({200: repo.RepositoryIndex}, 400, 401, 403)}},
        "/v2/repository/models/{name}/load": {"post": {
            "summary": "load a repository model from its folder again; 400 with the reason naming the field",
            "parameters": v2_params("name"), "responses": c.answers({200: repo.RepositoryDone}, 400, 401, 403, 404)}},
        "/v2/repository/models/{name}/unload": {"post": {
            "summary": "unload a repository model", "parameters": v2_params("name"),
            "responses": c.answers({200: repo.RepositoryDone}, 400, 401, 403, 404)}},
    }
    c.extra["PolicyUpdate"] = _policy_schema()
    paths = {
        "/healthz": {"get": {"summary": "liveness", "security": [], "responses": c.answers({200: admin.Health})}},
        "/readyz": {"get": {"summary": "readiness (Redis reachable)", "security": [],
                            "responses": c.answers({200: admin.Readiness, 503: admin.Readiness})}},
        "/v1/status": {"get": {"summary": "workers, queues, jobs by status",
                               "responses": c.answers({200: admin.Status}, 401)}},
        "/metrics": {"get": {"summary": "Prometheus metrics: queues, workers, memory, jobs by status, requests "
                                        "and job rows served (counts only; a metrics or admin key)",
                             "responses": {"200": {"description": "Prometheus text exposition (OpenMetrics "
                                                                  "when the Accept header asks for it)",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **c.answers({}, 401, 403, 503)}}},
        "/v1/models": {
            "get": {"summary": "list model versions; owner and file paths (path, source_path): to the "
                               "keys that own the name and admins, null to other keys",
                    "responses": c.answers({200: models.ModelList}, 401)},
            "post": {"summary": "register a model", "requestBody": c.body(ModelRegistration),
                     "description": "A new name becomes the tenant's (the key's name), or no tenant's when "
                                    "the key is an admin; a version under another tenant's name is a 403, "
                                    "as is one under a name no tenant owns (an admin key's, or registered "
                                    "before names had owners) unless the key is an admin. Also 403: a "
                                    "path outside the model roots. The registration runs off the request "
                                    "threads: done within models.registration_wait, a 201 with the version; "
                                    "else a 202 with a registration id to poll.",
                     "responses": c.answers({201: models.ModelVersion, 202: models.RegistrationStarted},
                                            400, 401, 403, 404, 413, 422, 429)},
        },
        "/v1/models/registrations/{registration_id}": {
            "get": {"summary": "a registration that answered 202: running, registered (with the version) or "
                               "failed (with its error); the caller's own",
                    "parameters": path_params("registration_id"),
                    "responses": c.answers({200: models.Registration}, 401, 404)}},
        "/v1/models/{ref}": {"get": {"summary": "one model", "parameters": model_ref,
                                     "responses": c.answers({200: models.ModelDetail}, 400, 401, 404)}},
        "/v1/models/{ref}/tune": {
            "post": {"summary": "sweep the model's batching (ceiling x max_queue_delay x streams) under "
                                "closed-loop load, pick the highest throughput within the P99 bound, and with "
                                "apply store it (source: tuned)", "parameters": model_ref,
                     "requestBody": c.body(tuning_bodies.TuneAsk),
                     "description": "Runs on a releaser (started with the beat); poll GET until every kind's "
                                    "record with the ask_id is done or failed. Only keys that may add versions "
                                    "under the name tune it (403 for another tenant's); 409 while a sweep of it "
                                    "is queued or runs, or when no worker (of the device_kind asked) is live; "
                                    "429 while one less than beat.release_threads sweeps are queued or run; "
                                    "400 for a sweep planned past an hour.",
                     "responses": c.answers({202: tuning_bodies.TuneStarted}, 400, 401, 403, 404, 409, 429)},
            "get": {"summary": "the model version's last sweep on each kind of device: its points, front and pick",
                    "parameters": model_ref,
                    "responses": c.answers({200: tuning_bodies.Tunings}, 400, 401, 403, 404)},
        },
        "/v1/jobs": {
            "get": {"summary": "list jobs: a user key its own, an admin key all (or one owner's)",
                    "responses": c.answers({200: jobs.JobList}, 400, 401, 403),
                    "parameters": [{"name": "status", "in": "query",
                                    "schema": {"type": "string", "enum": [*ACTIVE_STATUSES, *FINAL_STATUSES]}},
                                   {"name": "limit", "in": "query",
                                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_JOBS_LISTED}},
                                   {"name": "owner", "in": "query", "schema": {"type": "string", "pattern": r"\S"},
                                    "description": "key name whose jobs to list; a user key may "
                                                   "name only itself (403 otherwise)"},
                                   {"name": "tenant", "in": "query", "schema": {"type": "string"},
                                    "description": "the tenant whose jobs to list: an admin's choice; another "
                                                   "key's own (naming another lists none)"}]},
            "post": {"summary": "submit an offline job", "requestBody": c.body(JobSubmission),
                     "description": "409 while an active job holds output_dir (named only to a key that "
                                    "may see it) or when it holds a finished job's results.",
                     "responses": c.answers({201: jobs.Job}, 400, 401, 403, 404, 409, 413, 415)},
        },
        "/v1/jobs/{job_id}": {
            "get": {"summary": "job status and progress", "description": owned, "parameters": job_id,
                    "responses": c.answers({200: jobs.Job}, 401, 404)},
            "delete": {"summary": "cancel a job", "description": owned, "parameters": job_id,
                       "responses": c.answers({200: jobs.Job}, 401, 404)},
        },
        "/v1/requests": {
            "post": {"summary": "one online inference request (202, or 200 with the result when waiting)",
                     "requestBody": c.body(OnlineRequest),
                     "parameters": [{"name": "wait", "in": "query", "schema": {"type": "boolean"}}],
                     "responses": c.answers({200: jobs.RequestResult, 202: jobs.RequestQueued},
                                            400, 401, 404, 413, 415, 429, 503)},
        },
        "/v1/requests/{request_id}": {
            "get": {"summary": "a request's status and outputs", "description": owned,
                    "parameters": [{"name": "request_id", "in": "path", "required": True,
                                    "schema": {"type": "string"}}],
                    "responses": c.answers({200: jobs.RequestResult}, 401, 404)},
        },
        "/v1/policy": {
            "get": {"summary": "the live scoring weights and queue ordering",
                    "responses": c.answers({200: admin.Policy}, 401)},
            "put": {"summary": "admin: hot-update weights/ordering; waiting items are re-scored in slices",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": {
                        "$ref": _REF.format(model="PolicyUpdate")}}}},
                    "responses": c.answers({200: admin.PolicyUpdated}, 400, 401, 403)},
        },
        "/v1/routes": {
            "get": {"summary": "admin: the A/B routes of bare model names (tenant-admin: its tenant's)",
                    "responses": c.answers({200: admin.RouteList}, 401, 403)},
            "put": {"summary": "admin, or tenant-admin for its tenant's model names: set a model's A/B route "
                               "(split by weight, groups, kinds of call)",
                    "requestBody": c.body(Route), "responses": c.answers({200: Route}, 400, 401, 403, 404)},
        },
        "/v1/routes/{model}": {
            "delete": {"summary": "admin, or tenant-admin for its tenant's model names: remove a model's route",
                       "parameters": path_params("model"), "responses": c.answers({204: None}, 401, 403, 404)},
        },
        "/v1/tenants": {
            "get": {"summary": "admin: every tenant with its share, limit and quotas",
                    "responses": c.answers({200: admin.TenantList}, 401, 403)},
        },
        "/v1/tenants/{name}": {
            "get": {"summary": "a tenant's record (admins, and its own tenant's keys)",
                    "parameters": path_params("name"),
                    "responses": c.answers({200: admin.TenantRecord}, 401, 403, 404)},
            "put": {"summary": "admin: create or replace a tenant (shares sum to at most 1)",
                    "parameters": path_params("name", pattern=f"^{TENANT_PATTERN.pattern}$"),
                    "requestBody": c.body(Tenant),
                    "responses": c.answers({200: admin.TenantRecord}, 400, 401, 403, 409)},
            "delete": {"summary": "admin: remove a tenant's record (its keys keep working, with no share)",
                       "parameters": path_params("name"), "responses": c.answers({204: None}, 401, 403, 404, 409)},
        },
        "/v1/keys": {
            "post": {"summary": "admin or tenant-admin: make an API key (answered once); a tenant admin only "
                                "of its own tenant, as tenant-admin, user or viewer",
                     "requestBody": c.body(keys.KeyCreation),
                     "description": "A key name is its tenant's: other tenants may have keys of the same name. "
                                    "400 also for a tenant named like an admin key, or an admin key named like "
                                    "a tenant.",
                     "responses": c.answers({201: keys.KeyMade}, 400, 401, 403, 429)},
            "get": {"summary": "admin: every key's name, role, tenant and group; tenant-admin: its tenant's",
                    "responses": c.answers({200: keys.KeyList}, 401, 403)},
        },
        "/v1/keys/{name}": {
            "delete": {"summary": "admin or tenant-admin: delete the keys of that name (within 5 s)",
                       "parameters": [*path_params("name"),
                                      {"name": "tenant", "in": "query", "schema": {"type": "string"},
                                       "description": "the tenant whose keys to delete: an admin's choice "
                                                      "(default: every tenant's); a tenant admin's own"}],
                       "description": "409 for an admin key naming no tenant where keys of that name belong to "
                                      "several tenants (or to a tenant and the admin keys).",
                       "responses": c.answers({200: keys.KeysRevoked}, 401, 403, 404, 409, 429)},
        },
        "/v1/usage": {
            "get": {"summary": "chargeback: device-seconds, rows, requests, jobs, queue time and cost per tenant",
                    "description": "Query: tenant, from and to (UTC dates, YYYY-MM-DD), by (model, key or day). "
                                   "A non-admin key sees only its own tenant, and a user key by key only its own "
                                   "key's rows. 429 while another report of the tenant by model, key or device "
                                   "runs or rests.",
                    "responses": c.answers({200: admin.Usage}, 400, 401, 403, 429)},
        },
        "/v1/sla/analysis": {
            "post": {"summary": "schedulability of a periodic task set: utilisation and the Liu-Layland "
                                "bound, each task's response time, feasible or not",
                     "requestBody": c.body(TaskSet),
                     "description": "A task's wcet_ms is given, or derived from a model's measured profile "
                                    "(P99 per mini-batch) and rows: 404 for an unknown model, 409 for one "
                                    "without a measured profile or profiled on another device kind.",
                     "responses": c.answers({200: jobs.SlaAnalysis}, 400, 401, 404, 409)},
        },
        **_schedule_paths(c, path_params("name", pattern=f"^(?!plan$){SCHEDULE_NAME.pattern}$")),  # (plan's route)
        "/v1/jobs/{job_id}/resume": {
            "post": {"summary": "re-queue the unfinished chunks", "description": owned, "parameters": job_id,
                     "responses": c.answers({202: jobs.Job}, 400, 401, 404, 409)},
        },
        **v2_paths,
    }
    document = _with_common_errors(c, {
        "openapi": "3.1.0",
        "info": {"title": "SITS", "version": "1",
                 "description": "Scalable Inference Task Scheduler. Request bodies may be sent with "
                                "Content-Encoding gzip or deflate (415 for any other), within "
                                "api.max_body_bytes once decompressed (413)."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    })
    document["components"]["schemas"] = c.schemas()
    return document


def _plan_params() -> list[dict[str, Any]]:
    """The query parameters of `GET /v1/schedules/plan`: the fields of `PlanAsk`."""
    schema = PlanAsk.model_json_schema()["properties"]
    return [{"name": name, "in": "query", "required": False, "description": field.get("description", ""),
             "schema": {"type": "integer" if name == "slots" else "string"}} for name, field in schema.items()]


def _schedule_paths(c: _Components, name: list[dict[str, Any]]) -> dict[str, Any]:
    """`/v1/schedules` (docs/schedules.md): a schedule is named within the caller's tenant; an admin key names
    another tenant's with `?tenant=`."""
    tenant = [{"name": "tenant", "in": "query", "required": False, "schema": {"type": "string", "pattern": r"\S"},
               "description": "admin keys: the tenant whose schedule to address (default the key's own)"}]
    steer = "Another tenant's schedule answers 404, as a missing one does; a viewer key's change, 403."
    one = {200: schedules.Schedule}
    return {
        "/v1/schedules": {
            "get": {"summary": "the schedules the key may read (a user key its own; an admin key every tenant's, "
                               "or ?tenant='s)", "parameters": tenant,
                    "responses": c.answers({200: schedules.ScheduleList}, 400, 401)},
            "post": {"summary": "make a schedule: a job released at each slot of a cron expression or a period",
                     "requestBody": c.body(ScheduleSubmission),
                     "description": "What it would submit is checked as a job submitted now at its next slot: "
                                    "the model and the tenant's rights to it, the priority, both paths inside the "
                                    "key's roots (403); after names schedules of this tenant, with no loop. 409 "
                                    "for a name taken, 429 past beat.max_schedules_per_tenant.",
                     "responses": c.answers({201: schedules.Schedule}, 400, 401, 403, 404, 409, 429)},
        },
        "/v1/schedules/plan": {
            "get": {"summary": "the staggering plan of a window's runs: each schedule's release offset and slot cap, "
                               "each run's predicted finish, the fleet's peak before and after; changes nothing",
                    "parameters": [*_plan_params(), *tenant],
                    "description": "Runs are learnt from each schedule's last released job; one that never ran is "
                                   "listed in left_out. An admin key plans every tenant's (or ?tenant='s).",
                    "responses": c.answers({200: schedules.Plan}, 400, 401)},
            "post": {"summary": "the same plan, stored on the schedules the key may change (release_offset, "
                                "slot_cap)", "parameters": tenant, "requestBody": c.body(PlanAsk),
                     "responses": c.answers({200: schedules.Plan}, 400, 401)},
        },
        "/v1/schedules/{name}": {
            "get": {"summary": "a schedule with its recent runs: slot, job id, status, predicted and actual finish",
                    "description": steer, "parameters": [*name, *tenant],
                    "responses": c.answers(one, 400, 401, 404)},
            "patch": {"summary": "change some fields of a schedule (checked again as a new one is)",
                      "description": steer, "parameters": [*name, *tenant], "requestBody": c.body(SchedulePatch),
                      "responses": c.answers(one, 400, 401, 403, 404)},
            "delete": {"summary": "delete a schedule and its runs (the jobs it released stay)", "description": steer,
                       "parameters": [*name, *tenant], "responses": c.answers({204: None}, 400, 401, 403, 404)},
        },
        "/v1/schedules/{name}/pause": {
            "post": {"summary": "release no slot until it resumes", "description": steer,
                     "parameters": [*name, *tenant], "responses": c.answers(one, 400, 401, 403, 404)}},
        "/v1/schedules/{name}/resume": {
            "post": {"summary": "release its slots again from the next one (none passed while paused is caught up)",
                     "description": steer, "parameters": [*name, *tenant],
                     "responses": c.answers(one, 400, 401, 403, 404)}},
        "/v1/schedules/{name}/run": {
            "post": {"summary": "release one run now, outside its slots: the run, released or refused with its "
                                "reason", "description": steer, "parameters": [*name, *tenant],
                     "responses": c.answers({201: schedules.ScheduleRun}, 400, 401, 403, 404, 409, 503)}},
    }


def _with_common_errors(c: _Components, document: dict[str, Any]) -> dict[str, Any]:
    """Every operation that takes a key may answer 403: a `metrics` key reads `GET /metrics` only. And
    every operation that reads a body may answer 408: a body that stops arriving (`api.body_timeout`).
    Each gets an `operationId` from its method and path, the name a generated client gives its call."""
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if operation.get("security") != [] and "401" in operation["responses"]:
                operation["responses"].setdefault("403", c.error(403))
            if "requestBody" in operation:
                operation["responses"].setdefault("408", c.error(408))
            operation.setdefault("operationId", f"{method}_{re.sub(r'[^a-z0-9]+', '_', path.lower()).strip('_')}")
    return document


def _policy_schema() -> dict[str, Any]:
    """PUT /v1/policy's body: the ordering and each weight or threshold with the range it accepts."""
    defaults = Weights()
    properties: dict[str, Any] = {"ordering": {"type": "string", "enum": list(ORDERINGS)}}
    for name, (low, high) in POLICY_RANGES.items():
        kind = "integer" if isinstance(getattr(defaults, name), int) else "number"
        properties[name] = {"type": kind, "minimum": low, "maximum": high}
    return {"title": "PolicyUpdate", "type": "object", "properties": properties, "additionalProperties": False}
