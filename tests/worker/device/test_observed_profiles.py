"""Latency profiles learnt from the batches a worker runs, for models registered without a measured
one (real Redis, a real `WorkerContext`, the zoo MLP on ONNX Runtime)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from broker.config.settings import Settings
from broker.jobs import chunking
from broker.models import registry
from broker.queueing.scoring import estimate_latency_ms
from broker.state.store import Store
from sits_worker.device.observed_profiles import MIN_SAMPLES, ObservedLatencies
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.model.graph import static_profile
from sits_worker.serving import profiler
from sits_worker.serving.context import WorkerContext


def test_batches_are_kept_per_power_of_two_size_class_and_become_points_with_enough_samples() -> None:
    observed = ObservedLatencies()
    for seconds in (0.010, 0.012, 0.011):
        observed.record("m@v1", 128, seconds)
    observed.record("m@v1", 5, 0.002)  # class 4: one sample is not a point yet
    observed.record("m@v1", 6, 0.003)
    observed.record("m@v1", 0, 0.001)  # nothing ran: ignored

    assert observed.points("m@v1") == [{"batch_size": 128, "latency_ms": 11.0, "rows_per_second": 11636.4}]
    observed.record("m@v1", 7, 0.004)
    assert [point["batch_size"] for point in observed.points("m@v1")] == [6, 128]  # median rows of 5, 6, 7


def register(store: Store, zoo_dir: Path, name: str = "mlp", **fields: Any) -> str:
    profile = static_profile(onnx.load(str(zoo_dir / f"{name}.onnx")))
    registry.save_model_version(store, {"name": name, "version": "v1", "ref": f"{name}@v1",
                                        "path": str(zoo_dir / f"{name}.onnx"), "signature": profile["signature"],
                                        "static_profile": profile, **fields})
    return f"{name}@v1"


@pytest.fixture
def ctx(store: Store) -> WorkerContext:
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                         sessions=SessionCache(Device("cpu"), 1))


def run_batches(ctx: WorkerContext, ref: str, sizes: tuple[int, ...]) -> None:
    outputs = ctx.model(ref).output_names
    for rows in sizes:
        for _ in range(MIN_SAMPLES):
            ctx.run(ref, {"features": np.zeros((rows, 64), np.float32)}, outputs)


def test_a_static_model_learns_its_latency_curve_from_the_batches_a_worker_runs(
        ctx: WorkerContext, store: Store, zoo_dir: Path) -> None:
    """Its estimates and the offline sizes (`auto`) then follow the device, not static FLOPs and fallbacks."""
    ref = register(store, zoo_dir)
    static_estimate = estimate_latency_ms(registry.get_model(store, ref), rows=64, tokens=None)
    assert chunking.auto_batch_size(registry.get_model(store, ref)) == chunking.FALLBACK_BATCH_ROWS

    run_batches(ctx, ref, (1, 64, 512))
    assert ctx.observed.flush(store, worker="w1", device="cpu", force=True) == [ref]

    record = registry.get_model(store, ref)
    assert record.observed_profile
    assert [point["batch_size"] for point in record.profile_points] == [1, 64, 512]
    point_64 = record.profile_points[1]["latency_ms"]
    assert estimate_latency_ms(record, rows=64, tokens=None) == point_64 != static_estimate
    # Job sizes: from the points of 128 rows and up (512), no longer the fallbacks.
    assert chunking.auto_batch_size(record) == 512
    assert chunking.profiled_rows_per_second(record, 512) == record.profile_points[2]["rows_per_second"]
    assert ctx.observed.flush(store, worker="w1", device="cpu", force=True) == []  # nothing new since


def test_a_measured_profile_is_never_overwritten_and_replaces_an_observed_one(
        ctx: WorkerContext, store: Store, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = register(store, zoo_dir)
    run_batches(ctx, ref, (8,))
    ctx.observed.flush(store, worker="w1", device="cpu", force=True)
    measured = [{"batch_size": 1, "latency_ms": 0.5, "rows_per_second": 2000.0}]
    monkeypatch.setattr(profiler, "measure", lambda *_, **__: measured)  # the real sweep takes seconds

    profiler.profile_and_record(ctx, ref, profile_mode="full", enable_fusion=False)  # the observed one is stale
    run_batches(ctx, ref, (8,))

    assert ctx.observed.flush(store, worker="w1", device="cpu", force=True) == []
    assert registry.get_model(store, ref).profile["points"] == measured


def test_token_models_are_left_to_their_static_prior(ctx: WorkerContext, store: Store, zoo_dir: Path) -> None:
    ref = register(store, zoo_dir, "transformer")
    for _ in range(MIN_SAMPLES):
        ctx.observed.record(ref, 4, 0.01)

    assert ctx.observed.flush(store, worker="w1", device="cpu", force=True) == []
    assert registry.get_model(store, ref).profile is None


def test_flushes_are_spaced_unless_forced(store: Store, zoo_dir: Path) -> None:
    ref = register(store, zoo_dir)
    observed = ObservedLatencies()
    for _ in range(MIN_SAMPLES):
        observed.record(ref, 2, 0.001)
    assert observed.flush(store, worker="w1", device="cpu", now=100.0) == [ref]
    observed.record(ref, 2, 0.002)
    assert observed.flush(store, worker="w1", device="cpu", now=105.0) == []  # within FLUSH_SECONDS
    assert observed.flush(store, worker="w1", device="cpu", now=111.0) == [ref]


def test_workers_that_ran_different_sizes_add_up_their_observations(store: Store, zoo_dir: Path) -> None:
    """One worker serving requests (small batches) and one running a job (128 rows) must not replace
    each other's points every flush; a size class both ran takes the latest."""
    ref = register(store, zoo_dir)
    online, offline = ObservedLatencies(), ObservedLatencies()
    for _ in range(MIN_SAMPLES):
        online.record(ref, 2, 0.001)
        offline.record(ref, 128, 0.010)
    online.flush(store, worker="w1", device="cpu", force=True)
    offline.flush(store, worker="w2", device="cpu", force=True)
    assert [point["batch_size"] for point in registry.get_model(store, ref).profile["points"]] == [2, 128]

    for _ in range(MIN_SAMPLES):
        online.record(ref, 3, 0.004)  # class 2 again, slower now
    online.flush(store, worker="w1", device="cpu", force=True)
    points = registry.get_model(store, ref).profile["points"]
    assert [(point["batch_size"], point["latency_ms"]) for point in points] == [(2, 2.5), (128, 10.0)]


def test_points_of_another_kind_of_device_are_replaced_and_gpus_of_one_kind_add_up(store: Store,
                                                                                   zoo_dir: Path) -> None:
    ref = register(store, zoo_dir)

    def flush(device: str, rows: int) -> list[int]:
        observed = ObservedLatencies()
        for _ in range(MIN_SAMPLES):
            observed.record(ref, rows, 0.001)
        observed.flush(store, worker=device, device=device, force=True)
        return [point["batch_size"] for point in registry.get_model(store, ref).profile["points"]]

    assert flush("cpu", 2) == [2]
    assert flush("gpu:0", 8) == [8]  # a CPU's latencies say nothing of a GPU's
    assert flush("gpu:1", 128) == [8, 128]
