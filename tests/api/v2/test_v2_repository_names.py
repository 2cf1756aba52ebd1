"""A tenant cannot take a Triton model repository's model name through `POST /v1/models`: not while the
repository model is unloaded, not while it is unavailable, not before the repository has loaded it.

A name registered through `/v1/models` becomes the registering tenant's for ever and the repository
then refuses to load it, so a tenant that got in first would serve its own graph to every tenant that
asks the repository's model by name, and keep the repository's model out.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from flask import Flask

from broker.config.settings import Settings
from broker.state.store import Store
from sits_api.app import create_app
from tests.api.api_helpers import Api, tenant_copy, tenant_key

SIMPLE = Path(__file__).parents[2] / "fixtures" / "triton" / "model_repository" / "simple"


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "model_repository"
    shutil.copytree(SIMPLE, root / "simple")
    shutil.copytree(SIMPLE, root / "broken")
    (root / "broken" / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: -1\n')
    return root


@pytest.fixture
def repo_api(settings: Settings, repository: Path, store: Store, admin_key: str) -> Api:
    app: Flask = create_app(settings.with_overrides(repository={"paths": [repository]}), store=store)
    for thread in threading.enumerate():
        if thread.name == "model-repository":
            thread.join(timeout=60)
    return Api(app.test_client(), admin_key)


def register(api: Api, name: str, graph: Path) -> int:
    return api.post("/v1/models", json={"name": name, "path": str(graph)}).status_code


def test_a_tenant_cannot_take_a_repository_model_s_name(repo_api: Api, repository: Path, store: Store,
                                                       tmp_path: Path, zoo_dir: Path) -> None:
    mallory = tenant_key(repo_api.client, store, "mallory", "user", "mallory")
    graph = tenant_copy(zoo_dir / "mlp.onnx", tmp_path, "mallory")
    assert repo_api.post("/v2/repository/models/simple/unload").status_code == 200
    later = shutil.copytree(SIMPLE, repository / "later")  # (put in the repository, not loaded yet)
    (later / "config.pbtxt").write_text((SIMPLE / "config.pbtxt").read_text().replace('"simple"', '"later"'))

    assert register(mallory, "simple", graph) == 403  # unloaded
    assert register(mallory, "broken", graph) == 403  # unavailable: its config is refused
    assert register(mallory, "later", graph) == 403  # not loaded yet
    assert register(mallory, "mine", graph) == 201

    assert repo_api.post("/v2/repository/models/simple/load").status_code == 200
    assert repo_api.post("/v2/repository/models/later/load").status_code == 200
    assert repo_api.get("/v2/models/simple").get_json()["inputs"][0]["name"] == "INPUT0"
