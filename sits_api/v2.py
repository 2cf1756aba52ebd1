"""The Open Inference Protocol (KServe v2, as Triton speaks it) over the same queues.

Existing v2 JSON clients work unchanged: health, model metadata and
readiness, and `infer` with `inputs: [{name, shape, datatype, data}]`.
Triton's schedule-policy parameters are honoured: `priority` (here a SITS
level, 0-15, higher is more urgent) and `timeout` (microseconds, the
request's tolerable delay), as is SITS's `user_tier` (vip, premium or free, as in
v1). Errors use the protocol's `{"error": "..."}`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from flask import Blueprint, g, jsonify

from broker import registry, requests
from broker.errors import BadInput, InferenceTimeout, ModelNotFound
from broker.scoring import SLA_WEIGHTS
from broker.store import Store
from sits_api import online
from sits_api.jsonio import request_object
from sits_worker.model.tensors import exact_numbers

v2 = Blueprint("v2", __name__)

DATATYPES = {"FP32": "float32", "FP64": "float64", "FP16": "float16", "INT64": "int64", "INT32": "int32",
             "INT16": "int16", "INT8": "int8", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
             "UINT64": "uint64", "BOOL": "bool"}
NUMPY_TO_V2 = {numpy_name: v2_name for v2_name, numpy_name in DATATYPES.items()}


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


def _metadata(record: dict[str, Any]) -> dict[str, Any]:
    def tensor(entry: dict[str, Any]) -> dict[str, Any]:
        shape = [dim if isinstance(dim, int) else -1 for dim in entry["shape"]]
        return {"name": entry["name"], "datatype": NUMPY_TO_V2.get(entry["dtype"], entry["dtype"]), "shape": shape}

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
    """Registered means ready: any worker loads it on first use."""
    try:
        registry.get_model(_ctx()["store"], f"{name}@{version}" if version else name)
    except ModelNotFound:
        return jsonify({"name": name, "ready": False}), 404
    return jsonify({"name": name, "ready": True})


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
    client_id: str | None


@v2.post("/v2/models/<name>/infer")
@v2.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: str | None = None) -> Any:
    """Run one inference request through the scheduler and answer with its outputs."""
    ctx = _ctx()
    settings, store = ctx["settings"], ctx["store"]
    body = request_object("a JSON object with an 'inputs' list of {name, shape, datatype, data}")
    checked = parse_infer_request(store, body, f"{name}@{version}" if version else name)
    spec = online.submit(settings, store, ctx["dispatcher"], ctx["policy"], model=checked.model,
                         inputs=checked.inputs, priority=checked.priority, deadline_ms=checked.deadline_ms,
                         user_tier=checked.user_tier, tokens=None, owner=g.identity["name"], now=time.time())
    result = requests.wait_for_request(store, spec.request_id,
                                       timeout=online.wait_seconds(settings, checked.deadline_ms))
    if result is None:
        raise InferenceTimeout(f"request {spec.request_id} is not done yet; fetch it later with "
                               f"GET /v1/requests/{spec.request_id}")
    if result["status"] != "succeeded":
        raise BadInput(result["error"] or "the request failed")
    outputs = [{"name": output, "datatype": NUMPY_TO_V2.get(result["outputs"][output].dtype.name, "BYTES"),
                "shape": list(result["outputs"][output].shape), "data": result["outputs"][output].ravel().tolist()}
               for output in checked.outputs or result["outputs"]]
    return jsonify({"model_name": spec.model_name, "model_version": spec.model_version,
                    "id": spec.request_id if checked.client_id is None else checked.client_id, "outputs": outputs})


def parse_infer_request(store: Store, body: dict[str, Any], model: str) -> InferRequest:
    """Check a v2 `infer` body for `model` (`name` or `name@version`) and return it typed.

    Requested outputs are checked against the registered model, and the request is then pinned to
    that version, so a version registered in between cannot answer with other outputs.
    """
    if not isinstance(body.get("inputs"), list):
        raise BadInput("the body must be a JSON object with an 'inputs' list of {name, shape, datatype, data}")
    client_id = _optional(body, "id", str, "a string")
    parameters = _optional(body, "parameters", dict, "an object of named parameters") or {}
    priority = _int_parameter(parameters, "priority", 0, 0, 15)
    timeout_us = _int_parameter(parameters, "timeout", 0, 0, 10**12)
    user_tier = parameters.get("user_tier", "free")
    if not isinstance(user_tier, str) or user_tier not in SLA_WEIGHTS:  # the tiers of v1's OnlineRequest
        raise BadInput(f"parameter 'user_tier' must be one of {', '.join(SLA_WEIGHTS)}, got {user_tier!r}")
    inputs = _inputs(body["inputs"])
    outputs = _output_names(_optional(body, "outputs", list, "a list of {\"name\": ...} objects") or [])
    if outputs:
        record, _ = online.model_record(store, model, now=time.time())  # cached: most clients name outputs
        model = f"{record['name']}@{record['version']}"
        known = [entry["name"] for entry in record["signature"]["outputs"]]
        unknown = [output for output in outputs if output not in known]
        if unknown:
            raise BadInput(f"unknown outputs {unknown} in 'outputs'; model '{model}' has outputs {known}")
    return InferRequest(model=model, inputs=inputs, priority=priority,
                        deadline_ms=timeout_us / 1000 if timeout_us else None, user_tier=user_tier,
                        outputs=outputs, client_id=client_id)


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


def _inputs(entries: list[Any]) -> dict[str, np.ndarray]:
    """The request's input tensors by name; each name at most once."""
    tensors: dict[str, np.ndarray] = {}
    for index, entry in enumerate(entries):
        array = _tensor(entry, f"inputs[{index}]")
        if entry["name"] in tensors:
            raise BadInput(f"input '{entry['name']}' is given more than once in 'inputs'; send each input once")
        tensors[entry["name"]] = array
    return tensors


def _output_names(entries: list[Any]) -> list[str]:
    """The names in a request's `outputs` list, each at most once."""
    names: list[str] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadInput(f"outputs[{index}] must be an object with a string 'name', e.g. {{\"name\": \"logits\"}}; "
                           f"got {entry!r}")
        if entry["name"] in names:
            raise BadInput(f"output '{entry['name']}' is requested more than once in 'outputs'")
        names.append(entry["name"])
    return names


def _tensor(entry: Any, where: str) -> np.ndarray:
    """A v2 JSON tensor as a numpy array of its declared datatype and shape; `where` names it in errors."""
    if not isinstance(entry, dict) or not {"name", "shape", "datatype", "data"} <= set(entry):
        raise BadInput(f"{where} must be an object with name, shape, datatype and data; got {entry!r}")
    name, datatype, shape = entry["name"], entry["datatype"], entry["shape"]
    if not isinstance(name, str):
        raise BadInput(f"{where}.name must be a string, got {name!r}")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise BadInput(f"input '{name}' has datatype {datatype!r}; use one of {', '.join(DATATYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise BadInput(f"input '{name}' shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(entry["data"], list):
        raise BadInput(f"input '{name}' data must be a list of {datatype} values, got {entry['data']!r}")
    converted = exact_numbers(entry["data"], np.dtype(DATATYPES[datatype]))  # (inf: refused with the tensors)
    if converted is None:
        raise BadInput(f"input '{name}' data are not {datatype} values: write a flat or nested list of "
                       f"numbers that fit {datatype} exactly")
    array = converted[1]
    if array.size != math.prod(shape):
        raise BadInput(f"input '{name}' has {array.size} values but shape {shape} needs {math.prod(shape)}")
    return array.reshape(shape)
