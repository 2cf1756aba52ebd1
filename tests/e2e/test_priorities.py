"""Priority order through real workers: across models and tenants' tiers, and aging under a flood."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, stack_settings, wait_job


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("prio") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        online={"batching": {"max_batch_size": 1}},
        scheduler={"yield_check_interval": "1h"})  # the job's chunk must hold the only stream: requests queue up
    running = Stack(settings, worker_count=1, api_port=0).start()
    models = build_zoo(home / "models")
    for name in ("mlp", "convnet", "transformer"):
        register(running.client(), name, models[name])
    running.client().request("PUT", "/v1/policy", {"ordering": "dynamic"})  # whatever the configured policy
    yield running
    running.stop()


def occupy_the_worker(stack, rows: int = 1500) -> dict:
    """One long job chunk keeps the only stream busy while the test queues requests behind it."""
    client = stack.client()
    pixels = np.random.default_rng(0).standard_normal((rows, 3, 32, 32)).astype(np.float32)
    path = stack.home / f"busy-{time.monotonic_ns()}.npy"
    np.save(path, pixels)
    job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(path), "chunk_size": rows,
                                   "output_dir": str(stack.home / f"out-{path.stem}")})
    return wait_job(client, job["id"], until=lambda j: j["status"] == "running")


def finish_order(stack, ids: list[str]) -> list[str]:
    client = stack.client()
    deadline = time.monotonic() + 60
    results = {}
    while len(results) < len(ids):
        assert time.monotonic() < deadline
        for request_id in set(ids) - set(results):
            result = client.get(f"/v1/requests/{request_id}")
            if result["status"] == "succeeded":
                results[request_id] = result["finished_at"]
        time.sleep(0.05)
    return sorted(ids, key=results.__getitem__)


def test_priority_order_is_respected_across_models_and_tiers(stack):
    client = stack.client()
    features = [[0.1] * 64]
    occupy_the_worker(stack)
    submitted = {}
    for label, body in [
        ("mlp free p0", {"model": "mlp", "inputs": {"features": features}, "user_tier": "free"}),
        ("mlp premium p0", {"model": "mlp", "inputs": {"features": features}, "user_tier": "premium"}),
        ("mlp vip p0", {"model": "mlp", "inputs": {"features": features}, "user_tier": "vip"}),
        ("mlp free p5", {"model": "mlp", "inputs": {"features": features}, "priority": 5}),
        ("transformer short (express)", {"model": "transformer", "inputs": {"input_ids": [[1] * 8]}}),
    ]:
        submitted[client.post("/v1/requests", body)["id"]] = label

    order = [submitted[request_id] for request_id in finish_order(stack, list(submitted))]

    assert order == ["transformer short (express)", "mlp free p5", "mlp vip p0", "mlp premium p0", "mlp free p0"]


def test_aging_lets_a_low_priority_request_through_a_high_priority_flood(stack):
    client = stack.client()
    client.request("PUT", "/v1/policy", {"delta": 50.0})  # 50 points a second: 10 levels are overtaken in 0.2 s
    try:
        occupy_the_worker(stack, rows=600)
        low = client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[0.2] * 64]}})["id"]
        time.sleep(0.3)
        flood = [client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[0.3] * 64]},
                                              "priority": 10})["id"] for _ in range(30)]
        order = finish_order(stack, [low, *flood])
    finally:
        client.request("PUT", "/v1/policy", {"delta": 0.1})
    assert order.index(low) == 0, "the aged low-priority request must not wait behind newer urgent ones"
