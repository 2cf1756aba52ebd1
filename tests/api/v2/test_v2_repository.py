"""A Triton model repository loaded into a real Redis through the API: index, load, unload, the config
as loaded, the version policy, the queue policy, and `/v1/models` beside it (no worker needed).

The repository holds Triton's own `simple` example (tests/fixtures/triton), copied in unchanged, and
models made of it with other configs: an invalid one from Triton's qa cases, one with three versions.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from broker.config.settings import Settings
from broker.state.store import Store
from sits_api.app import create_app
from sits_api.intake import model_repository
from sits_api.v2.parsing import parse_infer_request
from tests.api.api_helpers import Api

FIXTURES = Path(__file__).parents[2] / "fixtures" / "triton"
SIMPLE = FIXTURES / "model_repository" / "simple"
SIMPLE_GRAPH = SIMPLE / "1" / "model.onnx"
INVALID = FIXTURES / "qa" / "noautofill_platform" / "negative_max_batch_size"


def model_folder(repository: Path, name: str, config: str | None, versions: tuple[int, ...] = (1,)) -> Path:
    """A model folder of `simple`'s graph under `versions`, with `config` as its config.pbtxt (None: none)."""
    folder = repository / name
    for version in versions:
        (folder / str(version)).mkdir(parents=True)
        shutil.copyfile(SIMPLE_GRAPH, folder / str(version) / "model.onnx")
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    return folder


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "model_repository"
    shutil.copytree(SIMPLE, root / "simple")
    model_folder(root, "invalid", (INVALID / "config.pbtxt").read_text().replace("negative_max_batch_size", "invalid"))
    model_folder(root, "versioned", "max_batch_size: 8\nversion_policy { latest { num_versions: 2 } }\n",
                 versions=(1, 2, 3))
    model_folder(root, "autocompleted", None)
    model_folder(root, "prioritised", "max_batch_size: 8\ndynamic_batching { priority_levels: 3 "
                 "default_priority_level: 2 }\n")
    model_folder(root, "bounded", "max_batch_size: 8\n"
                 "dynamic_batching { default_queue_policy { max_queue_size: 1 } }\n")
    return root


@pytest.fixture
def repo_settings(settings: Settings, repository: Path) -> Settings:
    return settings.with_overrides(repository={"paths": [repository]})


@pytest.fixture
def repo_api(repo_settings: Settings, store: Store, admin_key: str) -> Api:
    """The API over the repository, loaded as an API process loads it at start (waited for)."""
    app: Flask = create_app(repo_settings, store=store)
    assert store.client.exists(store.keys.model_repository_lock)  # this process took the load
    for thread in threading.enumerate():
        if thread.name == "model-repository":
            thread.join(timeout=60)
    return Api(app.test_client(), admin_key)


def index(api: Api, **body: Any) -> list[dict[str, Any]]:
    response = api.post("/v2/repository/index", json=body)
    assert response.status_code == 200, response.get_json()
    return list(response.get_json())


def test_the_repository_loads_at_start_and_an_invalid_model_is_unavailable_naming_the_field(repo_api: Api) -> None:
    entries = {(entry["name"], entry.get("version")): entry for entry in index(repo_api)}

    assert entries[("simple", "1")] == {"name": "simple", "version": "1", "state": "READY", "reason": ""}
    invalid = entries[("invalid", None)]
    assert invalid["state"] == "UNAVAILABLE"
    assert invalid["reason"] == "'max_batch_size' must be non-negative value for invalid"
    assert repo_api.get("/v2/models/invalid").status_code == 404
    assert {entry["name"] for entry in index(repo_api, ready=True)} == {"simple", "versioned", "autocompleted",
                                                                        "bounded", "prioritised"}


def test_the_config_is_answered_as_loaded(repo_api: Api) -> None:
    config = repo_api.get("/v2/models/simple/config").get_json()

    assert config["name"] == "simple" and config["platform"] == "onnxruntime_onnx" and config["max_batch_size"] == 8
    assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
                               {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}]
    assert "dynamic_batching" not in config  # simple's config has none
    metadata = repo_api.get("/v2/models/simple").get_json()
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    completed = repo_api.get("/v2/models/autocompleted/config").get_json()
    assert completed["max_batch_size"] == 4 and completed["dynamic_batching"] == {"preferred_batch_size": [4]}


def test_the_version_policy_selects_the_versions_served(repo_api: Api) -> None:
    versions = [entry["version"] for entry in index(repo_api) if entry["name"] == "versioned"]

    assert versions == ["2", "3"]
    assert repo_api.get("/v2/models/versioned").get_json()["versions"] == ["2", "3"]
    assert repo_api.get("/v2/models/versioned/versions/1").status_code == 404
    assert repo_api.get("/v2/models/versioned/versions/2/config").status_code == 200


def test_a_version_policy_changed_and_loaded_again_serves_the_versions_it_selects(repo_api: Api,
                                                                                   repository: Path) -> None:
    (repository / "versioned" / "config.pbtxt").write_text("max_batch_size: 8\nversion_policy { specific { "
                                                           "versions: [1] } }\n")

    assert repo_api.post("/v2/repository/models/versioned/load").status_code == 200

    assert repo_api.get("/v2/models/versioned").get_json()["versions"] == ["1"]
    assert repo_api.get("/v2/models/versioned/config").status_code == 200  # (its latest is 1 now)
    assert repo_api.get("/v2/models/versioned/versions/3").status_code == 404


def test_the_queue_policy_s_max_queue_size_refuses_the_request_past_it(repo_api: Api) -> None:
    body = {"model": "bounded", "inputs": {"INPUT0": [[1] * 16], "INPUT1": [[2] * 16]}}

    first = repo_api.post("/v1/requests", json=body)  # no worker: it waits in the queue
    second = repo_api.post("/v1/requests", json=body)

    assert first.status_code == 202, first.get_json()
    assert second.status_code == 429 and "Retry-After" in second.headers, second.get_json()
    assert repo_api.post("/v1/requests", json={**body, "model": "simple"}).status_code == 202  # (no limit)
    exposed = repo_api.get("/metrics").get_data(as_text=True)  # (the limit /metrics shows is the config's)
    assert any(line.startswith('sits_queue_max_requests{model="bounded"') and line.endswith(" 1.0")
               for line in exposed.splitlines()), [line for line in exposed.splitlines() if "max_requests" in line]


def test_a_batch_past_max_batch_size_is_refused_as_triton_refuses_it(repo_api: Api) -> None:
    response = repo_api.post("/v1/requests", json={"model": "simple", "inputs": {"INPUT0": [[1] * 16] * 9,
                                                                                 "INPUT1": [[2] * 16] * 9}})

    assert response.status_code == 400
    assert response.get_json()["error"] == "inference request batch-size must be <= 8 for 'simple'"


def test_unload_and_load_again(repo_api: Api, repository: Path) -> None:
    assert repo_api.post("/v2/repository/models/simple/unload").status_code == 200
    assert repo_api.get("/v2/models/simple").status_code == 404
    assert [e for e in index(repo_api) if e["name"] == "simple"] == [
        {"name": "simple", "state": "UNAVAILABLE", "reason": "unloaded"}]

    (repository / "simple" / "config.pbtxt").write_text('name: "simple"\nmax_batch_size: -1\n')
    refused = repo_api.post("/v2/repository/models/simple/load")
    assert refused.status_code == 400
    assert "'max_batch_size' must be non-negative value for simple" in refused.get_json()["error"]

    shutil.copyfile(SIMPLE / "config.pbtxt", repository / "simple" / "config.pbtxt")
    assert repo_api.post("/v2/repository/models/simple/load").status_code == 200
    assert repo_api.get("/v2/models/simple").get_json()["versions"] == ["1"]
    assert repo_api.post("/v2/repository/models/nope/load").status_code == 404


def test_only_admin_keys_load_and_unload(repo_api: Api, store: Store) -> None:
    from broker.tenants.apikeys import create_api_key

    user = Api(repo_api.client, create_api_key(store, "someone", "user"))
    assert user.post("/v2/repository/models/simple/unload").status_code == 403
    assert user.post("/v2/repository/index").status_code == 403


def test_registration_through_v1_keeps_working_beside_it(repo_api: Api, zoo_dir: Path) -> None:
    response = repo_api.post("/v1/models", json={"name": "mlp", "path": str(zoo_dir / "mlp.onnx")})

    assert response.status_code == 201, response.get_json()
    assert repo_api.get("/v2/models/mlp/config").get_json()["max_batch_size"] >= 1
    assert "mlp" not in {entry["name"] for entry in index(repo_api)}


def test_a_repository_does_not_take_a_name_registered_through_v1(api: Api, zoo_dir: Path, settings: Settings,
                                                                 store: Store, tmp_path: Path) -> None:
    assert api.post("/v1/models", json={"name": "simple", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201
    root = tmp_path / "repo"
    shutil.copytree(SIMPLE, root / "simple")

    [entry] = model_repository.load_repository(settings.with_overrides(repository={"paths": [root]}), store, now=1.0)

    assert entry.state == "UNAVAILABLE" and "registered through POST /v1/models" in entry.reason
    assert api.get("/v2/models/simple").get_json()["inputs"][0]["name"] == "features"


@pytest.mark.parametrize(("model", "priority", "level"), [
    ("prioritised", 1, 15), ("prioritised", 3, 13), ("prioritised", 0, 14), ("prioritised", 9, 14),
    ("simple", 1, 0),  # (no priority levels in its config: every request alike)
])
def test_a_v2_priority_maps_by_the_config_s_priority_levels(repo_api: Api, store: Store, model: str, priority: int,
                                                             level: int) -> None:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [2] * 16}],
            "parameters": {"priority": priority}}

    assert parse_infer_request(store, body, model).priority == level


def test_a_failed_load_again_keeps_the_versions_it_serves(repo_api: Api, repository: Path) -> None:
    """As in Triton: a model loaded again whose new config is refused goes on serving what it served."""
    config = repository / "simple" / "config.pbtxt"
    good = config.read_text()
    config.write_text('name: "simple"\nmax_batch_size: -1\n')
    try:
        failed = repo_api.post("/v2/repository/models/simple/load")
        assert failed.status_code == 400 and "'max_batch_size' must be non-negative value" in failed.get_json()["error"]
        assert repo_api.get("/v2/models/simple").status_code == 200  # still served
        entry = next(e for e in index(repo_api) if e["name"] == "simple")
        assert entry["state"] == "READY" and "max_batch_size" in entry["reason"], entry
    finally:
        config.write_text(good)
    assert repo_api.post("/v2/repository/models/simple/load").status_code == 200
    assert next(e for e in index(repo_api) if e["name"] == "simple")["reason"] == ""
