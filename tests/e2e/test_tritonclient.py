"""NVIDIA's tritonclient (HTTP), the most used Open Inference Protocol client, unchanged against a real stack.

Only the bearer header is added (`headers=`). With its defaults the client sends and asks for
binary tensors (Triton's binary tensor data extension); with `binary_data=False` it speaks plain
v2 JSON. Every combination must give the reference outputs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from sits_api.cli.stack import Stack
from sits_worker.model.zoo import mlp_reference
from tests.waiting import eventually

FEATURES = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)


@pytest.fixture
def triton(mlp_stack: Stack) -> Iterator[InferenceServerClient]:
    """A tritonclient HTTP client for the stack's API (it takes host:port, no scheme)."""
    client = InferenceServerClient(mlp_stack.api_url.removeprefix("http://"), network_timeout=60.0)
    yield client
    client.close()


@pytest.fixture
def auth(mlp_stack: Stack) -> dict[str, str]:
    """The one thing added to the client's calls: the API key."""
    return {"Authorization": f"Bearer {mlp_stack.api_key}"}


def features_input(features: np.ndarray, *, binary: bool | None = None) -> InferInput:
    """The mlp's input; `binary=None` leaves the client's default (binary)."""
    tensor = InferInput("features", list(features.shape), "FP32")
    if binary is None:
        tensor.set_data_from_numpy(features)
    else:
        tensor.set_data_from_numpy(features, binary_data=binary)
    return tensor


def test_health_readiness_and_metadata(triton: InferenceServerClient, auth: dict[str, str]) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("mlp", headers=auth)
    assert not triton.is_model_ready("nope", headers=auth)
    metadata = triton.get_model_metadata("mlp", headers=auth)
    assert metadata["name"] == "mlp" and metadata["versions"]
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 64]}]
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert triton.is_model_ready("mlp", model_version=metadata["versions"][0], headers=auth)


@pytest.mark.parametrize(("binary_input", "binary_output"), [
    pytest.param(False, False, id="json-in-json-out"),
    pytest.param(None, None, id="client-defaults-binary-in-binary-out"),
    pytest.param(None, False, id="binary-in-json-out"),
    pytest.param(False, True, id="json-in-binary-out"),
])
def test_infer_gives_the_reference_outputs_in_every_tensor_format(
        triton: InferenceServerClient, auth: dict[str, str], binary_input: bool | None,
        binary_output: bool | None) -> None:
    # binary_output None: no `outputs` at all, so the client asks for every output in binary
    outputs = None if binary_output is None else [InferRequestedOutput("logits", binary_data=binary_output)]

    result = triton.infer("mlp", [features_input(FEATURES, binary=binary_input)], outputs=outputs, headers=auth)

    logits = result.as_numpy("logits")
    assert logits.dtype == np.float32 and logits.shape == (3, 10)
    np.testing.assert_allclose(logits, mlp_reference(FEATURES), rtol=1e-4, atol=1e-5)
    answered = result.get_output("logits")
    assert ("data" in answered) == (binary_output is False)
    assert answered.get("parameters", {}).get("binary_data_size") == (None if binary_output is False else 3 * 10 * 4)


def test_request_id_version_and_scheduling_parameters_pass_through(
        triton: InferenceServerClient, auth: dict[str, str]) -> None:
    version = triton.get_model_metadata("mlp", headers=auth)["versions"][0]

    result = triton.infer("mlp", [features_input(FEATURES[:1])], model_version=str(version), request_id="r-7",
                          priority=1, timeout=5_000_000, parameters={"user_tier": "vip"}, headers=auth)

    answer = result.get_response()
    assert answer["id"] == "r-7" and answer["model_name"] == "mlp" and str(answer["model_version"]) == str(version)
    np.testing.assert_allclose(result.as_numpy("logits"), mlp_reference(FEATURES[:1]), rtol=1e-4, atol=1e-5)
    # Triton's priorities: 1 the most urgent ... 16 the least, past that the default, as Triton takes them
    assert triton.infer("mlp", [features_input(FEATURES[:1])], priority=40, headers=auth).as_numpy("logits").shape \
        == (1, 10)
    with pytest.raises(InferenceServerException) as refused:  # the parameters are read: no priority is negative
        triton.infer("mlp", [features_input(FEATURES[:1])], priority=-1, headers=auth)
    assert refused.value.status() == "400" and "'priority'" in refused.value.message()


@pytest.mark.parametrize("binary", [False, None], ids=["json", "binary"])
def test_errors_raise_the_clients_exception_with_the_servers_message(
        triton: InferenceServerClient, auth: dict[str, str], binary: bool | None) -> None:
    with pytest.raises(InferenceServerException) as unknown:
        triton.infer("nope", [features_input(FEATURES, binary=binary)], headers=auth)
    assert unknown.value.status() == "404" and "'nope' is not registered" in unknown.value.message()

    narrow = np.zeros((1, 63), dtype=np.float32)
    with pytest.raises(InferenceServerException) as wrong_shape:
        triton.infer("mlp", [features_input(narrow, binary=binary)], headers=auth)
    assert wrong_shape.value.status() == "400" and "features" in wrong_shape.value.message()

    with pytest.raises(InferenceServerException) as metadata:
        triton.get_model_metadata("nope", headers=auth)
    assert metadata.value.status() == "404" and "nope" in metadata.value.message()


def test_server_metadata_names_sits_and_the_extensions_it_implements(triton: InferenceServerClient) -> None:
    metadata = triton.get_server_metadata()  # no key: like the health endpoints

    assert metadata["name"] == "sits" and metadata["version"]
    assert set(metadata["extensions"]) == {"binary_tensor_data", "schedule_policy", "model_configuration",
                                           "statistics", "model_repository"}


def test_model_config_gives_the_batching_workers_apply(
        triton: InferenceServerClient, auth: dict[str, str], mlp_stack: Stack) -> None:
    batching = mlp_stack.client().get("/v1/models/mlp")["batching"]

    config = triton.get_model_config("mlp", headers=auth)

    assert config["name"] == "mlp" and config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == batching["max_batch_size"] > 0
    assert config["input"] == [{"name": "features", "data_type": "TYPE_FP32", "dims": [64]}]
    assert config["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == round(batching["max_queue_delay_ms"] * 1000)
    version = triton.get_model_metadata("mlp", headers=auth)["versions"][0]
    assert triton.get_model_config("mlp", model_version=str(version), headers=auth) == config
    with pytest.raises(InferenceServerException) as unknown:
        triton.get_model_config("nope", headers=auth)
    assert unknown.value.status() == "404" and "nope" in unknown.value.message()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, None], ids=["json", "binary"])
def test_compressed_requests_give_the_reference_outputs(
        triton: InferenceServerClient, auth: dict[str, str], algorithm: str, binary: bool | None) -> None:
    result = triton.infer("mlp", [features_input(FEATURES, binary=binary)], headers=auth,
                          request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)

    np.testing.assert_allclose(result.as_numpy("logits"), mlp_reference(FEATURES), rtol=1e-4, atol=1e-5)


def test_inference_statistics_count_the_requests_a_real_worker_ran(
        triton: InferenceServerClient, auth: dict[str, str]) -> None:
    def totals() -> tuple[int, int, int, int]:
        [entry] = triton.get_inference_statistics("mlp", headers=auth)["model_stats"]
        inference = entry["inference_stats"]
        return (entry["inference_count"], inference["success"]["count"], inference["compute_infer"]["count"],
                entry["execution_count"])

    rows, succeeded, ran, runs = totals()
    for _ in range(2):
        triton.infer("mlp", [features_input(FEATURES)], headers=auth)

    after = totals()
    assert after[:3] == (rows + 2 * len(FEATURES), succeeded + 2, ran + 2)
    assert runs + 1 <= after[3] <= runs + 2  # (the two may share a run)
    [entry] = triton.get_inference_statistics(headers=auth)["model_stats"]  # every model: the one registered
    assert entry["name"] == "mlp" and entry["inference_stats"]["queue"]["ns"] > 0
    assert entry["inference_stats"]["compute_infer"]["ns"] > 0 and entry["last_inference"] > 0


def test_a_timeout_that_passes_before_a_worker_takes_the_request_fails_it_unrun(
        triton: InferenceServerClient, auth: dict[str, str]) -> None:
    """Through the real worker process: a 1 µs timeout has passed by the time any worker leases the
    request, so the worker does not run it and the client gets the protocol's 504."""
    def counts() -> tuple[int, int]:
        [entry] = triton.get_inference_statistics("mlp", headers=auth)["model_stats"]
        return entry["inference_stats"]["fail"]["count"], entry["inference_stats"]["compute_infer"]["count"]

    failed, ran = counts()
    with pytest.raises(InferenceServerException) as timed_out:
        triton.infer("mlp", [features_input(FEATURES[:1])], timeout=1, headers=auth)

    assert timed_out.value.status() == "504" and "not run" in timed_out.value.message()  # (worker's or API's word)
    # failed, and never in a run (the worker drops it when it leases it)
    assert eventually(lambda: counts() == (failed + 1, ran), timeout=10, interval=0.05)
