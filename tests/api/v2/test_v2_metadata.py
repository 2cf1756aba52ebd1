"""GET /v2 (server metadata) and GET /v2/models/{name}[/versions/{v}]/config (Triton's model
configuration extension), without a worker.

The server names only the extensions it implements, and each has its route; a model's
configuration carries the batching settings workers apply (the ones GET /v1/models/{name} shows).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from flask import Flask
from flask.testing import FlaskClient

from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.app import create_app
from tests.api.api_helpers import Api, error_of, make_settings

DEFAULT_QUEUE_POLICY = {"timeout_action": "REJECT", "default_timeout_microseconds": 0, "allow_timeout_override": True,
                        "max_queue_size": 4096}
"""SITS's default queue policy as Triton writes it: Triton's own but for the bounded queue."""

def test_server_metadata_needs_no_key_and_names_the_package_version(client: FlaskClient) -> None:
    response = client.get("/v2")

    assert response.status_code == 200
    assert response.get_json() == {"name": "sits", "version": importlib.metadata.version("sits"),
                                   "extensions": ["binary_tensor_data", "schedule_policy", "model_configuration",
                                                  "statistics", "model_repository"]}


def test_every_extension_the_server_names_has_its_route(app: Flask, client: FlaskClient) -> None:
    # by Triton's extension documents: the config route, and the infer parameters they define
    routes = {rule.rule for rule in app.url_map.iter_rules()}
    needs = {"model_configuration": "/v2/models/<name>/versions/<version>/config",
             "binary_tensor_data": "/v2/models/<name>/infer", "schedule_policy": "/v2/models/<name>/infer",
             "statistics": "/v2/models/<name>/versions/<version>/stats",
             "model_repository": "/v2/repository/models/<name>/load"}
    for extension in client.get("/v2").get_json()["extensions"]:
        assert needs[extension] in routes, extension


def test_model_config_is_a_triton_config_without_the_batch_axis(api: Api, mlp: dict[str, Any]) -> None:
    response = api.get("/v2/models/mlp/config")

    assert response.status_code == 200, response.get_json()
    config = response.get_json()
    batching = api.get("/v1/models/mlp").get_json()["batching"]
    assert config == {
        "name": "mlp", "platform": "onnxruntime_onnx", "backend": "onnxruntime",
        "max_batch_size": batching["max_batch_size"],
        "input": [{"name": "features", "data_type": "TYPE_FP32", "dims": [64]}],
        "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}],
        "dynamic_batching": {"max_queue_delay_microseconds": round(batching["max_queue_delay_ms"] * 1000),
                             "preferred_batch_size": batching["preferred_batch_sizes"],
                             "priority_levels": 16, "default_priority_level": 16,
                             "default_queue_policy": DEFAULT_QUEUE_POLICY},
    }
    assert api.get(f"/v2/models/mlp/versions/{mlp['version']}/config").get_json() == config


def test_model_config_carries_the_configured_batching_settings(
        redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> None:
    settings = make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(online={"models": {"mlp": {
        "max_batch_size": 16, "max_queue_delay": "2.5ms", "preferred_batch_sizes": [8, 4]}}})
    api = Api(create_app(settings, store=store).test_client(), create_api_key(store, "test", "admin"))
    assert api.post("/v1/models", json={"name": "mlp", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201

    config = api.get("/v2/models/mlp/config").get_json()

    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 2500, "preferred_batch_size": [4, 8],
                                          "priority_levels": 16, "default_priority_level": 16,
                                          "default_queue_policy": DEFAULT_QUEUE_POLICY}


def test_dynamic_axes_past_the_batch_axis_are_minus_one(api: Api, zoo_dir: Path) -> None:
    assert api.post("/v1/models", json={"name": "transformer", "path": str(zoo_dir / "transformer.onnx")}
                    ).status_code == 201

    config = api.get("/v2/models/transformer/config").get_json()

    assert config["input"] == [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]},
                               {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [-1]}]
    assert [(o["name"], o["data_type"]) for o in config["output"]] == [("embedding", "TYPE_FP32")]


def test_model_config_of_an_unknown_model_or_version_is_a_404_in_the_v2_error_form(
        api: Api, mlp: dict[str, Any]) -> None:
    for path, named in (("/v2/models/nope/config", "'nope'"), ("/v2/models/mlp/versions/0000/config", "mlp@0000")):
        response = api.get(path)
        assert response.status_code == 404, path
        assert named in error_of(response) and "is not registered" in error_of(response), error_of(response)


def test_model_config_needs_a_key_like_model_metadata(client: FlaskClient, mlp: dict[str, Any]) -> None:
    for path in ("/v2/models/mlp/config", "/v2/models/mlp"):
        assert client.get(path).status_code == 401, path


def test_model_config_carries_the_queue_policy_as_triton_writes_it(
        redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> None:
    """Triton's `ModelQueuePolicy`: microseconds, REJECT / DELAY, and its priority 1 for SITS level 15."""
    settings = make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(online={"models": {"mlp": {
        "max_queue_size": 100, "default_timeout": "200ms", "timeout_action": "delay",
        "priority_levels": {15: {"max_queue_size": 10, "timeout_action": "reject"}}}}})
    api = Api(create_app(settings, store=store).test_client(), create_api_key(store, "test", "admin"))
    assert api.post("/v1/models", json={"name": "mlp", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201

    batching = api.get("/v2/models/mlp/config").get_json()["dynamic_batching"]

    assert batching["default_queue_policy"] == {"timeout_action": "DELAY", "default_timeout_microseconds": 200_000,
                                                "allow_timeout_override": True, "max_queue_size": 100}
    assert batching["priority_queue_policy"] == {"1": {"timeout_action": "REJECT",
                                                       "default_timeout_microseconds": 200_000,
                                                       "allow_timeout_override": True, "max_queue_size": 10}}
