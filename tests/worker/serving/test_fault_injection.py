"""Injected faults take the worker's real error paths (real Redis, a real `WorkerContext`, the zoo MLP):
the errors come out of `WorkerContext.run` and the chunk runner as real failures do, and a job's
failure is settled by its class."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.errors import (
    BadInput,
    Cancelled,
    ConnectionLost,
    DeviceOutOfMemory,
    InferenceTimeout,
    InvalidModel,
    StorageUnavailable,
)
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.state.store import Store
from sits_worker.serving.between_minibatches import STOP_CHECK_SECONDS, BetweenBatches
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import process_item
from tests.leasing import lease_items
from tests.worker.worker_helpers import mlp_worker_context

FEATURES = 64


def _ctx(store: Store, zoo_dir: Path, fallback_strategy: str = "cpu-offload-on-oom", **faults: Any) -> WorkerContext:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        faults={"enabled": True, **faults}, scheduler={"fallback_strategy": fallback_strategy}))
    assert ctx.faults is not None
    return ctx


def _feed(rows: int, value: float = 0.25) -> dict[str, np.ndarray]:
    return {"features": np.full((rows, FEATURES), value, np.float32)}


def test_no_injector_without_faults(store: Store, zoo_dir: Path) -> None:
    assert mlp_worker_context(store, zoo_dir).faults is None


def test_an_oom_above_a_batch_size_is_the_error_a_real_one_becomes(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, oom_above_rows=8)

    assert ctx.faults is not None
    ctx.faults.before_run("mlp@v1", _feed(8))
    with pytest.raises(DeviceOutOfMemory, match="batch of 9 rows"):
        ctx.faults.before_run("mlp@v1", _feed(9))
    assert ctx.run("mlp@v1", _feed(9), ["logits"])[0].shape[0] == 9  # halved until it fits (docs/failures.md)
    assert ctx.oom_info() == {"halved": 1, "offloaded": 0, "failed": 0, "ceilings": {"mlp@v1": 4}}  # (the heartbeat's)


def test_a_share_of_runs_fail_as_oom_the_same_runs_for_the_same_seed(store: Store, zoo_dir: Path) -> None:
    def failing_runs(seed: int) -> list[int]:
        ctx = _ctx(store, zoo_dir, "fail", oom_share=0.5, seed=seed)
        failed = []
        for run in range(16):
            try:
                ctx.run("mlp@v1", _feed(1), ["logits"])
            except DeviceOutOfMemory:
                failed.append(run)
        return failed

    assert failing_runs(3) == failing_runs(3) and 2 < len(failing_runs(3)) < 14
    assert failing_runs(3) != failing_runs(4)


def test_injected_latency_is_added_to_every_run(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, run_latency="50ms")
    began = time.monotonic()
    ctx.run("mlp@v1", _feed(1), ["logits"])
    ctx.run("mlp@v1", _feed(1), ["logits"])
    assert time.monotonic() - began >= 0.1


@pytest.mark.parametrize(("failure_class", "error"), [
    ("transient", StorageUnavailable), ("device_oom", DeviceOutOfMemory), ("run_timeout", InferenceTimeout),
    ("bad_input", BadInput), ("invalid_model", InvalidModel)])
def test_a_failing_model_raises_its_class_s_error(store: Store, zoo_dir: Path, failure_class: str,
                                                  error: type[Exception]) -> None:
    ctx = _ctx(store, zoo_dir, "fail", fail_models={"mlp": failure_class})
    with pytest.raises(error, match="injected fault"):
        ctx.run("mlp@v1", _feed(1), ["logits"])


def test_a_failing_input_value_is_a_bad_input(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, fail_values=[7.5])
    feed = _feed(4)
    ctx.run("mlp@v1", feed, ["logits"])
    feed["features"][2, 5] = 7.5
    with pytest.raises(BadInput, match="holds 7.5"):
        ctx.run("mlp@v1", feed, ["logits"])


def test_a_redis_drop_fails_the_thread_s_next_calls_for_real_then_it_reconnects(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, redis_drop_share=1.0, redis_drop_calls=2)
    other: list[bool] = []

    ctx.run("mlp@v1", _feed(1), ["logits"])
    helper = threading.Thread(target=lambda: other.append(ctx.store.ping()))
    helper.start()
    helper.join(5)
    for _ in range(2):
        with pytest.raises(ConnectionLost, match="Redis is unreachable"):
            ctx.store.ping()

    assert ctx.store.ping() and other == [True]  # the next call reconnects; other threads never saw it


def test_the_memory_reading_is_the_injected_one_when_set(store: Store, zoo_dir: Path) -> None:
    assert mlp_worker_context(store, zoo_dir).memory_reading() > 2**20  # this process's resident memory
    assert _ctx(store, zoo_dir, memory_reading="3GiB").memory_reading() == 3 * 2**30


def _job(store: Store, tmp_path: Path, rows: int = 32) -> jobs.JobSpec:
    np.save(tmp_path / "in.npy", np.random.default_rng(0).standard_normal((rows, FEATURES), dtype=np.float32))
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                        input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                        output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=rows,
                        chunk_size=16, batch_size=8)
    job_fills.create_job(store, spec, now=time.time())
    return spec


def _run_next(ctx: WorkerContext, model_ref: str) -> str:
    [item] = lease_items(ctx.store, model_ref, now=time.time(), lease_seconds=60, max_items=1)
    return process_item(ctx, item, BetweenBatches(ctx, item, ticket=""))


def test_a_failing_job_row_fails_its_job_at_once_as_bad_input(store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    ctx = _ctx(store, zoo_dir, fail_rows=[20])
    spec = _job(store, tmp_path)

    assert _run_next(ctx, spec.model_ref) == "committing"  # rows 0-15
    assert _run_next(ctx, spec.model_ref) == "failed"  # rows 16-31: never retried

    job = jobs.get_job(store, spec.job_id, now=time.time())
    assert job.status == "failed" and "rows [20] fail" in job.error
    assert store.client.hget(store.keys.counters, "failures_final_bad_input:mlp@v1") == "1"
    assert job.retries == {"bad_input": {"attempts": 1, "last_error": job.error,
                                            "last_failed_at": job.failures[0]["at"]}}
    assert job.failures[0]["retry_at"] is None


def test_an_injected_oom_on_a_job_waits_its_backoff_in_redis(store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        faults={"enabled": True, "oom_share": 1.0}, scheduler={"fallback_strategy": "fail"},
        retry={"device_oom": {"attempts": 2, "backoff": "30s"}}))
    spec = _job(store, tmp_path)

    began = time.time()
    assert _run_next(ctx, spec.model_ref) == "retry"

    [(item_id, ready_at)] = store.client.zrange(store.keys.inflight(spec.model_ref), 0, 0, withscores=True)
    # (retry times are kept to the ms)
    assert item_id == jobs.chunk_item_id(spec.job_id, 0) and began + 30 <= ready_at <= time.time() + 30.001
    job = jobs.get_job(store, spec.job_id, now=time.time())
    assert job.status == "running" and job.retries["device_oom"]["attempts"] == 1
    assert store.client.hget(store.keys.counters, "failures_retried_device_oom:mlp@v1") == "1"  # (for /metrics)
    assert "batch of 1 rows" in job.retries["device_oom"]["last_error"]  # halved down to one row first


def test_the_running_chunk_of_a_cancelled_job_stops_before_its_next_mini_batch(store: Store, zoo_dir: Path,
                                                                             tmp_path: Path) -> None:
    ctx = _ctx(store, zoo_dir, run_latency="0.05s")  # 512 mini-batches of 8 rows: about 25 s of runs
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                        input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                        output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=4096,
                        chunk_size=4096, batch_size=8)
    np.save(tmp_path / "in.npy", np.random.default_rng(0).standard_normal((4096, FEATURES), dtype=np.float32))
    job_fills.create_job(store, spec, now=time.time())
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(_run_next(ctx, spec.model_ref)))

    runner.start()
    time.sleep(0.3)
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="cancelled by its owner", now=time.time())
    cancelled_at = time.monotonic()
    runner.join(10)

    assert outcome == ["dropped"] and time.monotonic() - cancelled_at < 2.0  # not the chunk's 25 s of runs
    job = jobs.get_job(store, spec.job_id, now=time.time())
    assert job.status == "cancelled" and job.error == "cancelled by its owner"
    assert "cancelled" not in (job.retries or {})  # the stop is the job's, not a failure of the chunk
    assert not any(name.startswith("failures_") for name in store.client.hkeys(store.keys.counters))
    assert not store.client.zcard(store.keys.inflight(spec.model_ref))


def test_a_redis_blip_while_a_chunk_looks_at_its_job_s_status_does_not_stop_the_chunk(store: Store, zoo_dir: Path,
                                                                                     tmp_path: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir)
    spec = _job(store, tmp_path)
    [item] = lease_items(ctx.store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=1)
    between = BetweenBatches(ctx, item, ticket="")

    time.sleep(STOP_CHECK_SECONDS + 0.05)
    store.drop_connection(1)  # the status read fails as Redis out of reach does
    assert between(_feed(16)) == []  # the chunk goes on
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="cancelled by its owner", now=time.time())
    time.sleep(STOP_CHECK_SECONDS + 0.05)
    with pytest.raises(Cancelled, match="was cancelled while its chunk"):
        between(_feed(16))  # the next look, a second later, reads it
