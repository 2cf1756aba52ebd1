"""A v2 `infer` body, parsed and checked whole before anything is queued.

The protocol's tensors (`{name, shape, datatype, data}`, or binary data after the JSON header:
`sits_api/v2/binary.py`), Triton's `priority` and `timeout` parameters as SITS levels and
deadlines, and the outputs asked for, each refused with a message that says what to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from broker.errors import BadInput, ModelNotFound
from broker.models.repository import RepositoryServing
from broker.queueing.scoring import SLA_WEIGHTS
from broker.setting_types import UserTier
from broker.state.store import Store
from sits_api.intake import requests as request_intake
from sits_api.v2 import binary as v2_binary
from sits_api.v2.binary import BinaryData
from sits_worker.model.tensors import check_buildable, exact_numbers

DATATYPES = {"FP32": "float32", "FP64": "float64", "FP16": "float16", "INT64": "int64", "INT32": "int32",
             "INT16": "int16", "INT8": "int8", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
             "UINT64": "uint64", "BOOL": "bool"}
NUMPY_TO_V2 = {numpy_name: v2_name for v2_name, numpy_name in DATATYPES.items()}
PRIORITY_LEVELS = 16
"""SITS's priority levels (0-15), as Triton's `priority_levels`: Triton priority 1 is SITS level 15."""


def sits_level(triton_priority: int) -> int:
    """Triton's `priority` as a SITS level. Triton counts down from 1, the most urgent (SITS level 15),
    to `priority_levels` (16: level 0); 0 asks for the default, and so does a value past the last
    level, as Triton treats it. The default is SITS's: level 0, the least urgent, as a v1 request
    that names no priority gets."""
    return PRIORITY_LEVELS - triton_priority if 1 <= triton_priority <= PRIORITY_LEVELS else 0


@dataclass(frozen=True)
class InferRequest:
    """A v2 `infer` body, checked whole: nothing is queued until every field is known to be right."""

    model: str
    inputs: dict[str, np.ndarray]
    priority: int
    deadline_ms: float | None
    user_tier: UserTier
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
    priority = _model_level(store, model, _int_parameter(parameters, "priority", 0, 0, 2**64 - 1))  # (a uint64)
    timeout_us = _int_parameter(parameters, "timeout", 0, 0, 10**12)
    user_tier = parameters.get("user_tier", "free")
    if not isinstance(user_tier, str) or user_tier not in SLA_WEIGHTS:  # the tiers of v1's OnlineRequest
        raise BadInput(f"parameter 'user_tier' must be one of {', '.join(SLA_WEIGHTS)}, got {user_tier!r}")
    tier = cast(UserTier, user_tier)
    binary_by_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_by_default, bool):
        raise BadInput(f"parameter 'binary_data_output' must be true or false, got {binary_by_default!r}")
    inputs = _inputs(body["inputs"], binary or BinaryData(b""))
    requested = _requested_outputs(_optional(body, "outputs", list, "a list of {\"name\": ...} objects") or [],
                                   binary_by_default)
    outputs = list(requested)
    if outputs:
        record, _ = request_intake.model_record(store, model)  # cached: most clients name outputs
        model = record.ref
        known = record.output_names
        unknown = [output for output in outputs if output not in known]
        if unknown:
            raise BadInput(f"unknown outputs {unknown} in 'outputs'; model '{model}' has outputs {known}")
    return InferRequest(model=model, inputs=inputs, priority=priority,
                        deadline_ms=timeout_us / 1000 if timeout_us else None, user_tier=tier,
                        outputs=outputs, binary_outputs=frozenset(o for o in outputs if requested[o]),
                        binary_by_default=binary_by_default, client_id=client_id)


def _model_level(store: Store, model: str, triton_priority: int) -> int:
    """A request's Triton `priority` as a SITS level: by the `priority_levels` of its config for a model
    loaded from a Triton model repository (`RepositoryServing.level_of`), else by `sits_level`."""
    try:
        serving = RepositoryServing.of(request_intake.model_record(store, model)[0])
    except ModelNotFound:  # (refused where the request is queued, with the models there are)
        serving = None
    return serving.level_of(triton_priority) if serving is not None else sits_level(triton_priority)


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
