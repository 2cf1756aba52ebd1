"""A gRPC `ModelInferRequest` as the HTTP path's v2 body, and its answer as a `ModelInferResponse`.

The request becomes the JSON body and binary data that `sits_api.v2.parsing` checks for HTTP, so a
request is refused over gRPC exactly when, and with the message with which, it is refused over HTTP.
Its parameters (Triton's `priority` and `timeout`, SITS's `user_tier`) are read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from broker.errors import BadInput
from sits_api.grpc.tensors import output_datatype, raw_from_contents, raw_output
from sits_api.v2.binary import BinaryData


def parameter_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf `map<string, InferParameter>` as plain values (bool, int, float or str)."""
    values: dict[str, Any] = {}
    for name, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        values[name] = getattr(parameter, kind) if kind is not None else None
    return values


def v2_body(request: Any, *, max_bytes: int = 0) -> tuple[dict[str, Any], BinaryData]:
    """The v2 JSON body and binary data that say what `request` (a `ModelInferRequest`) says: each
    input with `binary_data_size`, its raw contents (or its typed contents made raw) in the binary data.
    Typed contents may take at most `max_bytes` decoded, all inputs together (0: no cap)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadInput(f"the request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents; give one "
                       f"raw_input_contents per input, in the order of the inputs, or use contents for every input")
    inputs, data = [], []
    decoded = 0
    for index, tensor in enumerate(request.inputs):
        shape = list(tensor.shape)
        if raw:
            if tensor.HasField("contents"):
                raise BadInput(f"input '{tensor.name}' has contents, but the request sends raw_input_contents; "
                               "send every input in one of the two")
            data.append(raw[index])
        else:
            if any(dim < 0 for dim in shape):  # (the parser says so; the values cannot be counted before)
                data.append(b"")
            else:
                data.append(raw_from_contents(tensor.name, tensor.datatype, shape, tensor.contents,
                                              max_bytes=max(max_bytes - decoded, 1) if max_bytes else 0))
                decoded += len(data[-1])
        inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": shape,
                       "parameters": parameter_values(tensor.parameters) | {"binary_data_size": len(data[-1])}})
    body: dict[str, Any] = {"inputs": inputs, "parameters": parameter_values(request.parameters)}
    if request.id:
        body["id"] = request.id
    if request.outputs:
        body["outputs"] = [{"name": output.name, "parameters": parameter_values(output.parameters)}
                           for output in request.outputs]
    return body, BinaryData(b"".join(data))


def infer_response(model_name: str, model_version: str, request_id: str,
                   outputs: dict[str, np.ndarray]) -> Any:
    """The `ModelInferResponse` of a finished request: every output as raw contents."""
    response = service_pb2.ModelInferResponse(model_name=model_name, model_version=model_version, id=request_id)
    for name, array in outputs.items():
        response.outputs.add(name=name, datatype=output_datatype(array), shape=array.shape)
        response.raw_output_contents.append(raw_output(array))
    return response
