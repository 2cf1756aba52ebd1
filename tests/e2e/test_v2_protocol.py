"""The Open Inference Protocol (KServe v2) with a plain v2 JSON client, against a real stack."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from sits_api.v2.binary import HEADER_LENGTH
from sits_worker.model.zoo import mlp_reference


def v2_call(stack, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """What a KServe/Triton v2 JSON client sends: plain JSON over HTTP with a bearer header."""
    request = urllib.request.Request(stack.api_url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {stack.api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_health_and_model_metadata(mlp_stack):
    assert v2_call(mlp_stack, "GET", "/v2/health/live") == (200, {"live": True})
    assert v2_call(mlp_stack, "GET", "/v2/health/ready") == (200, {"ready": True})
    status, metadata = v2_call(mlp_stack, "GET", "/v2/models/mlp")
    assert status == 200 and metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 64]}]
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert v2_call(mlp_stack, "GET", "/v2/models/mlp/ready") == (200, {"name": "mlp", "ready": True})
    assert v2_call(mlp_stack, "GET", "/v2/models/nope/ready")[0] == 404


def test_infer_returns_flat_outputs_like_triton(mlp_stack):
    features = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    body = {"id": "abc", "inputs": [{"name": "features", "shape": [2, 64], "datatype": "FP32",
                                     "data": features.ravel().tolist()}],
            "outputs": [{"name": "logits"}], "parameters": {"priority": 9, "timeout": 5_000_000}}
    status, answer = v2_call(mlp_stack, "POST", "/v2/models/mlp/infer", body)
    assert status == 200, answer
    assert answer["id"] == "abc" and answer["model_name"] == "mlp"
    [output] = answer["outputs"]
    assert output["name"] == "logits" and output["datatype"] == "FP32" and output["shape"] == [2, 10]
    np.testing.assert_allclose(np.array(output["data"]).reshape(2, 10), mlp_reference(features), rtol=1e-4,
                               atol=1e-5)
    version = answer["model_version"]
    status, again = v2_call(mlp_stack, "POST", f"/v2/models/mlp/versions/{version}/infer", body)
    assert status == 200 and again["outputs"][0]["data"] == output["data"]


def test_v2_errors_use_the_protocol_error_form(mlp_stack):
    bad_shape = {"inputs": [{"name": "features", "shape": [1, 63], "datatype": "FP32", "data": [0.0] * 63}]}
    status, answer = v2_call(mlp_stack, "POST", "/v2/models/mlp/infer", bad_shape)
    assert status == 400 and "features" in answer["error"]
    wrong_type = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "INT64", "data": [0] * 64}]}
    status, answer = v2_call(mlp_stack, "POST", "/v2/models/mlp/infer", wrong_type)
    assert status == 400 and "FP32" not in answer["error"] and "float32" in answer["error"]
    status, answer = v2_call(mlp_stack, "POST", "/v2/models/nope/infer", bad_shape)
    assert status == 404 and "error" in answer


def test_badly_framed_binary_bodies_are_a_400_in_the_v2_error_form(mlp_stack):
    header = json.dumps({"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 256}}]}).encode()
    body = header + bytes(256)
    url = urllib.parse.urlsplit(mlp_stack.api_url)
    for header_length, message in [(str(len(body) + 1), "the body has only"), ("12abc", "whole number"),
                                   (str(len(header) - 1), "not valid JSON")]:
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        try:  # as tritonclient frames it: no Content-Type, the JSON length in a header of its own
            connection.request("POST", "/v2/models/mlp/infer", body=body,
                               headers={"Authorization": f"Bearer {mlp_stack.api_key}", HEADER_LENGTH: header_length})
            response = connection.getresponse()
            assert response.status == 400 and message in json.loads(response.read())["error"], header_length
        finally:
            connection.close()
