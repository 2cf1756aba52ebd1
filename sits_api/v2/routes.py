"""The Open Inference Protocol (KServe v2, as Triton speaks it) over the same queues.

Existing v2 JSON clients work unchanged: server metadata, health, model metadata and
readiness, Triton's model configuration (`.../config`, as perf_analyzer reads it), and `infer`
with `inputs: [{name, shape, datatype, data}]`, its body compressed or not (`sits_api.http.content_encoding`).
Triton's schedule-policy parameters are honoured as Triton reads them: `priority` (1 the most
urgent, larger numbers less so, 0 the default; `sits_level` maps it onto SITS's 16 levels) and
`timeout` (microseconds: the request's tolerable delay, which orders the queue, and its timeout under
its model's queue policy, `broker.online.queue_policy`: by default, as Triton enforces it, a request no worker
has taken by then is not run but fails as timed out), as is SITS's `user_tier` (vip, premium or free,
as in v1). Errors use the protocol's `{"error": "..."}`; a full queue's is a 429 with `Retry-After`.
Tensors travel as JSON or, as tritonclient sends them by default, in Triton's binary tensor data
extension (`sits_api.v2.binary`); the body is read whatever its Content-Type says (tritonclient
sends none), as Triton reads it. This module holds the routes; an `infer` body is parsed and
checked in `sits_api/v2/parsing.py`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import time
from typing import Any

import numpy as np
from flask import Blueprint, Response, g, jsonify, request

from broker.config.settings import Settings
from broker.errors import BadInput, InferenceTimeout, ModelNotFound, error_for_code
from broker.models import registry
from broker.models.model_record import ModelRecord, TensorSpec
from broker.monitoring import model_stats
from broker.online import queue_policy, requests
from broker.online.batching import Batching
from broker.online.records import RequestRecord
from broker.online.requests import RequestSpec
from broker.online.settings import ModelBatching
from broker.queueing import policy, workers
from broker.state.store import Store
from broker.tenants.apikeys import require_role
from sits_api.http.content_encoding import request_body
from sits_api.http.jsonio import parse_object
from sits_api.intake import requests as request_intake
from sits_api.intake import services
from sits_api.intake.result_inbox import Answer
from sits_api.state import app_state
from sits_api.tenancy import ab_routes, tenant_gate
from sits_api.v2 import binary as v2_binary
from sits_api.v2 import repository as v2_repository
from sits_api.v2.parsing import NUMPY_TO_V2, PRIORITY_LEVELS, InferRequest, parse_infer_request

v2 = Blueprint("v2", __name__)

EXTENSIONS = ("binary_tensor_data", "schedule_policy", "model_configuration", "statistics", "model_repository")
"""The Triton protocol extensions `GET /v2` names: binary tensors (`sits_api.v2.binary`), the
`priority` and `timeout` parameters, `.../config` and `.../stats` (`broker.monitoring.model_stats`),
and the repository's index, load and unload (`sits_api.v2.repository`)."""


@v2.get("/v2/health/live")
def live() -> Any:
    """The server answers."""
    return jsonify({"live": True})


@v2.get("/v2/health/ready")
def ready() -> Any:
    """Redis answers (work can be queued)."""
    try:
        app_state().store.ping()
    except Exception:  # any failure to reach Redis means not ready
        return jsonify({"ready": False}), 503
    return jsonify({"ready": True})


@v2.get("/v2")
def server_metadata() -> Any:
    """The server's name and version, and the protocol extensions it implements, by Triton's names."""
    return jsonify({"name": "sits", "version": package_version(), "extensions": list(EXTENSIONS)})


@functools.cache
def package_version() -> str:
    """The installed `sits` distribution's version ('unknown' in a source tree never installed)."""
    try:
        return importlib.metadata.version("sits")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _dims(shape: list[int | str]) -> list[int]:
    """A signature shape as the protocol writes it: -1 for a dynamic (named) axis."""
    return [dim if isinstance(dim, int) else -1 for dim in shape]


def metadata_of(store: Store, record: ModelRecord) -> dict[str, Any]:
    """The protocol's model metadata of a registry `record` (HTTP and gRPC answer it alike)."""
    def tensor(entry: TensorSpec) -> dict[str, Any]:
        if (loaded := v2_repository.config_tensor(record, entry["name"])) is not None:
            return loaded  # (loaded from a Triton model repository: as its config has it)
        # the batch axis is -1 even where the graph fixes it: workers batch every model along axis 0
        # (`sits_worker.model.servable`), so a request may carry any number of rows, as `.../config` says
        return {"name": entry["name"], "datatype": NUMPY_TO_V2.get(entry["dtype"], entry["dtype"]),
                "shape": [-1, *_dims(entry["shape"][1:])] if entry["shape"] else []}

    versions = [v.version for v in registry.list_model_versions(store, record.name)]
    return {"name": record.name, "versions": versions, "platform": "onnxruntime_onnx",
            "inputs": [tensor(e) for e in record.signature["inputs"]],
            "outputs": [tensor(e) for e in record.signature["outputs"]]}


@v2.get("/v2/models/<name>")
@v2.get("/v2/models/<name>/versions/<version>")
def model_metadata(name: str, version: str | None = None) -> Any:
    """Inputs and outputs with datatype and shape (-1 for a dynamic axis)."""
    store = app_state().store
    return jsonify(metadata_of(store, registry.get_model(store, f"{name}@{version}" if version else name)))


@v2.get("/v2/models/<name>/ready")
@v2.get("/v2/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: str | None = None) -> Any:
    """Ready: registered, and a worker is alive to run it (each loads a model on first use). Not ready
    is a 4xx, as the protocol has it: 404 for a model never registered, 400 while no worker is alive
    (requests would wait in the queue for one). The server's own readiness stays that of the queue,
    which takes work with no worker alive."""
    state = app_state()
    try:
        registry.get_model(state.store, f"{name}@{version}" if version else name)
    except ModelNotFound:
        return jsonify({"name": name, "ready": False}), 404
    if not workers.live_stream_slots(state.store, now=time.time(),
                                     timeout=state.settings.scheduler.worker_heartbeat_timeout):
        return jsonify({"name": name, "ready": False,
                        "error": "no worker is alive to run it; start one (sitsctl worker, or sitsctl up)"}), 400
    return jsonify({"name": name, "ready": True})


@v2.get("/v2/models/stats")
@v2.get("/v2/models/<name>/stats")
@v2.get("/v2/models/<name>/versions/<version>/stats")
def model_statistics(name: str | None = None, version: str | None = None) -> Any:
    """Triton's statistics extension: every registered model version's online request statistics
    (`broker.monitoring.model_stats`), or one model's versions, or one version. They count every tenant's
    requests, so, as GET /metrics, `metrics` keys and admins read them. (A model named 'stats' keeps
    its metadata at `.../versions/{v}`: `/v2/models/stats` is this route, as in Triton.)"""
    require_role(g.identity, "metrics")
    return jsonify({"model_stats": statistics_of(app_state().store, name, version)})


def statistics_of(store: Store, name: str | None, version: str | None) -> list[dict[str, Any]]:
    """Triton's `model_stats` entries of every model version (`name` None), of one model's, or of one
    version (HTTP and gRPC answer them alike); ModelNotFound for a model or version never registered."""
    if version is not None:
        record = registry.get_model(store, f"{name}@{version}")
        versions = [(record.name, record.version)]
    else:
        versions = [(record.name, record.version) for record in registry.list_model_versions(store, name)]
        if name is not None and not versions:
            raise ModelNotFound(f"model '{name}' is not registered")
    return model_stats.model_statistics(store, versions)


@v2.get("/v2/models/<name>/config")
@v2.get("/v2/models/<name>/versions/<version>/config")
def model_config(name: str, version: str | None = None) -> Any:
    """Triton's model configuration extension: what SITS knows of the model, as a Triton config."""
    state = app_state()
    record = registry.get_model(state.store, f"{name}@{version}" if version else name)
    settings = state.settings
    return jsonify(triton_config(record, services.model_batching(settings, record),
                                 queue=settings.online.batching_for(record.name)))


def triton_config(record: ModelRecord, batching: Batching, *, queue: ModelBatching | None = None) -> dict[str, Any]:
    """The Triton model configuration (model_config.proto as JSON) of a registry `record` whose
    workers batch it under `batching`, with its queue policy (`queue`'s keys) where one is set.

    Every SITS model batches along axis 0 (`sits_worker.model.servable`), so `max_batch_size` is the
    one workers apply and `dims` leave the batch axis out, as Triton's do for a batching model.
    A version loaded from a Triton model repository answers its config as loaded.
    """
    if (loaded := v2_repository.loaded_config(record)) is not None:
        return loaded
    def tensor(entry: TensorSpec) -> dict[str, Any]:
        # (a dtype the protocol has no name for, complex64, is TYPE_INVALID: a name Triton's enum has)
        return {"name": entry["name"], "data_type": f"TYPE_{NUMPY_TO_V2[entry['dtype']]}"
                if entry["dtype"] in NUMPY_TO_V2 else "TYPE_INVALID", "dims": _dims((entry["shape"] or [])[1:])}

    return {"name": record.name, "platform": "onnxruntime_onnx", "backend": "onnxruntime",
            "max_batch_size": batching.max_batch_size,
            "input": [tensor(entry) for entry in record.signature["inputs"]],
            "output": [tensor(entry) for entry in record.signature["outputs"]],
            "dynamic_batching": {"max_queue_delay_microseconds": round(batching.max_queue_delay * 1_000_000),
                                 "preferred_batch_size": list(batching.preferred_batch_sizes),
                                 "priority_levels": PRIORITY_LEVELS, "default_priority_level": PRIORITY_LEVELS,
                                 **(triton_queue_policy(queue) if queue is not None else {})}}


def triton_queue_policy(queue: ModelBatching) -> dict[str, Any]:
    """`default_queue_policy` and `priority_queue_policy` as Triton writes them (`ModelQueuePolicy`: a
    timeout in microseconds, `REJECT` / `DELAY`, Triton's priority p for SITS level 16 - p), for a model
    whose queue keys are not Triton's defaults (SITS's `max_queue_size` default is not: it bounds a
    queue); {} for one whose are, as Triton leaves them out."""
    if (queue.max_queue_size, queue.default_timeout, queue.timeout_action, queue.allow_timeout_override,
            dict(queue.priority_levels)) == (0, 0.0, "reject", True, {}):
        return {}

    def policy(level: int | None) -> dict[str, Any]:
        resolved = queue_policy.resolve(queue, level if level is not None else -1)
        size = resolved.max_queue_size if level is None else resolved.level_max_queue_size
        return {"timeout_action": resolved.timeout_action.upper(),
                "default_timeout_microseconds": round(resolved.default_timeout * 1_000_000),
                "allow_timeout_override": resolved.allow_timeout_override, "max_queue_size": size}

    levels = {str(PRIORITY_LEVELS - level): policy(level) for level in sorted(queue.priority_levels)}
    return {"default_queue_policy": policy(None), **({"priority_queue_policy": levels} if levels else {})}


@v2.post("/v2/models/<name>/infer")
@v2.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: str | None = None) -> Any:
    """Run one inference request through the scheduler and answer with its outputs."""
    state = app_state()
    settings, store = state.settings, state.store
    header, binary = v2_binary.split_body(request_body(), request.headers.get(v2_binary.HEADER_LENGTH))
    body = parse_object(header, "a JSON object with an 'inputs' list of {name, shape, datatype, data}")
    model = f"{name}@{version}" if version else ab_routes.routed(store, name, g.identity, request.headers, "v2")
    checked = parse_infer_request(store, body, model, binary)
    tenant = tenant_gate.check_model(state.tenants, store, g.identity, checked.model)
    tenant_gate.check_entitlements(g.identity, tenant, priority=checked.priority, user_tier=checked.user_tier)
    request_id = requests.new_request_id()
    with state.waiting_slot(g.identity, True), state.inbox.expecting(request_id) as answer:
        spec = request_intake.submit(settings, store, state.dispatcher, state.policy, model=checked.model,
                                     inputs=checked.inputs, priority=checked.priority,
                                     deadline_ms=checked.deadline_ms, user_tier=checked.user_tier, tokens=None,
                                     owner=g.identity["name"], now=time.time(), timeout_ms=checked.deadline_ms,
                                     request_id=request_id, reply_to=answer.reply_to,
                                     tenant=tenant_gate.tenant_of(g.identity),
                                     max_queued=tenant_gate.caps_of(g.identity, tenant).max_queued,
                                     max_queued_bytes=tenant_gate.caps_of(g.identity, tenant).max_queued_bytes,
                                     max_priority=tenant_gate.priority_cap(tenant))
        result = _wait_for_answer(answer, settings, store, state.policy, spec)
    if result.status != "succeeded":  # answered with the status of the error that failed it
        # (a request failed by a worker of a release before error codes: a 400, as it was then)
        raise error_for_code(result.error_code or BadInput.code, result.error or "the request failed")
    outputs = result.outputs or {}
    return _answer({"model_name": spec.model_name, "model_version": spec.model_version,
                    "id": spec.request_id if checked.client_id is None else checked.client_id},
                   {output: outputs[output] for output in checked.outputs or outputs}, checked)


def _wait_for_answer(answer: Answer, settings: Settings, store: Store, live_policy: policy.LivePolicy,
                     spec: RequestSpec) -> RequestRecord:
    """The finished request, waited for as Triton does: one still waiting at its timeout fails as
    timed out then (`timeout_action: reject`; `delay` waits on), one a worker took in time answers
    when its run ends, within `online.max_wait` in all; InferenceTimeout otherwise."""
    result = request_intake.wait_for_result(settings, store, live_policy, answer, spec,
                                            seconds=settings.online.max_wait)
    if result is None:
        raise not_done_in_time(spec)
    return result


def not_done_in_time(spec: RequestSpec) -> InferenceTimeout:
    """The error of a request whose answer did not come within `online.max_wait` (HTTP and gRPC alike)."""
    return InferenceTimeout(f"request {spec.request_id} is not done within the server's online.max_wait; it "
                            f"still runs, and GET /v1/requests/{spec.request_id} shows its result")


def _answer(fields: dict[str, Any], outputs: dict[str, np.ndarray], checked: InferRequest) -> Any:
    """The v2 answer: JSON, or framed with the outputs the request wants in binary after the JSON.

    A model may well output NaN or an infinity (a log of 0). JSON has no such number, and the fast
    JSON writer would put `null` there, which tritonclient reads as NaN (so -inf came back as NaN)
    and stricter clients refuse. Such an answer is written as Triton writes it (rapidjson's
    `NaN`, `Infinity`, `-Infinity`, which tritonclient and Python's json read back).
    """
    entries: list[dict[str, Any]] = []
    binary: list[bytes] = []
    non_finite = False
    for name, array in outputs.items():
        datatype = NUMPY_TO_V2.get(array.dtype.name)
        entry = {"name": name, "datatype": datatype or "BYTES", "shape": list(array.shape)}
        if datatype and checked.wants_binary(name):  # (a BYTES output, were there one, stays JSON)
            binary.append(v2_binary.tensor_bytes(array))
            entries.append(entry | {"parameters": {"binary_data_size": len(binary[-1])}})
        else:
            entries.append(entry | {"data": array.ravel().tolist()})
            non_finite = non_finite or (array.dtype.kind == "f" and not bool(np.isfinite(array).all()))
    answer = fields | {"outputs": entries}
    text = json.dumps(answer) if non_finite else None  # (json writes NaN, Infinity, -Infinity)
    if binary:
        return v2_binary.framed_response(answer, binary, text=text)
    return Response(text + "\n", mimetype="application/json") if text is not None else jsonify(answer)


