"""A profile a worker measures is paid for by the tenant that registered the model, and holds the
device's memory in the worker's ledger while it runs, under the run-time limit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import onnx
import pytest

from broker.config.settings import Settings
from broker.models import registry
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.model.graph import static_profile
from sits_worker.serving import profiler
from sits_worker.serving.context import WorkerContext

SWEEP_SECONDS = 0.2


@pytest.fixture
def ctx(store: Store) -> WorkerContext:
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                         sessions=SessionCache(Device("cpu"), 1))


def test_the_profile_s_device_time_is_billed_to_the_registrant_s_tenant_with_its_memory_reserved(
        ctx: WorkerContext, store: Store, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = static_profile(onnx.load(str(zoo_dir / "mlp.onnx")))
    registry.save_model_version(store, {"name": "mlp", "version": "v1", "path": str(zoo_dir / "mlp.onnx"),
                                        "signature": profile["signature"], "static_profile": profile})
    seen: dict[str, Any] = {}

    def sweep(session: Any, signature: Any, **options: Any) -> list[dict[str, float]]:
        seen["limits"], seen["reserved"] = options.get("limits"), ctx.ledger.capacity_bytes - ctx.ledger.free_bytes()
        time.sleep(SWEEP_SECONDS)  # (the real sweep takes seconds)
        return [{"batch_size": 1, "latency_ms": 0.5, "rows_per_second": 2000.0}]

    monkeypatch.setattr(profiler, "measure", sweep)

    record = profiler.profile_and_record(ctx, "mlp@v1", profile_mode="full", enable_fusion=False,
                                         payer=profiler.BillPayer("acme", "alice"))

    assert record.profile_status == "ready"
    assert seen["limits"] is ctx.run_limits and seen["reserved"] > 0
    assert ctx.ledger.free_bytes() == ctx.ledger.capacity_bytes  # released once measured
    day = tenant_usage.day_number(time.time())
    [row] = tenant_usage.usage_report(store, ["acme"], first_day=day, last_day=day, by="key", prices={})
    assert row["key"] == "alice" and row["device_seconds"] >= SWEEP_SECONDS
