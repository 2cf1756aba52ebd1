"""The Open Inference Protocol (KServe v2, as Triton speaks it) over the same queues.

Existing v2 JSON clients work unchanged: health, model metadata and
readiness, and `infer` with `inputs: [{name, shape, datatype, data}]`.
Triton's schedule-policy parameters are honoured: `priority` (here a SITS
level, 0-15, higher is more urgent) and `timeout` (microseconds, the
request's tolerable delay). Errors use the protocol's `{"error": "..."}`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flask import Blueprint, g, jsonify, request

from broker import registry, requests
from broker.errors import BadInput, InferenceTimeout, ModelNotFound
from sits_api import online

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


@v2.post("/v2/models/<name>/infer")
@v2.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: str | None = None) -> Any:
    """Run one inference request through the scheduler and answer with its outputs."""
    ctx = _ctx()
    settings, store = ctx["settings"], ctx["store"]
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise BadInput("the body must be a JSON object with an 'inputs' list of {name, shape, datatype, data}")
    parameters = body.get("parameters") or {}
    priority = _int_parameter(parameters, "priority", 0, 0, 15)
    timeout_us = _int_parameter(parameters, "timeout", 0, 0, 10**12)
    deadline_ms = timeout_us / 1000 if timeout_us else None
    spec = online.submit(settings, store, ctx["dispatcher"], ctx["policy"],
                         model=f"{name}@{version}" if version else name,
                         inputs={entry.get("name"): _tensor(entry) for entry in body["inputs"]},
                         priority=priority, deadline_ms=deadline_ms,
                         user_tier=str(parameters.get("user_tier", "free")) if parameters.get("user_tier") in (
                             "vip", "premium", "free") else "free",
                         tokens=None, owner=g.identity["name"], now=time.time())
    result = requests.wait_for_request(store, spec.request_id, timeout=online.wait_seconds(settings, deadline_ms))
    if result is None:
        raise InferenceTimeout(f"request {spec.request_id} is not done yet; fetch it later with "
                               f"GET /v1/requests/{spec.request_id}")
    if result["status"] != "succeeded":
        raise BadInput(result["error"] or "the request failed")
    wanted = [entry.get("name") for entry in body.get("outputs") or []] or list(result["outputs"])
    unknown = set(wanted) - set(result["outputs"])
    if unknown:
        raise BadInput(f"unknown outputs {sorted(unknown)}; the model has {list(result['outputs'])}")
    outputs = [{"name": output, "datatype": NUMPY_TO_V2.get(result["outputs"][output].dtype.name, "BYTES"),
                "shape": list(result["outputs"][output].shape), "data": result["outputs"][output].ravel().tolist()}
               for output in wanted]
    return jsonify({"model_name": spec.model_name, "model_version": spec.model_version,
                    "id": body.get("id", spec.request_id), "outputs": outputs})


def _int_parameter(parameters: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = parameters.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadInput(f"parameter '{name}' must be an integer from {low} to {high}, got {value!r}")
    return value


def _tensor(entry: Any) -> np.ndarray:
    """A v2 JSON tensor as a numpy array of its declared datatype and shape."""
    if not isinstance(entry, dict) or not {"name", "shape", "datatype", "data"} <= set(entry):
        raise BadInput("each input needs name, shape, datatype and data")
    name, datatype = entry["name"], entry["datatype"]
    if datatype not in DATATYPES:
        raise BadInput(f"input '{name}' has datatype {datatype!r}; use one of {', '.join(DATATYPES)}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise BadInput(f"input '{name}' shape must be a list of non-negative integers, got {shape!r}")
    try:
        array = np.asarray(entry["data"], dtype=DATATYPES[datatype])
    except (ValueError, TypeError, OverflowError) as err:
        raise BadInput(f"input '{name}' data are not {datatype} values ({err})") from err
    if array.size != int(np.prod(shape)):
        raise BadInput(f"input '{name}' has {array.size} values but shape {shape} needs {int(np.prod(shape))}")
    return array.reshape(shape)
