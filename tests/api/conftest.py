"""Fixtures for the REST API tests: the Flask app over the session's real Redis, an admin key, a client.

No workers run here: submitting a job only writes to Redis and publishes Celery
messages (the Dispatcher) to the same real Redis.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.serving import make_server

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.app import create_app
from tests.api.api_helpers import Api, make_settings


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    return make_settings(redis_server, store, tmp_path, zoo_dir)


@pytest.fixture
def app(settings: Settings, store: Store) -> Flask:
    return create_app(settings, store=store)


@pytest.fixture
def served_api(app: Flask) -> Iterator[str]:
    """The API app on a real HTTP server (threads) on a free loopback port, as sitsctl talks HTTP; its URL."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def admin_key(store: Store) -> str:
    return create_api_key(store, "test", "admin")


@pytest.fixture
def api(client: FlaskClient, admin_key: str) -> Api:
    return Api(client, admin_key)


@pytest.fixture
def mlp(api: Api, zoo_dir: Path) -> dict[str, Any]:
    """The zoo MLP registered as 'mlp'."""
    response = api.post("/v1/models", json={"name": "mlp", "path": str(zoo_dir / "mlp.onnx")})
    assert response.status_code == 201, response.get_json()
    return response.get_json()


@pytest.fixture
def mlp_input(tmp_path: Path) -> Path:
    """A valid MLP input: 10 float32 rows of 64 features."""
    path = tmp_path / "inputs" / "features.npy"
    path.parent.mkdir()
    np.save(path, np.random.default_rng(0).standard_normal((10, 64), dtype=np.float32))
    return path
