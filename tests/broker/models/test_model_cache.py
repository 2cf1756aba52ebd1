"""The one model-record cache of the API and the workers (real Redis, a clock the test moves)."""

from __future__ import annotations

import pytest

from broker.errors import ModelNotFound
from broker.models import registry
from broker.models.cache import ModelRecordCache
from broker.models.model_record import ModelRecord
from broker.state.store import Store

RECORD = {"name": "m", "version": "v1", "ref": "m@v1", "path": "/nowhere.onnx", "signature": {}}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_record_is_kept_for_its_ttl_then_read_again(store: Store) -> None:
    registry.save_model_version(store, RECORD)
    clock = Clock()
    cache = ModelRecordCache(2.0, clock=clock)
    first = cache.get(store, "m@v1")
    registry.update_model_version(store, "m@v1", {"profile": {"points": []}})

    clock.now += 1.9
    assert cache.get(store, "m@v1") is first  # within the TTL: no Redis read
    clock.now += 0.2
    assert cache.get(store, "m@v1").profile == {"points": []}


def test_a_record_read_by_its_bare_name_is_kept_under_its_version_too(store: Store) -> None:
    registry.save_model_version(store, RECORD)
    cache = ModelRecordCache(5.0, clock=Clock())
    by_name = cache.get(store, "m")
    store.client.delete(store.keys.model_versions)  # a read from Redis now would fail

    assert cache.get(store, "m@v1") is by_name


def test_a_remembered_record_is_served_at_once(store: Store) -> None:
    registry.save_model_version(store, RECORD)
    cache = ModelRecordCache(5.0, clock=Clock())
    cache.get(store, "m@v1")
    cache.remember("m@v1", ModelRecord.of(RECORD | {"profile": {"source": "measured"}}))

    assert cache.get(store, "m@v1").profile == {"source": "measured"}


def test_an_unknown_model_is_not_cached(store: Store) -> None:
    cache = ModelRecordCache(5.0, clock=Clock())
    with pytest.raises(ModelNotFound):
        cache.get(store, "m")
    registry.save_model_version(store, RECORD)

    assert cache.get(store, "m").version == "v1"
