"""Shared fixtures: a real Redis per test session, a clean key prefix per test.

Real parts only: Redis is a `redis-server` started by the
project's own launcher; fault tests start throw-away servers of their own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.state.embedded import EmbeddedRedis
from broker.state.keys import Keys
from broker.state.store import Store


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """One real redis-server for the whole test session (no AOF: nothing here restarts it)."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def store(redis_server: EmbeddedRedis) -> Iterator[Store]:
    """A store on the session's Redis under a key prefix of its own, deleted afterwards."""
    prefix = "t" + uuid.uuid4().hex[:10]
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield Store(client=client, keys=Keys(prefix=prefix))
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU-sized zoo models, built once per test session."""
    from sits_worker.model.zoo import build_zoo

    directory = tmp_path_factory.getbasetemp() / "zoo"
    if not (directory / "mlp.onnx").exists():
        build_zoo(directory)
    return directory
