"""Online requests through a real stack: results, merged batches, priorities, bad input."""

from __future__ import annotations

import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sits_worker.model.zoo import mlp_reference
from tests.e2e.stack_helpers import direct_run, register, start_stack, start_zoo_stack, wait_job
from tests.waiting import eventually


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("online") / "home"
    running = start_stack(home, workers=1, streams=2)
    models = build_zoo(home / "models")
    client = running.client()
    for name in ("mlp", "transformer"):
        register(client, name, models[name])
    yield running
    running.stop()


def test_a_waiting_request_returns_the_model_output(stack):
    features = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    result = stack.client().post("/v1/requests", {"model": "mlp", "inputs": {"features": features.tolist()},
                                                  "wait": True})
    assert result["status"] == "succeeded", result
    np.testing.assert_allclose(np.array(result["outputs"]["logits"]), mlp_reference(features), rtol=1e-4, atol=1e-5)
    assert result["latency_ms"] > 0 and result["batch_size"] >= 1


def test_a_request_without_wait_is_fetched_later(stack):
    buffer = io.BytesIO()
    rows = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    np.save(buffer, rows)
    client = stack.client()
    accepted = client.post("/v1/requests", {"model": "mlp", "inputs": {"features": {
        "b64": base64.b64encode(buffer.getvalue()).decode()}}})
    assert accepted["status"] == "queued" and accepted["id"].startswith("r")
    deadline = time.monotonic() + 30
    while (result := client.get(f"/v1/requests/{accepted['id']}"))["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    np.testing.assert_allclose(np.array(result["outputs"]["logits"]), mlp_reference(rows), rtol=1e-4, atol=1e-5)


def test_concurrent_requests_are_merged_into_batches_with_exact_results(stack):
    client = stack.client()
    rng = np.random.default_rng(2)
    rows = [rng.standard_normal((1, 64)).astype(np.float32) for _ in range(200)]

    def call(features: np.ndarray) -> dict:
        return client.post("/v1/requests", {"model": "mlp", "inputs": {"features": features.tolist()}, "wait": True})

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, rows))
    assert all(result["status"] == "succeeded" for result in results)
    for features, result in zip(rows, results, strict=True):
        np.testing.assert_allclose(np.array(result["outputs"]["logits"]), mlp_reference(features), rtol=1e-4,
                                   atol=1e-5)
    assert max(result["batch_size"] for result in results) > 1, "16 concurrent clients never shared a batch"


def test_a_model_registered_without_a_measured_profile_learns_one_from_the_batches_it_runs(stack):
    client = stack.client()
    features = np.zeros((1, 64), np.float32).tolist()
    for _ in range(5):
        assert client.post("/v1/requests", {"model": "mlp", "inputs": {"features": features}, "wait": True})[
            "status"] == "succeeded"
    deadline = time.monotonic() + 15  # the worker writes what it observed from its heartbeat (every 2 s)
    while (profile := client.get("/v1/models/mlp").get("profile") or {}).get("source") != "observed":
        assert time.monotonic() < deadline, profile
        time.sleep(0.2)
    assert profile["points"] and all(point["latency_ms"] > 0 for point in profile["points"])


def test_bad_requests_get_a_clear_4xx(stack):
    from sits_api.cli.client import ApiError

    client = stack.client()
    with pytest.raises(ApiError, match="400.*features.*float32"):
        client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[1.0] * 63]}})
    with pytest.raises(ApiError, match="404.*not registered"):
        client.post("/v1/requests", {"model": "nope", "inputs": {"features": [[1.0] * 64]}})
    with pytest.raises(ApiError, match="400.*priority"):
        client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[1.0] * 64]}, "priority": 16})
    with pytest.raises(ApiError, match="404"):
        client.get("/v1/requests/rnothere")


@pytest.fixture(scope="module")
def delayed_stack(tmp_path_factory):
    """A stack whose batches wait up to 300 ms for company; the transformer's batches hold 64 tokens."""
    running = start_zoo_stack(
        tmp_path_factory.mktemp("delayed") / "home",
        online={"batching": {"max_batch_size": 8, "max_queue_delay": "300ms"},
                "models": {"transformer": {"max_batch_tokens": 64}}},
        resources={"device_memory_limit": "1GiB", "cpu_memory_granularity": "4MiB"})
    yield running
    running.stop()


def test_a_running_job_yields_between_mini_batches_to_a_request_that_outranks_it(delayed_stack):
    """One stream slot, busy with one long job chunk: the request is served on that slot between two of
    the chunk's mini-batches, long before the chunk ends (it does not wait for the whole chunk)."""
    client = delayed_stack.client()
    pixels = np.random.default_rng(0).standard_normal((1500, 3, 32, 32)).astype(np.float32)
    np.save(delayed_stack.home / "busy.npy", pixels)
    job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(delayed_stack.home / "busy.npy"),
                                   "chunk_size": 1500, "batch_size": 16,
                                   "output_dir": str(delayed_stack.home / "busy-out")})
    wait_job(client, job["id"], until=lambda j: j["status"] == "running")
    time.sleep(0.2)  # the chunk is leased and running its mini-batches

    result = client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[0.5] * 64]}, "priority": 8,
                                          "user_tier": "vip", "wait": True})
    during = client.get(f"/v1/jobs/{job['id']}")

    assert result["status"] == "succeeded"
    assert during["status"] == "running" and during["chunks_done"] == 0, during
    finished = wait_job(client, job["id"])
    assert finished["status"] == "succeeded", finished


def test_max_queue_delay_lets_a_batch_fill_up(delayed_stack):
    client = delayed_stack.client()

    def call(index: int) -> dict:
        time.sleep(0.01 * index)  # 8 requests spread over 70 ms: without the delay, several batches
        return client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[float(index)] * 64]},
                                            "wait": True})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    assert all(result["status"] == "succeeded" for result in results)
    assert max(result["batch_size"] for result in results) == 8


def test_token_requests_of_nearby_lengths_are_padded_into_batches_within_max_batch_tokens(delayed_stack):
    """Lengths 9-16 share the length class 16 (25 and 30 share 32): the worker pads them into one batch,
    at most 64 // 16 = 4 requests (64 // 32 = 2), and every result equals the request run alone."""
    client = delayed_stack.client()
    rng = np.random.default_rng(3)
    lengths = [9, 12, 15, 16, 10, 11, 13, 14, 30, 25, 5]
    sequences = [rng.integers(1, 1000, size=(1, length)).astype(np.int64) for length in lengths]

    def call(index: int) -> dict:
        time.sleep(0.005 * index)
        return client.post("/v1/requests", {"model": "transformer", "inputs": {"input_ids": sequences[index].tolist()},
                                            "wait": True})

    with ThreadPoolExecutor(len(lengths)) as pool:
        results = list(pool.map(call, range(len(lengths))))
    model = delayed_stack.home / "models" / "transformer.onnx"
    for ids, result in zip(sequences, results, strict=True):
        assert result["status"] == "succeeded", result
        np.testing.assert_allclose(np.array(result["outputs"]["embedding"]), direct_run(model, ids, 1),
                                   rtol=1e-4, atol=1e-5)
    class_16 = [result["batch_size"] for length, result in zip(lengths, results, strict=True) if 9 <= length <= 16]
    class_32 = [result["batch_size"] for length, result in zip(lengths, results, strict=True) if length > 16]
    assert max(class_16) == 4, class_16  # merged across different lengths, and no further than the budget
    assert max(class_32) <= 2, class_32


def test_an_idle_ticket_lingers_for_the_next_request_then_retires(stack):
    """Within `ticket_linger` (1 s) of the last batch the next request is served without a new drain
    task (no new ticket); after it, the tickets retire and the next request creates one again."""
    client, store = stack.client(), stack.store
    body = {"model": "mlp", "inputs": {"features": [[0.25] * 64]}, "wait": True}

    assert client.post("/v1/requests", body)["status"] == "succeeded"
    tickets_made = int(store.client.get(store.keys.ticket_seq))
    time.sleep(0.2)
    assert client.post("/v1/requests", body)["status"] == "succeeded"
    assert int(store.client.get(store.keys.ticket_seq)) == tickets_made
    assert store.client.zcard(store.keys.tickets) >= 1  # lingering

    assert eventually(lambda: not store.client.zcard(store.keys.tickets),
                      timeout=10, interval=0.1), "the idle tickets never retired"
    assert client.post("/v1/requests", body)["status"] == "succeeded"
    assert int(store.client.get(store.keys.ticket_seq)) > tickets_made


def test_the_worker_ledger_takes_the_memory_limit_and_unit_from_the_settings(delayed_stack):
    """`device_memory_limit` caps the worker's ledger (16 GiB configured) and a CPU worker reserves in
    `cpu_memory_granularity` units, as the worker process reports them in /v1/status."""
    client = delayed_stack.client()
    client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[0.5] * 64]}, "wait": True})
    deadline = time.monotonic() + 30
    while not (workers := client.get("/v1/status")["workers"]) or "granularity_bytes" not in workers[0]["memory"]:
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)

    memory = workers[0]["memory"]
    assert (memory["capacity_bytes"], memory["granularity_bytes"]) == (2**30, 4 * 2**20)
