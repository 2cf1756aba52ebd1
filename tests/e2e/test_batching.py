"""Batching settings through a real worker: preferred batch sizes cut batches as Triton's do, and
`auto` settings follow the model's measured profile.

Every request is queued while the worker is frozen, so its one stream slot finds them all waiting
when it first looks; the batches it forms are read back from each result's `batch_size`.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sits_api.cli.client import ApiClient
from sits_api.cli.stack import Stack
from sits_worker.model.zoo import build_zoo, mlp_reference
from tests.e2e.stack_helpers import collect, frozen, stack_settings, wait_job
from tests.onnx_models import fixed_batch_model


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One worker with one stream slot; `mlp` prefers batches of 4 (at most 8), `mlp_auto` leaves its
    batching to its measured profile under a 1 µs batch budget ("0.001ms"), `mlp_default` to the defaults."""
    home = tmp_path_factory.mktemp("batching") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        scheduler={"worker_heartbeat_timeout": "30s", "ticket_timeout": "30s"},  # frozen while requests queue
        online={"models": {"mlp": {"max_batch_size": 8, "preferred_batch_sizes": [4], "max_queue_delay": 0},
                           "mlp_auto": {"max_batch_latency": "0.001ms"}}})
    running = Stack(settings, worker_count=1, api_port=0).start()
    models = build_zoo(home / "models")
    client = running.client()
    client.post("/v1/models", {"name": "mlp", "path": str(models["mlp"])})
    for name in ("mlp_auto", "mlp_default"):
        record = client.post("/v1/models", {"name": name, "path": str(models["mlp"]), "profile_mode": "full"})
        wait_profiled(client, record["ref"])
    yield running
    running.stop()


def wait_profiled(client: ApiClient, ref: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (record := client.get(f"/v1/models/{ref}"))["profile_status"] == "pending":
        assert time.monotonic() < deadline, f"{ref} not profiled in {timeout}s"
        time.sleep(0.1)
    assert record["profile_status"] == "ready", record


def queue_while_frozen(stack: Stack, model: str, rows: np.ndarray) -> list[dict[str, Any]]:
    """Submit one request per row while the worker is frozen; their results, in row order."""
    client = stack.client()
    with frozen(stack, "worker0"), ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda row: client.post("/v1/requests", {
            "model": model, "inputs": {"features": rows[row : row + 1].tolist()}})["id"], range(len(rows))))
    results = collect(client, ids)
    return [results[request_id] for request_id in ids]


def test_a_queue_of_ten_runs_as_the_largest_preferred_batches_it_fills_then_what_is_left(stack):
    """max_batch_size 8, preferred [4]: 10 waiting requests run as 4 + 4 + 2 (8 + 2 without the
    preference), every result exact."""
    rows = np.random.default_rng(0).standard_normal((10, 64)).astype(np.float32)
    results = queue_while_frozen(stack, "mlp", rows)

    assert all(result["status"] == "succeeded" for result in results), results
    np.testing.assert_allclose(np.array([result["outputs"]["logits"][0] for result in results]),
                               mlp_reference(rows), rtol=1e-4, atol=1e-5)
    assert Counter(result["batch_size"] for result in results) == {4: 8, 2: 2}


def test_auto_batching_follows_the_measured_profile(stack):
    """Under a 1 µs budget no measured batch fits, so `mlp_auto` runs batches of the smallest measured
    size (one request each) where the defaults merge everything waiting; the API shows both settings
    and where they came from."""
    client = stack.client()
    auto = client.get("/v1/models/mlp_auto")
    default = client.get("/v1/models/mlp_default")
    points = {point["batch_size"]: point["latency_ms"] for point in default["profile"]["points"]}
    assert auto["batching"]["max_batch_size"] == min(points) == 1
    assert auto["batching"]["source"] == default["batching"]["source"] == "profile"
    assert default["batching"]["max_batch_size"] == max(size for size, ms in points.items() if ms <= 50)
    assert client.get("/v1/models/mlp")["batching"] == {
        "max_batch_size": 8, "max_queue_delay_ms": 0.0, "preferred_batch_sizes": [4], "max_batch_tokens": 8192,
        "queue_capacity": 1024, "streams": None, "source": "config"}

    rows = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    alone = queue_while_frozen(stack, "mlp_auto", rows)
    merged = queue_while_frozen(stack, "mlp_default", rows)

    for results in (alone, merged):
        assert all(result["status"] == "succeeded" for result in results), results
        np.testing.assert_allclose(np.array([result["outputs"]["logits"][0] for result in results]),
                                   mlp_reference(rows), rtol=1e-4, atol=1e-5)
    assert [result["batch_size"] for result in alone] == [1] * 6
    assert [result["batch_size"] for result in merged] == [6] * 6



def test_models_with_a_fixed_batch_axis_serve_merged_requests_and_jobs_of_any_size(stack):
    """A model exported with batch 1 (or 4) fixed in its inputs: waiting requests are still merged,
    a request and a job of any number of rows run, in pieces of the fixed size (the last one
    padded), and every row's outputs are its own."""
    client = stack.client()
    home = Path(stack.settings.paths.home)
    for rows_per_run in (1, 4):
        path = fixed_batch_model(home / f"fixed{rows_per_run}.onnx", rows_per_run)
        record = client.post("/v1/models", {"name": f"fixed{rows_per_run}", "path": str(path), "profile_mode": "full"})
        wait_profiled(client, record["ref"])
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    b = a[::-1] * -0.5

    with frozen(stack, "worker0"):
        ids = [client.post("/v1/requests", {"model": "fixed1", "inputs": {"a": a[row : row + 1].tolist(),
                                                                             "b": b[row : row + 1].tolist()}})["id"]
               for row in range(5)]
    merged = collect(client, ids)
    assert [merged[request_id]["batch_size"] for request_id in ids] == [5] * 5
    np.testing.assert_array_equal([merged[request_id]["outputs"]["total"][0] for request_id in ids], (a + b)[:5])

    three_rows = client.post("/v1/requests", {"model": "fixed4", "inputs": {"a": a[:3].tolist(), "b": b[:3].tolist()},
                                              "wait": True})
    assert three_rows["status"] == "succeeded", three_rows
    np.testing.assert_array_equal(three_rows["outputs"]["product"], (a * b)[:3])

    data = home / "fixed-input.npz"
    np.savez(data, a=a, b=b)
    for rows_per_run in (1, 4):
        out = home / f"fixed-out{rows_per_run}"
        job = client.post("/v1/jobs", {"model": f"fixed{rows_per_run}", "input_batch": str(data),
                                       "output_dir": str(out), "chunk_size": 6, "batch_size": 5})
        job = wait_job(client, job["id"], timeout=60)
        assert job["status"] == "succeeded", job
        np.testing.assert_array_equal(np.load(out / "total.npy"), a + b)
        np.testing.assert_array_equal(np.load(out / "product.npy"), a * b)
