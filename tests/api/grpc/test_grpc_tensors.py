"""Tensors between gRPC messages and numpy: raw and typed input contents, raw output contents.

Requests are built by tritonclient's own request builder and answers read back by its own result
reader, so both ends are the client users run. Inputs are then checked by the HTTP path's parser,
as the server does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult, service_pb2
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import serialize_byte_tensor

from broker.errors import BadInput, PayloadTooLarge
from broker.state.store import Store
from sits_api.grpc.messages import infer_response, parameter_values, v2_body
from sits_api.grpc.tensors import raw_from_contents
from sits_api.v2.parsing import parse_infer_request

NUMERIC = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
           "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
           "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
TYPED = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
         "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
         "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}


def sample(datatype: str) -> np.ndarray:
    """Six values of `datatype` in a 2x3 array, the type's extremes among them."""
    dtype = np.dtype(NUMERIC[datatype])
    if dtype.kind == "b":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind == "f":
        info = np.finfo(dtype)
        return np.array([[info.min, -1.5, 0.0], [0.25, 3.0, info.max]], dtype=dtype)
    ints = np.iinfo(dtype)
    return np.array([[ints.min, 0, 1], [7, ints.max - 1, ints.max]], dtype=dtype)


def request_of(*tensors: InferInput, **kwargs: Any) -> Any:
    return _get_inference_request("m", list(tensors), "", "", kwargs.get("outputs"), 0, False, False,
                                  kwargs.get("priority", 0), kwargs.get("timeout"), kwargs.get("parameters"))


@pytest.fixture
def parsed(store: Store, mlp: dict[str, Any]) -> Callable[[Any], dict[str, np.ndarray]]:
    """The inputs of a request, as the server reads them: its v2 body through the HTTP path's parser,
    for a registered model (the parser reads tensors of any name and type; `submit` checks them
    against the model's signature later)."""
    def parse(request: Any) -> dict[str, np.ndarray]:
        body, binary = v2_body(request)
        return parse_infer_request(store, body, "mlp", binary).inputs

    return parse


@pytest.mark.parametrize("datatype", list(NUMERIC))
def test_raw_input_contents_read_back_as_the_array_sent(datatype: str, parsed: Any) -> None:
    array = sample(datatype)
    tensor = InferInput("x", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)  # raw_input_contents, as tritonclient always sends

    [(name, read)] = parsed(request_of(tensor)).items()

    assert name == "x" and read.dtype == array.dtype
    np.testing.assert_array_equal(read, array)


@pytest.mark.parametrize("datatype", list(TYPED))
def test_typed_contents_read_back_as_the_same_array_as_raw_contents(datatype: str, parsed: Any) -> None:
    array = sample(datatype)
    request = service_pb2.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[2, 3])
    getattr(tensor.contents, TYPED[datatype]).extend(array.ravel().tolist())

    read = parsed(request)["x"]

    assert read.dtype == array.dtype
    np.testing.assert_array_equal(read, array)


def test_fp16_has_no_typed_contents_and_is_refused_saying_to_send_it_raw() -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="half", datatype="FP16", shape=[1]).contents.fp32_contents.append(1.0)

    with pytest.raises(BadInput, match="input 'half' is FP16, which has no typed contents.*raw_input_contents"):
        v2_body(request)


def test_bytes_contents_are_length_prefixed_as_tritonclient_serializes_them() -> None:
    elements = [b"", b"abc", "\u00e9t\u00e9".encode(), b"\x00\xff"]
    contents = service_pb2.InferTensorContents(bytes_contents=elements)

    raw = raw_from_contents("s", "BYTES", [4], contents)

    assert raw == serialize_byte_tensor(np.array(elements, dtype=np.object_)).item()


def test_a_bytes_input_is_refused_as_over_http_with_the_datatypes_it_takes(parsed: Any) -> None:
    tensor = InferInput("s", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([b"a", b"bc"], dtype=np.object_))

    with pytest.raises(BadInput, match="input 's' has datatype 'BYTES'; use one of FP32"):
        parsed(request_of(tensor))


@pytest.mark.parametrize(("field", "values", "problem"), [
    ("int_contents", [1, 300], "do not fit INT8"),
    ("fp32_contents", [1.0, 2.0], "its values go in contents.int_contents, not contents.fp32_contents"),
    ("int_contents", [1, 2, 3], "has 3 values in contents.int_contents but shape \\[2\\] needs 2"),
])
def test_typed_contents_that_do_not_fit_their_datatype_are_refused_naming_the_fix(
        field: str, values: list[Any], problem: str) -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    getattr(request.inputs.add(name="x", datatype="INT8", shape=[2]).contents, field).extend(values)

    with pytest.raises(BadInput, match=problem):
        v2_body(request)


def test_raw_and_typed_contents_are_not_mixed_and_raw_contents_come_one_per_input() -> None:
    first, second = InferInput("a", [1], "INT32"), InferInput("b", [1], "INT32")
    first.set_data_from_numpy(np.array([1], dtype=np.int32))
    second.set_data_from_numpy(np.array([2], dtype=np.int32))
    mixed = request_of(first, second)
    mixed.inputs[1].contents.int_contents.append(2)
    with pytest.raises(BadInput, match="input 'b' has contents, but the request sends raw_input_contents"):
        v2_body(mixed)

    short = request_of(first, second)
    del short.raw_input_contents[1]
    with pytest.raises(BadInput, match="2 inputs but 1 raw_input_contents"):
        v2_body(short)


def test_a_raw_input_whose_bytes_do_not_fit_its_shape_gets_the_http_paths_message(parsed: Any) -> None:
    tensor = InferInput("x", [2, 3], "FP32")
    tensor.set_data_from_numpy(np.zeros((2, 3), dtype=np.float32))
    tensor._get_tensor().shape[:] = [2, 4]

    with pytest.raises(BadInput, match=r"input 'x' has 24 bytes of binary data, but FP32 \[2, 4\] takes 32"):
        parsed(request_of(tensor))


def test_priority_timeout_outputs_and_id_reach_the_v2_body() -> None:
    tensor = InferInput("x", [1], "FP32")
    tensor.set_data_from_numpy(np.ones(1, dtype=np.float32))
    request = request_of(tensor, priority=2, timeout=1500, parameters={"user_tier": "vip"},
                         outputs=[InferRequestedOutput("y")])
    request.id = "r-1"

    body, _ = v2_body(request)

    assert body["parameters"] == {"priority": 2, "timeout": 1500, "user_tier": "vip"}
    assert body["id"] == "r-1" and body["outputs"] == [{"name": "y", "parameters": {}}]
    assert parameter_values(request.parameters)["priority"] == 2


@pytest.mark.parametrize("datatype", [*NUMERIC, "BYTES"])
def test_outputs_go_back_as_raw_contents_tritonclient_reads(datatype: str) -> None:
    array = np.array([[b"x", b""], [b"yz", b"\x00"]], dtype=np.object_) if datatype == "BYTES" else sample(datatype)

    response = infer_response("m", "2", "r-1", {"out": array})

    assert response.outputs[0].datatype == datatype and list(response.outputs[0].shape) == list(array.shape)
    read = InferResult(response).as_numpy("out")
    assert read.dtype == array.dtype
    np.testing.assert_array_equal(read, array)


def test_typed_contents_that_would_take_more_than_a_body_once_decoded_are_refused_before_decoding() -> None:
    contents = service_pb2.InferTensorContents()
    contents.int64_contents.extend([1] * 1_000)  # one byte each on the wire, eight decoded
    assert contents.ByteSize() < 2_000
    with pytest.raises(PayloadTooLarge, match=r"1,000 values in contents.int64_contents, 8,000 bytes decoded"):
        raw_from_contents("x", "INT64", [1_000], contents, max_bytes=4_096)
    assert len(raw_from_contents("x", "INT64", [1_000], contents, max_bytes=8_000)) == 8_000
