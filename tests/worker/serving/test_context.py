"""What a worker process keeps between batches (real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import time

import pytest

from broker.config.settings import Settings
from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.serving.context import WorkerContext

RECORD = {"name": "m", "version": "v1", "ref": "m@v1", "path": "/nowhere.onnx",
          "signature": {"inputs": [], "outputs": [{"name": "y"}]}, "static_profile": {"flops_per_sample": 1e6}}


def test_a_worker_sees_a_profile_that_lands_after_it_first_read_the_model(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch costs, latency estimates and the riders' fill follow the measured profile: a worker that
    served the model before its profile landed must not keep the static estimate for good."""
    registry.save_model_version(store, RECORD)
    ctx = WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                        sessions=SessionCache(Device("cpu"), 1))
    monkeypatch.setattr(ctx.model_records, "ttl_seconds", 0.5)
    assert ctx.model("m@v1").profile is None
    registry.update_model_version(store, "m@v1", {"profile": {"points": [
        {"batch_size": 1, "latency_ms": 2.0, "rows_per_second": 500.0}]}})
    assert ctx.model("m@v1").profile is None  # kept a moment: the hot path asks on every batch
    time.sleep(0.6)

    assert ctx.model("m@v1").profile_points[0]["latency_ms"] == 2.0


def test_the_padding_spec_follows_a_record_read_again(store: Store) -> None:
    """A version registered again may come back with another probe result (`padding_exact`): the worker's
    spec is derived again with the record, not kept for the life of the process."""
    from sits_worker.model.graph import static_profile
    from sits_worker.model.padding import PADDING_EXACT_KEY
    from tests.onnx_models import token_model

    profile = static_profile(token_model())
    record = RECORD | {"name": "tok", "ref": "tok@v1", "signature": profile["signature"], "static_profile": profile}
    registry.save_model_version(store, record)
    ctx = WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                        sessions=SessionCache(Device("cpu"), 1))
    first = ctx.padding("tok@v1")
    assert first is not None and first.pads and ctx.padding("tok@v1") is first  # derived once per record

    ctx.remember_model("tok@v1", ModelRecord.of(record | {"static_profile": profile | {PADDING_EXACT_KEY: False}}))

    again = ctx.padding("tok@v1")
    assert again is not None and again.pads is False
