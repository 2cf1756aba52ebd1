"""Triton's binary tensor data extension on POST /v2/models/{name}/infer, without a worker.

Inputs read from the bytes after the JSON header keep their declared datatype and shape; a body
whose framing is wrong is a 400 in the v2 error form that says what to fix, and queues nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from werkzeug.test import TestResponse

from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.app import create_app
from sits_api.v2.binary import HEADER_LENGTH, BinaryData
from sits_api.v2.parsing import parse_infer_request
from tests.api.api_helpers import Api, error_of, make_settings, queued_items

INFER = "/v2/models/mlp/infer"
ROW = np.arange(64, dtype=np.float32).reshape(1, 64)


def binary_input(name: str = "features", shape: list[int] | None = None, datatype: str = "FP32",
                 size: Any = ROW.nbytes, **changes: Any) -> dict[str, Any]:
    """An input entry whose data follows the JSON header (by default the zoo MLP's one row)."""
    return {"name": name, "shape": shape or [1, 64], "datatype": datatype, "parameters": {"binary_data_size": size},
            **changes}


def framed(header: dict[str, Any], *tensors: bytes) -> tuple[bytes, str]:
    """A body as tritonclient frames it: the JSON header, then the tensors' bytes; and its header length."""
    text = json.dumps(header).encode()
    return text + b"".join(tensors), str(len(text))


def post_framed(api: Api, body: bytes, header_length: str | None, path: str = INFER) -> TestResponse:
    """POST `body` with no Content-Type, as tritonclient sends it."""
    headers = api.headers | ({HEADER_LENGTH: header_length} if header_length is not None else {})
    return api.client.post(path, data=body, headers=headers)


def test_binary_inputs_are_read_with_their_declared_datatype_and_shape(store: Store) -> None:
    tokens = np.array([[1, -2, 3], [2**40, 5, 6]], dtype=np.int64)
    halves = np.array([0.5, -1.25], dtype=np.float16)
    flags = np.array([[True, False, True]])
    body = {"inputs": [binary_input("tokens", [2, 3], "INT64", tokens.nbytes),
                       {"name": "scale", "shape": [1], "datatype": "FP32", "data": [2.5]},
                       binary_input("halves", [2], "FP16", halves.nbytes),
                       binary_input("flags", [1, 3], "BOOL", flags.nbytes)]}
    raw = tokens.astype("<i8").tobytes() + halves.astype("<f2").tobytes() + flags.tobytes()

    checked = parse_infer_request(store, body, "any", BinaryData(raw))

    assert list(checked.inputs) == ["tokens", "scale", "halves", "flags"]
    for name, expected in {"tokens": tokens, "halves": halves, "flags": flags}.items():
        assert checked.inputs[name].dtype == expected.dtype and checked.inputs[name].shape == expected.shape
        np.testing.assert_array_equal(checked.inputs[name], expected)
        assert checked.inputs[name].flags.writeable  # a copy, not a view of the request body
    np.testing.assert_array_equal(checked.inputs["scale"], np.array([2.5], dtype=np.float32))


@pytest.mark.parametrize(("parameters", "outputs", "binary"), [
    pytest.param({}, [], {"logits": False}, id="json-by-default"),
    pytest.param({"binary_data_output": True}, [], {"logits": True}, id="binary-data-output-for-all"),
    pytest.param({"binary_data_output": True}, [{"name": "logits", "parameters": {"binary_data": False}}],
                 {"logits": False}, id="an-output-overrides-the-request"),
    pytest.param({}, [{"name": "logits", "parameters": {"binary_data": True}}], {"logits": True},
                 id="binary-output"),
    pytest.param({"binary_data_output": True}, [{"name": "logits"}], {"logits": True}, id="listed-output-inherits"),
])
def test_outputs_are_answered_in_binary_as_the_request_asks(
        mlp: dict[str, Any], store: Store, parameters: dict[str, Any], outputs: list[dict[str, Any]],
        binary: dict[str, bool]) -> None:
    body = {"inputs": [binary_input()], "outputs": outputs, "parameters": parameters}
    checked = parse_infer_request(store, body, "mlp", BinaryData(ROW.tobytes()))
    assert {name: checked.wants_binary(name) for name in binary} == binary


def test_a_framed_body_without_content_type_is_queued(api: Api, mlp: dict[str, Any]) -> None:
    # No worker runs here: queued, it fails once its 1 ms timeout passes while it waits (and leaves the queue).
    body, length = framed({"inputs": [binary_input()], "parameters": {"timeout": 1000, "binary_data_output": True}},
                          ROW.tobytes())
    response = post_framed(api, body, length)
    assert response.status_code == 504, response.get_json()
    assert "while it waited in the queue" in error_of(response)


def test_a_json_body_without_content_type_is_queued(api: Api, mlp: dict[str, Any]) -> None:
    """tritonclient sends no Content-Type, also when every tensor is JSON (and then no header length)."""
    body = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW.ravel().tolist()}],
            "parameters": {"timeout": 1000}}
    response = post_framed(api, json.dumps(body).encode(), None)
    assert response.status_code == 504, response.get_json()
    assert "while it waited in the queue" in error_of(response)


def _bad_framings() -> list[Any]:
    good, good_length = framed({"inputs": [binary_input()]}, ROW.tobytes())
    row = ROW.tobytes()

    def of(*inputs: dict[str, Any], tensors: tuple[bytes, ...] = (row,), **fields: Any) -> tuple[bytes, str]:
        return framed({"inputs": list(inputs), **fields}, *tensors)

    return [
        pytest.param(good, str(len(good) + 1), "the body has only", id="header-length-beyond-the-body"),
        pytest.param(good, "abc", "whole number", id="header-length-not-a-number"),
        pytest.param(good, "-5", "whole number", id="header-length-negative"),
        pytest.param(good, "1e3", "whole number", id="header-length-in-exponent-form"),
        pytest.param(good, "9" * 5000, "whole number", id="header-length-too-many-digits"),
        pytest.param(good, str(int(good_length) - 1), "not valid JSON", id="header-length-cuts-the-json"),
        pytest.param(b"{not json" + row, "9", "not valid JSON", id="header-not-json"),
        pytest.param(b"[1, 2]" + row, "6", "not a JSON list", id="header-a-json-list"),
        pytest.param(good[:-4], good_length, "only 252 bytes of the body are left", id="binary-data-cut-short"),
        pytest.param(good + b"\0" * 4, good_length, "4 bytes after the binary data", id="bytes-left-over"),
        pytest.param(*of(binary_input(size=ROW.nbytes - 4), tensors=(row[:-4],)), "fix its shape or binary_data_size",
                     id="size-does-not-fit-shape"),
        pytest.param(*of(binary_input(shape=[2, 64])), "[2, 64] takes 512", id="shape-larger-than-data"),
        pytest.param(*of(binary_input(size="256")), "binary_data_size' must be a whole number", id="size-a-string"),
        pytest.param(*of(binary_input(shape=[0, 2**40, 2**40], size=0), tensors=()), "which no tensor can have",
                     id="empty-but-impossible-shape"),
        pytest.param(*of({"name": "features", "shape": [0, 2**63 - 1], "datatype": "FP32", "data": []}, tensors=()),
                     "which no tensor can have", id="empty-but-impossible-shape-as-json"),
        pytest.param(*of(binary_input(shape=[1] * 69 + [64])), "has 70 axes", id="more-axes-than-numpy-builds"),
        pytest.param(*of(binary_input(size=True)), "binary_data_size' must be a whole number", id="size-a-boolean"),
        pytest.param(*of(binary_input(size=-1)), "binary_data_size' must be a whole number", id="size-negative"),
        pytest.param(*of(binary_input(data=[0.0] * 64)), "both data and parameters.binary_data_size",
                     id="data-and-binary"),
        pytest.param(*of({"name": "features", "shape": [1, 64], "datatype": "FP32"}), "has no data",
                     id="neither-data-nor-binary"),
        pytest.param(*of(binary_input(datatype="BYTES")), "datatype 'BYTES'; use one of FP32", id="bytes-datatype"),
        pytest.param(*of(binary_input(datatype="BOOL", size=64), tensors=(b"\2" * 64,)), "0 or 1",
                     id="bool-not-0-or-1"),
        pytest.param(*of(binary_input(parameters=[256])), "'parameters' must be an object", id="input-parameters-list"),
        pytest.param(*of(binary_input(parameters={"shared_memory_region": "r", "shared_memory_byte_size": 256}),
                         tensors=()), "shared memory", id="input-shared-memory"),
        pytest.param(*of(binary_input(), outputs=[{"name": "logits", "parameters": {"binary_data": "yes"}}]),
                     "'binary_data' must be true or false", id="output-binary-data-a-string"),
        pytest.param(*of(binary_input(), outputs=[{"name": "logits", "parameters": {"classification": 3}}]),
                     "classification", id="output-classification"),
        pytest.param(*of(binary_input(), outputs=[{"name": "logits", "parameters": {"shared_memory_region": "r"}}]),
                     "shared memory", id="output-shared-memory"),
        pytest.param(*of(binary_input(), parameters={"binary_data_output": 1}), "'binary_data_output' must be true",
                     id="binary-data-output-a-number"),
    ]


@pytest.mark.parametrize(("body", "header_length", "message"), _bad_framings())
def test_a_badly_framed_body_is_a_400_saying_what_to_fix_and_queues_nothing(
        api: Api, mlp: dict[str, Any], body: bytes, header_length: str, message: str) -> None:
    response = post_framed(api, body, header_length)
    assert response.status_code == 400, response.get_json()
    assert message in error_of(response)
    assert queued_items(api) == 0


def test_a_framed_body_over_the_size_limit_is_a_413(
        redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> None:
    settings = make_settings(redis_server, store, tmp_path, zoo_dir, max_body_bytes="512B")
    api = Api(create_app(settings, store=store).test_client(), create_api_key(store, "test", "admin"))
    rows = np.zeros((4, 64), dtype=np.float32)
    body, length = framed({"inputs": [binary_input(shape=[4, 64], size=rows.nbytes)]}, rows.tobytes())

    response = post_framed(api, body, length)

    assert response.status_code == 413
    assert "512-byte limit" in error_of(response)
