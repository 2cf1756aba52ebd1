"""NVIDIA's tritonclient over gRPC (sync and asyncio), unchanged against a real stack's gRPC server.

Only the key is added (`headers=`, sent as the `authorization` metadata). Requests go through the
same intake, keys, tenants and queues as HTTP, so errors carry the HTTP path's messages, and the
answers are those of a direct ONNX Runtime run of the same model on the same rows.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from broker.tenants.apikeys import create_api_key
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import direct_run, register, start_stack
from tests.waiting import eventually

FEATURES = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def zoo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, dict[str, Path]]]:
    """One CPU worker, the zoo's mlp and convnet registered, and the gRPC server beside the API."""
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("grpc-stack") / "home"
    running = start_stack(home, workers=1, streams=2, grpc=True)
    models = build_zoo(home / "models")
    for name in ("mlp", "convnet"):
        register(running.client(), name, models[name])
    yield running, models
    running.stop()


@pytest.fixture(scope="module")
def stack(zoo_stack: tuple[Stack, dict[str, Path]]) -> Stack:
    return zoo_stack[0]


@pytest.fixture
def triton(stack: Stack) -> Iterator[grpcclient.InferenceServerClient]:
    """A tritonclient gRPC client for the stack's gRPC server (`api.grpc_address`, as `sitsctl status` names it)."""
    client = grpcclient.InferenceServerClient(stack.client().get("/v1/status")["grpc_address"])
    yield client
    client.close()


@pytest.fixture
def auth(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {stack.api_key}"}


def features_input(features: np.ndarray, name: str = "features", datatype: str = "FP32") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(features.shape), datatype)
    tensor.set_data_from_numpy(features)
    return tensor


def test_status_names_the_grpc_address_on_the_apis_host(stack: Stack) -> None:
    address = stack.client().get("/v1/status")["grpc_address"]

    assert address == f"127.0.0.1:{stack.settings.api.grpc_port}" and stack.settings.api.grpc_port > 0
    env = {**os.environ, "SITS_API_URL": stack.api_url, "SITS_API_KEY": stack.api_key}
    shown = subprocess.run([sys.executable, "-m", "sits_api.cli", "status"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and f"gRPC  {address}" in shown.stdout, shown.stdout + shown.stderr


def test_health_metadata_and_config_match_the_http_answers(
        triton: grpcclient.InferenceServerClient, auth: dict[str, str], stack: Stack) -> None:
    http = httpclient.InferenceServerClient(stack.api_url.removeprefix("http://"))
    assert triton.is_server_live() and triton.is_server_ready()  # no key, as over HTTP
    assert triton.is_model_ready("mlp", headers=auth) and not triton.is_model_ready("nope", headers=auth)
    server = triton.get_server_metadata(as_json=True)
    assert server["name"] == "sits" and set(server["extensions"]) >= {"schedule_policy", "model_configuration"}

    metadata = triton.get_model_metadata("mlp", headers=auth, as_json=True)
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert metadata["versions"] == [str(v) for v in http.get_model_metadata("mlp", headers=auth)["versions"]]
    config = triton.get_model_config("mlp", headers=auth).config
    over_http = http.get_model_config("mlp", headers=auth)
    assert config.name == "mlp" and config.max_batch_size == over_http["max_batch_size"] > 0
    assert [(t.name, list(t.dims)) for t in config.input] == [("features", [64])]
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_FP32
    assert config.dynamic_batching.max_queue_delay_microseconds == \
        over_http["dynamic_batching"]["max_queue_delay_microseconds"]
    http.close()


def test_infer_answers_exactly_what_onnx_runtime_answers_for_the_mlp_and_the_convnet(
        triton: grpcclient.InferenceServerClient, auth: dict[str, str],
        zoo_stack: tuple[Stack, dict[str, Path]]) -> None:
    models = zoo_stack[1]
    result = triton.infer("mlp", [features_input(FEATURES)], headers=auth)
    np.testing.assert_array_equal(result.as_numpy("logits"), direct_run(models["mlp"], FEATURES, len(FEATURES)))

    convnet = triton.get_model_metadata("convnet", headers=auth, as_json=True)
    [spec], [output] = convnet["inputs"], convnet["outputs"]
    images = np.random.default_rng(4).standard_normal((2, *[int(d) for d in spec["shape"][1:]])).astype(np.float32)
    result = triton.infer("convnet", [features_input(images, spec["name"])], request_id="c-1", headers=auth)
    assert result.get_response().id == "c-1"
    np.testing.assert_array_equal(result.as_numpy(output["name"]), direct_run(models["convnet"], images, 2))


def test_the_asyncio_client_infers_many_at_once_with_priority_and_timeout(
        stack: Stack, auth: dict[str, str], zoo_stack: tuple[Stack, dict[str, Path]]) -> None:
    expected = direct_run(zoo_stack[1]["mlp"], FEATURES[:1], 1)

    async def run() -> list[Any]:
        client = aioclient.InferenceServerClient(stack.settings.api.grpc_address())
        try:
            assert await client.is_server_live() and await client.is_model_ready("mlp", headers=auth)
            calls = [client.infer("mlp", [features_input(FEATURES[:1])], priority=1 + index % 16,
                                  timeout=30_000_000, headers=auth) for index in range(24)]
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    for result in asyncio.run(run()):
        np.testing.assert_array_equal(result.as_numpy("logits"), expected)


def test_errors_are_grpc_statuses_with_the_http_paths_messages(
        triton: grpcclient.InferenceServerClient, auth: dict[str, str], stack: Stack) -> None:
    http = httpclient.InferenceServerClient(stack.api_url.removeprefix("http://"))
    narrow = np.zeros((1, 63), dtype=np.float32)
    with pytest.raises(InferenceServerException) as over_http:
        http.infer("mlp", [httpclient.InferInput("features", [1, 63], "FP32").set_data_from_numpy(narrow)],
                   headers=dict(auth))  # (a copy: the HTTP client adds its own headers to the dict)
    http.close()

    with pytest.raises(InferenceServerException) as unknown:
        triton.infer("nope", [features_input(FEATURES)], headers=auth)
    assert unknown.value.status() == "StatusCode.NOT_FOUND" and "'nope' is not registered" in unknown.value.message()
    with pytest.raises(InferenceServerException) as wrong_shape:
        triton.infer("mlp", [features_input(narrow)], headers=auth)
    assert wrong_shape.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert wrong_shape.value.message() == over_http.value.message()
    with pytest.raises(InferenceServerException) as negative:  # the parameters are read as over HTTP
        triton.infer("mlp", [features_input(FEATURES)], parameters={"user_tier": "gold"}, headers=auth)
    assert negative.value.status() == "StatusCode.INVALID_ARGUMENT" and "'user_tier'" in negative.value.message()
    with pytest.raises(InferenceServerException) as config:
        triton.get_model_config("nope", headers=auth)
    assert config.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("headers", [None, {"authorization": "Bearer not-a-key"}], ids=["missing", "wrong"])
def test_a_missing_or_wrong_key_is_unauthenticated(triton: grpcclient.InferenceServerClient,
                                                   headers: dict[str, str] | None) -> None:
    with pytest.raises(InferenceServerException) as refused:
        triton.infer("mlp", [features_input(FEATURES)], headers=headers)
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED" and "API key" in refused.value.message()
    with pytest.raises(InferenceServerException) as metadata:
        triton.get_model_metadata("mlp", headers=headers)
    assert metadata.value.status() == "StatusCode.UNAUTHENTICATED"


def test_a_tenants_priority_cap_is_refused_as_over_http(
        triton: grpcclient.InferenceServerClient, stack: Stack) -> None:
    stack.client().request("PUT", "/v1/tenants/capped", {"max_priority": 3})
    capped = {"authorization": f"Bearer {create_api_key(stack.store, 'capped-key', 'user', tenant='capped')}"}

    def refusal(infer: Any) -> InferenceServerException | None:
        try:
            infer()
        except InferenceServerException as err:
            return err
        return None

    http = httpclient.InferenceServerClient(stack.api_url.removeprefix("http://"))
    one_row = httpclient.InferInput("features", [1, 64], "FP32").set_data_from_numpy(FEATURES[:1])
    # (every server process reads the tenants again within a second of a change)
    over_http = eventually(lambda: refusal(lambda: http.infer("mlp", [one_row], priority=1, headers=dict(capped))),
                           timeout=5, interval=0.1)  # Triton's priority 1: SITS's level 15
    http.close()
    refused = eventually(lambda: refusal(lambda: triton.infer("mlp", [features_input(FEATURES[:1])], priority=1,
                                                              headers=capped)), timeout=5, interval=0.1)

    assert over_http is not None and refused is not None
    assert refused.status() == "StatusCode.PERMISSION_DENIED"
    assert refused.message() == over_http.message() and "max_priority" in refused.message()
    allowed = triton.infer("mlp", [features_input(FEATURES[:1])], priority=13, headers=capped)  # SITS's level 3
    assert allowed.as_numpy("logits").shape == (1, 10)


def test_statistics_count_the_grpc_requests(triton: grpcclient.InferenceServerClient, auth: dict[str, str]) -> None:
    def count() -> int:
        [entry] = triton.get_inference_statistics("mlp", headers=auth).model_stats
        return entry.inference_stats.success.count

    before = count()
    triton.infer("mlp", [features_input(FEATURES)], headers=auth)

    assert count() == before + 1
    with pytest.raises(InferenceServerException) as unknown:
        triton.get_inference_statistics("nope", headers=auth)
    assert unknown.value.status() == "StatusCode.NOT_FOUND"


def test_the_repository_index_answers_admins_and_refuses_other_keys(
        triton: grpcclient.InferenceServerClient, auth: dict[str, str], stack: Stack) -> None:
    index = triton.get_model_repository_index(headers=auth)  # (no repository configured: no models in it)
    assert list(index.models) == []
    user = {"authorization": f"Bearer {create_api_key(stack.store, 'plain-user', 'user')}"}
    with pytest.raises(InferenceServerException) as refused:
        triton.get_model_repository_index(headers=user)
    assert refused.value.status() == "StatusCode.PERMISSION_DENIED" and "'admin' role" in refused.value.message()
