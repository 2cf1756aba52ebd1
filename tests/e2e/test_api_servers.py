"""The API under granian (`api.server: granian`): the same answers as under gunicorn, through a real stack."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from sits_api.cli.stack import Stack, api_command
from sits_worker.model.zoo import mlp_reference
from tests.e2e.stack_helpers import register, stack_settings


@pytest.fixture(scope="module")
def granian_stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("granian") / "home"
    settings = stack_settings(home, streams=2).with_overrides(api={"port": 0, "server": "granian", "workers": 2})
    running = Stack(settings, worker_count=1, api_port=0).start()
    register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
    yield running
    running.stop()


def call(stack: Stack, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one raw HTTP call with the stack's admin key."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(stack.api_url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_stack_runs_its_api_under_granian(granian_stack: Stack) -> None:
    api = next(child for child in granian_stack.children if child.name == "api")
    assert "granian" in api.process.args and "gunicorn" not in api.process.args
    assert call(granian_stack, "GET", "/healthz")[0] == 200


def test_concurrent_waiting_requests_get_their_own_answers_through_both_api_processes(granian_stack: Stack) -> None:
    rows = np.random.default_rng(3).standard_normal((48, 64)).astype(np.float32)

    def one(index: int) -> np.ndarray:
        status, body = call(granian_stack, "POST", "/v1/requests",
                            {"model": "mlp", "inputs": {"features": rows[index:index + 1].tolist()}, "wait": True})
        assert status == 200 and body["status"] == "succeeded", body
        return np.array(body["outputs"]["logits"])

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(one, range(len(rows))))

    np.testing.assert_allclose(np.concatenate(outputs), mlp_reference(rows), rtol=1e-4, atol=1e-5)


def test_v2_inference_and_its_errors_answer_as_under_gunicorn(granian_stack: Stack) -> None:
    features = np.ones((1, 64), np.float32)
    status, body = call(granian_stack, "POST", "/v2/models/mlp/infer", {"inputs": [
        {"name": "features", "shape": [1, 64], "datatype": "FP32", "data": features.ravel().tolist()}]})
    assert status == 200 and body["model_name"] == "mlp"
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"]), mlp_reference(features).ravel(), rtol=1e-4,
                               atol=1e-5)

    status, body = call(granian_stack, "POST", "/v2/models/mlp/infer", {"inputs": [
        {"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
    assert status == 400 and "features" in body["error"]


def test_bad_input_gets_the_apis_json_error_under_granian(granian_stack: Stack) -> None:
    status, body = call(granian_stack, "POST", "/v1/requests", {"model": "mlp", "inputs": {"features": [[1.0]]}})
    assert status == 400 and body["code"] == "bad_input" and "features" in body["error"]
    status, body = call(granian_stack, "POST", "/v1/requests", {"model": "nope", "inputs": {}})
    assert status == 404 and "nope" in body["error"]


def test_api_command_names_each_server_with_the_configured_processes_and_threads(tmp_path) -> None:
    settings = stack_settings(tmp_path).with_overrides(api={"workers": 3, "threads": 7})
    gunicorn = api_command(settings)
    granian = api_command(settings.with_overrides(api={"server": "granian"}))

    assert gunicorn[1:3] == ["-m", "gunicorn"] and gunicorn[gunicorn.index("--threads") + 1] == "7"
    assert granian[1:3] == ["-m", "granian"] and granian[granian.index("--blocking-threads") + 1] == "7"
    assert granian[granian.index("--workers") + 1] == "3" == gunicorn[gunicorn.index("--workers") + 1]
