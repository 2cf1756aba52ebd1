"""Triton's own `simple` example, copied into a model repository unchanged, served by a real stack
(Redis, the API under gunicorn, the gRPC server, a Celery worker) to NVIDIA's tritonclient over HTTP and gRPC,
unchanged.

Beside it: a model whose config is one of Triton's qa cases of an invalid config (UNAVAILABLE, the
reason naming the field, while the others load), one of three versions under `version_policy`, and
one whose `default_queue_policy` bounds its queue to one request.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from sits_api.cli.client import ApiError
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import stack_settings
from tests.waiting import eventually

FIXTURES = Path(__file__).parents[1] / "fixtures" / "triton"
SIMPLE = FIXTURES / "model_repository" / "simple"
INVALID = FIXTURES / "qa" / "noautofill_platform" / "negative_max_batch_size" / "config.pbtxt"


def _model(root: Path, name: str, config: str, versions: tuple[int, ...] = (1,)) -> None:
    for version in versions:
        (root / name / str(version)).mkdir(parents=True)
        shutil.copyfile(SIMPLE / "1" / "model.onnx", root / name / str(version) / "model.onnx")
    (root / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("model-repository") / "home"
    root = home.parent / "model_repository"
    shutil.copytree(SIMPLE, root / "simple")
    _model(root, "invalid", INVALID.read_text().replace("negative_max_batch_size", "invalid"))
    _model(root, "versioned", "max_batch_size: 8\nversion_policy { latest { num_versions: 2 } }\n", (1, 2, 3))
    _model(root, "bounded", "max_batch_size: 8\ndynamic_batching { default_queue_policy { max_queue_size: 1 } }\n")
    settings = stack_settings(home, streams=1, grpc=True).with_overrides(repository={"paths": [str(root)]})
    running = Stack(settings, worker_count=1, api_port=0).start()
    yield running
    running.stop()


@pytest.fixture
def triton(stack: Stack) -> Iterator[InferenceServerClient]:
    client = InferenceServerClient(stack.api_url.removeprefix("http://"), network_timeout=60.0)
    yield client
    client.close()


@pytest.fixture
def auth(stack: Stack) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.api_key}"}


def _inputs(rows: int) -> tuple[np.ndarray, np.ndarray, list[InferInput]]:
    first = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    second = np.full((rows, 16), 3, dtype=np.int32)
    tensors = [InferInput("INPUT0", [rows, 16], "INT32"), InferInput("INPUT1", [rows, 16], "INT32")]
    tensors[0].set_data_from_numpy(first)
    tensors[1].set_data_from_numpy(second)
    return first, second, tensors


def _loaded(triton: InferenceServerClient, auth: dict[str, str]) -> list[dict]:
    """The repository index once the API loaded every model (else [])."""
    index = triton.get_model_repository_index(headers=auth)
    return index if {entry["name"] for entry in index} == {"simple", "invalid", "versioned", "bounded"} else []


def test_simple_serves_exact_answers_and_refuses_a_batch_of_nine(triton: InferenceServerClient,
                                                                 auth: dict[str, str]) -> None:
    assert eventually(lambda: _loaded(triton, auth), timeout=60)
    assert triton.is_model_ready("simple", headers=auth)
    assert triton.get_model_config("simple", headers=auth)["max_batch_size"] == 8

    first, second, tensors = _inputs(8)
    result = triton.infer("simple", tensors, outputs=[InferRequestedOutput("OUTPUT0"),
                                                      InferRequestedOutput("OUTPUT1")], headers=auth)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), first + second)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), first - second)
    assert result.as_numpy("OUTPUT0").dtype == np.int32

    with pytest.raises(InferenceServerException, match=r"batch-size must be <= 8 for 'simple'"):
        triton.infer("simple", _inputs(9)[2], headers=auth)


def test_simple_serves_the_same_exact_answers_over_grpc_and_refuses_a_batch_of_nine(
        stack: Stack, triton: InferenceServerClient, auth: dict[str, str]) -> None:
    assert eventually(lambda: _loaded(triton, auth), timeout=60)
    client = grpcclient.InferenceServerClient(stack.settings.api.grpc_address())
    metadata = {"authorization": auth["Authorization"]}
    try:
        assert client.is_model_ready("simple", headers=metadata)
        assert client.get_model_config("simple", headers=metadata).config.max_batch_size == 8
        first, second, _ = _inputs(8)
        tensors = [grpcclient.InferInput("INPUT0", [8, 16], "INT32"), grpcclient.InferInput("INPUT1", [8, 16], "INT32")]
        tensors[0].set_data_from_numpy(first)
        tensors[1].set_data_from_numpy(second)
        result = client.infer("simple", tensors, headers=metadata)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), first + second)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), first - second)
        assert result.as_numpy("OUTPUT0").dtype == np.int32

        nine = [grpcclient.InferInput(name, [9, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor, array in zip(nine, _inputs(9)[:2], strict=True):
            tensor.set_data_from_numpy(array)
        with pytest.raises(InferenceServerException, match=r"batch-size must be <= 8 for 'simple'") as refused:
            client.infer("simple", nine, headers=metadata)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()


def test_an_invalid_model_is_unavailable_naming_the_field_while_the_others_load(
        triton: InferenceServerClient, auth: dict[str, str]) -> None:
    index = eventually(lambda: _loaded(triton, auth), timeout=60)
    assert index

    [invalid] = [entry for entry in index if entry["name"] == "invalid"]
    assert invalid["state"] == "UNAVAILABLE" and "'max_batch_size' must be non-negative" in invalid["reason"]
    assert not triton.is_model_ready("invalid", headers=auth)
    assert sorted(entry["version"] for entry in index if entry["name"] == "versioned") == ["2", "3"]
    first, second, tensors = _inputs(2)
    answered = triton.infer("versioned", tensors, model_version="2", headers=auth)
    np.testing.assert_array_equal(answered.as_numpy("OUTPUT1"), first - second)
    with pytest.raises(InferenceServerException):
        triton.infer("versioned", tensors, model_version="1", headers=auth)


def test_unload_and_load_through_the_client(triton: InferenceServerClient, auth: dict[str, str]) -> None:
    assert eventually(lambda: _loaded(triton, auth), timeout=60)

    triton.unload_model("simple", headers=auth)
    assert not triton.is_model_ready("simple", headers=auth)
    triton.load_model("simple", headers=auth)
    eventually(lambda: triton.is_model_ready("simple", headers=auth), timeout=30)
    first, second, tensors = _inputs(1)
    np.testing.assert_array_equal(triton.infer("simple", tensors, headers=auth).as_numpy("OUTPUT0"), first + second)


def test_the_default_queue_policy_s_max_queue_size_bounds_the_queue(stack: Stack, triton: InferenceServerClient,
                                                                     auth: dict[str, str]) -> None:
    # (last in the module: it stops the worker, so that requests stay queued)
    assert eventually(lambda: _loaded(triton, auth), timeout=60)
    stack.stop_child("worker0")
    body = {"model": "bounded", "inputs": {"INPUT0": [[1] * 16], "INPUT1": [[2] * 16]}}

    assert stack.client().post("/v1/requests", body)["status"] == "queued"
    with pytest.raises(ApiError) as refused:
        stack.client().post("/v1/requests", body)

    assert refused.value.http_status == 429
