"""The Open Inference Protocol (KServe v2, as Triton speaks it) over the same queues.

Existing v2 JSON clients work unchanged: server metadata, health, model metadata and
readiness, Triton's model configuration (`.../config`, as perf_analyzer reads it), and `infer`
with `inputs: [{name, shape, datatype, data}]`, its body compressed or not (`sits_api.content_encoding`).
Triton's schedule-policy parameters are honoured as Triton reads them: `priority` (1 the most
urgent, larger numbers less so, 0 the default; `sits_level` maps it onto SITS's 16 levels) and
`timeout` (microseconds: the request's tolerable delay, which orders the queue, and, as Triton
enforces it, a request no worker has taken by then is not run but fails as timed out), as is
SITS's `user_tier` (vip, premium or free, as in v1). Errors use the protocol's `{"error": "..."}`.
Tensors travel as JSON or, as tritonclient sends them by default, in Triton's binary tensor data
extension (`sits_api.v2_binary`); the body is read whatever its Content-Type says (tritonclient
sends none), as Triton reads it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from flask import Blueprint, Response, g, jsonify, request

from broker import model_stats, registry, requests, workers
from broker.apikeys import require_role
from broker.batching import Batching
from broker.errors import BadInput, InferenceTimeout, ModelNotFound, error_for_code
from broker.scoring import SLA_WEIGHTS
from broker.store import Store
from sits_api import request_intake, services, v2_binary
from sits_api.content_encoding import request_body
from sits_api.jsonio import parse_object
from sits_api.v2_binary import BinaryData
from sits_worker.model.tensors import check_buildable, exact_numbers

v2 = Blueprint("v2", __name__)

DATATYPES = {"FP32": "float32", "FP64": "float64", "FP16": "float16", "INT64": "int64", "INT32": "int32",
             "INT16": "int16", "INT8": "int8", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
             "UINT64": "uint64", "BOOL": "bool"}
NUMPY_TO_V2 = {numpy_name: v2_name for v2_name, numpy_name in DATATYPES.items()}
EXTENSIONS = ("binary_tensor_data", "schedule_policy", "model_configuration", "statistics")
"""The Triton protocol extensions `GET /v2` names: binary tensors (`sits_api.v2_binary`), the
`priority` and `timeout` parameters, `.../config` and `.../stats` (`broker.model_stats`)."""
PRIORITY_LEVELS = 16
"""SITS's priority levels (0-15), as Triton's `priority_levels`: Triton priority 1 is SITS level 15."""


def sits_level(triton_priority: int) -> int:
    """Triton's `priority` as a SITS level. Triton counts down from 1, the most urgent (SITS level 15),
    to `priority_levels` (16: level 0); 0 asks for the default, and so does a value past the last
    level, as Triton treats it. The default is SITS's: level 0, the least urgent, as a v1 request
    that names no priority gets."""
    return PRIORITY_LEVELS - triton_priority if 1 <= triton_priority <= PRIORITY_LEVELS else 0


def _ctx() -> dict[str, Any]:
    from flask import current_app

    return current_app.extensions["sits"]


@v2.get("/v2/health/live")
def live() -> Any:
    """The server answers."""
    return jsonify({"live": True})


@v2.get("/v2/health/ready")
def ready() -> Any:
    """Redis answers (work can be queued)."""
    try:
        _ctx()["store"].ping()
    except Exception:  # any failure to reach Redis means not ready
        return jsonify({"ready": False}), 503
    return jsonify({"ready": True})


@v2.get("/v2")
def server_metadata() -> Any:
    """The server's name and version, and the protocol extensions it implements, by Triton's names."""
    return jsonify({"name": "sits", "version": _package_version(), "extensions": list(EXTENSIONS)})


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("sits")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _dims(shape: list[int | str]) -> list[int]:
    """A signature shape as the protocol writes it: -1 for a dynamic (named) axis."""
    return [dim if isinstance(dim, int) else -1 for dim in shape]


def _metadata(record: dict[str, Any]) -> dict[str, Any]:
    def tensor(entry: dict[str, Any]) -> dict[str, Any]:
        # the batch axis is -1 even where the graph fixes it: workers batch every model along axis 0
        # (`sits_worker.model.servable`), so a request may carry any number of rows, as `.../config` says
        return {"name": entry["name"], "datatype": NUMPY_TO_V2.get(entry["dtype"], entry["dtype"]),
                "shape": [-1, *_dims(entry["shape"][1:])] if entry["shape"] else []}

    versions = [v["version"] for v in registry.list_model_versions(_ctx()["store"], record["name"])]
    return {"name": record["name"], "versions": versions, "platform": "onnxruntime_onnx",
            "inputs": [tensor(e) for e in record["signature"]["inputs"]],
            "outputs": [tensor(e) for e in record["signature"]["outputs"]]}


@v2.get("/v2/models/<name>")
@v2.get("/v2/models/<name>/versions/<version>")
def model_metadata(name: str, version: str | None = None) -> Any:
    """Inputs and outputs with datatype and shape (-1 for a dynamic axis)."""
    return jsonify(_metadata(registry.get_model(_ctx()["store"], f"{name}@{version}" if version else name)))


@v2.get("/v2/models/<name>/ready")
@v2.get("/v2/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: str | None = None) -> Any:
    """Ready: registered, and a worker is alive to run it (each loads a model on first use). Not ready
    is a 4xx, as the protocol has it: 404 for a model never registered, 400 while no worker is alive
    (requests would wait in the queue for one). The server's own readiness stays that of the queue,
    which takes work with no worker alive."""
    ctx = _ctx()
    try:
        registry.get_model(ctx["store"], f"{name}@{version}" if version else name)
    except ModelNotFound:
        return jsonify({"name": name, "ready": False}), 404
    if not workers.live_stream_slots(ctx["store"], now=time.time(),
                                     timeout=ctx["settings"].scheduler.worker_heartbeat_timeout):
        return jsonify({"name": name, "ready": False,
                        "error": "no worker is alive to run it; start one (sitsctl worker, or sitsctl up)"}), 400
    return jsonify({"name": name, "ready": True})


@v2.get("/v2/models/stats")
@v2.get("/v2/models/<name>/stats")
@v2.get("/v2/models/<name>/versions/<version>/stats")
def model_statistics(name: str | None = None, version: str | None = None) -> Any:
    """Triton's statistics extension: every registered model version's online request statistics
    (`broker.model_stats`), or one model's versions, or one version. They count every tenant's
    requests, so, as GET /metrics, `metrics` keys and admins read them. (A model named 'stats' keeps
    its metadata at `.../versions/{v}`: `/v2/models/stats` is this route, as in Triton.)"""
    require_role(g.identity, "metrics")
    store = _ctx()["store"]
    if version is not None:
        record = registry.get_model(store, f"{name}@{version}")
        versions = [(record["name"], record["version"])]
    else:
        versions = [(record["name"], record["version"]) for record in registry.list_model_versions(store, name)]
        if name is not None and not versions:
            raise ModelNotFound(f"model '{name}' is not registered")
    return jsonify({"model_stats": model_stats.model_statistics(store, versions)})


@v2.get("/v2/models/<name>/config")
@v2.get("/v2/models/<name>/versions/<version>/config")
def model_config(name: str, version: str | None = None) -> Any:
    """Triton's model configuration extension: what SITS knows of the model, as a Triton config."""
    ctx = _ctx()
    record = registry.get_model(ctx["store"], f"{name}@{version}" if version else name)
    return jsonify(triton_config(record, services.model_batching(ctx["settings"], record)))


def triton_config(record: dict[str, Any], batching: Batching) -> dict[str, Any]:
    """The Triton model configuration (model_config.proto as JSON) of a registry `record` whose
    workers batch it under `batching`.

    Every SITS model batches along axis 0 (`sits_worker.model.servable`), so `max_batch_size` is the
    one workers apply and `dims` leave the batch axis out, as Triton's do for a batching model.
    """
    def tensor(entry: dict[str, Any]) -> dict[str, Any]:
        # (a dtype the protocol has no name for, complex64, is TYPE_INVALID: a name Triton's enum has)
        return {"name": entry["name"], "data_type": f"TYPE_{NUMPY_TO_V2[entry['dtype']]}"
                if entry["dtype"] in NUMPY_TO_V2 else "TYPE_INVALID", "dims": _dims(entry["shape"][1:])}

    return {"name": record["name"], "platform": "onnxruntime_onnx", "backend": "onnxruntime",
            "max_batch_size": batching.max_batch_size,
            "input": [tensor(entry) for entry in record["signature"]["inputs"]],
            "output": [tensor(entry) for entry in record["signature"]["outputs"]],
            "dynamic_batching": {"max_queue_delay_microseconds": round(batching.max_queue_delay * 1_000_000),
                                 "preferred_batch_size": list(batching.preferred_batch_sizes),
                                 "priority_levels": PRIORITY_LEVELS, "default_priority_level": PRIORITY_LEVELS}}


@dataclass(frozen=True)
class InferRequest:
    """A v2 `infer` body, checked whole: nothing is queued until every field is known to be right."""

    model: str
    inputs: dict[str, np.ndarray]
    priority: int
    deadline_ms: float | None
    user_tier: str
    outputs: list[str]
    """Requested output names, all checked against the model's; empty means every output."""
    binary_outputs: frozenset[str]
    """The requested outputs to answer in binary (`binary_data`, else the request's `binary_data_output`)."""
    binary_by_default: bool
    """The request's `binary_data_output`: with no `outputs` listed, it says how every output is answered."""
    client_id: str | None

    def wants_binary(self, output: str) -> bool:
        """Whether `output` is answered as binary data after the JSON header rather than as JSON `data`."""
        return output in self.binary_outputs if self.outputs else self.binary_by_default


@v2.post("/v2/models/<name>/infer")
@v2.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: str | None = None) -> Any:
    """Run one inference request through the scheduler and answer with its outputs."""
    ctx = _ctx()
    settings, store = ctx["settings"], ctx["store"]
    header, binary = v2_binary.split_body(request_body(), request.headers.get(v2_binary.HEADER_LENGTH))
    body = parse_object(header, "a JSON object with an 'inputs' list of {name, shape, datatype, data}")
    checked = parse_infer_request(store, body, f"{name}@{version}" if version else name, binary)
    spec = request_intake.submit(settings, store, ctx["dispatcher"], ctx["policy"], model=checked.model,
                                 inputs=checked.inputs, priority=checked.priority, deadline_ms=checked.deadline_ms,
                                 user_tier=checked.user_tier, tokens=None, owner=g.identity["name"],
                                 now=time.time(), expire_at_deadline=True)
    began = time.monotonic()
    result = requests.wait_for_request(store, spec.request_id,
                                       timeout=request_intake.wait_seconds(settings, checked.deadline_ms))
    timed_out = checked.deadline_ms is not None and checked.deadline_ms / 1000 <= settings.online.max_wait
    if result is None and timed_out:
        # Its timeout passed. A worker that took it in time runs it (one that takes it later does not):
        # then its answer comes, as Triton gives it, within online.max_wait in all.
        running = requests.running(store, spec)
        left = settings.online.max_wait - (time.monotonic() - began) if running else _JUST_DONE_SECONDS
        result = requests.wait_for_request(store, spec.request_id, timeout=max(left, _JUST_DONE_SECONDS))
        if result is None and not running:
            raise InferenceTimeout(f"request {spec.request_id} was not taken by a worker within its 'timeout'; "
                                   "it is not run (give it a longer timeout, or retry when the queue is shorter)")
    if result is None:
        raise InferenceTimeout(f"request {spec.request_id} is not done within the server's online.max_wait; it "
                               f"still runs, and GET /v1/requests/{spec.request_id} shows its result")
    if result["status"] != "succeeded":  # answered with the status of the error that failed it
        # (a request failed by a worker of a release before error codes: a 400, as it was then)
        raise error_for_code(result["error_code"] or BadInput.code, result["error"] or "the request failed")
    return _answer({"model_name": spec.model_name, "model_version": spec.model_version,
                    "id": spec.request_id if checked.client_id is None else checked.client_id},
                   {output: result["outputs"][output] for output in checked.outputs or result["outputs"]}, checked)


_JUST_DONE_SECONDS = 0.05
"""How long a waiter whose request's timeout passed looks for an answer that came just then."""


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


def parse_infer_request(store: Store, body: dict[str, Any], model: str, binary: BinaryData | None = None
                        ) -> InferRequest:
    """Check a v2 `infer` body for `model` (`name` or `name@version`) and return it typed.

    `binary` holds the bytes after the JSON header, for inputs sent with `binary_data_size`.
    Requested outputs are checked against the registered model, and the request is then pinned to
    that version, so a version registered in between cannot answer with other outputs.
    """
    if not isinstance(body.get("inputs"), list):
        raise BadInput("the body must be a JSON object with an 'inputs' list of {name, shape, datatype, data}")
    client_id = _optional(body, "id", str, "a string")
    parameters = _optional(body, "parameters", dict, "an object of named parameters") or {}
    priority = sits_level(_int_parameter(parameters, "priority", 0, 0, 2**64 - 1))  # (Triton's is a uint64)
    timeout_us = _int_parameter(parameters, "timeout", 0, 0, 10**12)
    user_tier = parameters.get("user_tier", "free")
    if not isinstance(user_tier, str) or user_tier not in SLA_WEIGHTS:  # the tiers of v1's OnlineRequest
        raise BadInput(f"parameter 'user_tier' must be one of {', '.join(SLA_WEIGHTS)}, got {user_tier!r}")
    binary_by_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_by_default, bool):
        raise BadInput(f"parameter 'binary_data_output' must be true or false, got {binary_by_default!r}")
    inputs = _inputs(body["inputs"], binary or BinaryData(b""))
    requested = _requested_outputs(_optional(body, "outputs", list, "a list of {\"name\": ...} objects") or [],
                                   binary_by_default)
    outputs = list(requested)
    if outputs:
        record, _ = request_intake.model_record(store, model, now=time.time())  # cached: most clients name outputs
        model = f"{record['name']}@{record['version']}"
        known = [entry["name"] for entry in record["signature"]["outputs"]]
        unknown = [output for output in outputs if output not in known]
        if unknown:
            raise BadInput(f"unknown outputs {unknown} in 'outputs'; model '{model}' has outputs {known}")
    return InferRequest(model=model, inputs=inputs, priority=priority,
                        deadline_ms=timeout_us / 1000 if timeout_us else None, user_tier=user_tier,
                        outputs=outputs, binary_outputs=frozenset(o for o in outputs if requested[o]),
                        binary_by_default=binary_by_default, client_id=client_id)


def _optional(body: dict[str, Any], field: str, kind: type, described: str) -> Any:
    """`body[field]` when it is a `kind`; None when absent or null (clients that spell an unset field as null)."""
    value = body.get(field)
    if value is not None and not isinstance(value, kind):
        raise BadInput(f"'{field}' must be {described}, got {value!r}")
    return value


def _int_parameter(parameters: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = parameters.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadInput(f"parameter '{name}' must be an integer from {low} to {high}, got {value!r}")
    return value


def _inputs(entries: list[Any], binary: BinaryData) -> dict[str, np.ndarray]:
    """The request's input tensors by name; each name at most once, every byte of `binary` used."""
    tensors: dict[str, np.ndarray] = {}
    for index, entry in enumerate(entries):
        array = _tensor(entry, f"inputs[{index}]", binary)
        if entry["name"] in tensors:
            raise BadInput(f"input '{entry['name']}' is given more than once in 'inputs'; send each input once")
        tensors[entry["name"]] = array
    binary.check_all_taken()
    return tensors


def _requested_outputs(entries: list[Any], binary_by_default: bool) -> dict[str, bool]:
    """The names in a request's `outputs` list, each at most once, with whether it is wanted in binary."""
    requested: dict[str, bool] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadInput(f"outputs[{index}] must be an object with a string 'name', e.g. {{\"name\": \"logits\"}}; "
                           f"got {entry!r}")
        name = entry["name"]
        if name in requested:
            raise BadInput(f"output '{name}' is requested more than once in 'outputs'")
        parameters = _parameters(entry, f"output '{name}'")
        if "classification" in parameters:
            raise BadInput(f"output '{name}' asks for classification, which this server does not offer; request "
                           f"the tensor and take the top classes from it")
        requested[name] = parameters.get("binary_data", binary_by_default)
        if not isinstance(requested[name], bool):
            raise BadInput(f"output '{name}' parameter 'binary_data' must be true or false, got {requested[name]!r}")
    return requested


def _parameters(entry: dict[str, Any], owner: str) -> dict[str, Any]:
    """The `parameters` of an input or output entry ({} when absent); `owner` names it in errors."""
    parameters = entry.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise BadInput(f"{owner} 'parameters' must be an object of named parameters, got {parameters!r}")
    if "shared_memory_region" in parameters:  # Triton's shared-memory extension: data outside the body
        raise BadInput(f"{owner} names a shared memory region, which this server does not offer; send the data "
                       f"in the body (JSON or binary)")
    return parameters


def _tensor(entry: Any, where: str, binary: BinaryData) -> np.ndarray:
    """A v2 input tensor as a numpy array of its declared datatype and shape, from its JSON `data` or,
    with `binary_data_size`, from the next bytes of `binary`; `where` names it in errors."""
    if not isinstance(entry, dict) or not {"name", "shape", "datatype"} <= set(entry):
        raise BadInput(f"{where} must be an object with name, shape, datatype and data; got {entry!r}")
    name, datatype, shape = entry["name"], entry["datatype"], entry["shape"]
    if not isinstance(name, str):
        raise BadInput(f"{where}.name must be a string, got {name!r}")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise BadInput(f"input '{name}' has datatype {datatype!r}; use one of {', '.join(DATATYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise BadInput(f"input '{name}' shape must be a list of non-negative integers, got {shape!r}")
    check_buildable(f"input '{name}'", shape, np.dtype(DATATYPES[datatype]).itemsize)
    size = v2_binary.binary_data_size(_parameters(entry, f"input '{name}'"), name)
    if size is not None:
        if "data" in entry:
            raise BadInput(f"input '{name}' has both data and parameters.binary_data_size; give one of them")
        return v2_binary.tensor_from_bytes(name, binary.take(name, size), datatype, np.dtype(DATATYPES[datatype]),
                                           shape)
    if "data" not in entry:
        raise BadInput(f"input '{name}' has no data: give data (a list of {datatype} values) or "
                       f"parameters.binary_data_size with its bytes after the JSON header ({v2_binary.HEADER_LENGTH})")
    if not isinstance(entry["data"], list):
        raise BadInput(f"input '{name}' data must be a list of {datatype} values, got {entry['data']!r}")
    converted = exact_numbers(entry["data"], np.dtype(DATATYPES[datatype]))  # (inf: refused with the tensors)
    if converted is None:
        values = "true or false" if datatype == "BOOL" else f"numbers that fit {datatype} exactly"
        raise BadInput(f"input '{name}' data are not {datatype} values: write a flat or nested list of {values}")
    array = converted[1]
    if array.size != math.prod(shape):
        raise BadInput(f"input '{name}' has {array.size} values but shape {shape} needs {math.prod(shape)}")
    return array.reshape(shape)
