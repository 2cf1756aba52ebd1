"""Online requests and offline job rows in one inference run, through a real stack.

One worker with one stream slot, FIFO order (so no request outranks a chunk and the only way a
request gets in early is to ride along): requests of a running chunk's model and shape bucket
join its next mini-batch, and a batch of requests that leaves rows empty takes a waiting chunk
along. A request's `batch_size` is the rows of the run it was part of, so job rows in it show:
`merge_latency_factor` is set high, so job rows fill every empty row of an online batch (8).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from broker.jobs import progress as job_progress
from broker.online.requests import encode_array
from tests.e2e.stack_helpers import direct_run, start_zoo_stack, wait_job

JOB_BATCH = 16
MAX_BATCH = 8


@pytest.fixture(scope="module")
def fifo_stack(tmp_path_factory):
    running = start_zoo_stack(tmp_path_factory.mktemp("ride") / "home",
                              scheduler={"policy": "fifo", "merge_latency_factor": 100.0},
                              online={"batching": {"max_batch_size": MAX_BATCH}})
    yield running
    running.stop()


def submit_job(stack, name: str, model: str, rows: np.ndarray, **fields) -> dict:
    np.save(stack.home / f"{name}.npy", rows)
    return stack.client().post("/v1/jobs", {"model": model, "input_batch": str(stack.home / f"{name}.npy"),
                                            "chunk_size": len(rows), "batch_size": JOB_BATCH,
                                            "output_dir": str(stack.home / f"{name}-out"), **fields})


def call_all(stack, bodies: list[dict]) -> list[dict]:
    client = stack.client()
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: client.post("/v1/requests", {**body, "wait": True}), bodies))


def test_requests_ride_in_the_mini_batches_of_a_running_chunk_of_their_model(fifo_stack):
    """Convnet requests arrive while a 1,500-row convnet chunk runs on the only slot: they are answered
    in runs with the chunk's rows (the first rows of a mini-batch fill their batch) long before the
    chunk ends, and both the job's outputs and theirs equal the model run alone."""
    client, model = fifo_stack.client(), fifo_stack.home / "models" / "convnet.onnx"
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((1500, 3, 32, 32)).astype(np.float32)
    job = submit_job(fifo_stack, "ride", "convnet", pixels)
    wait_job(client, job["id"], until=lambda j: j["status"] == "running")
    time.sleep(0.2)  # the chunk is leased and running its mini-batches

    singles = rng.standard_normal((3, 1, 3, 32, 32)).astype(np.float32)
    results = call_all(fifo_stack, [{"model": "convnet", "inputs": {"pixels": one.tolist()}} for one in singles])
    during = client.get(f"/v1/jobs/{job['id']}")

    assert during["status"] == "running" and during["chunks_done"] == 0, during
    for one, result in zip(singles, results, strict=True):
        assert result["status"] == "succeeded", result
        assert result["batch_size"] == MAX_BATCH and result["job_rows"] >= MAX_BATCH - 3, result  # job rows filled it
        np.testing.assert_allclose(np.array(result["outputs"]["logits"]), direct_run(model, one, 1),
                                   rtol=1e-4, atol=1e-5)
    assert wait_job(client, job["id"])["status"] == "succeeded"
    np.testing.assert_allclose(np.load(fifo_stack.home / "ride-out" / "logits.npy"), direct_run(model, pixels, 64),
                               rtol=1e-4, atol=1e-5)


def test_token_requests_ride_padded_with_a_chunk_of_another_length_in_their_class(fifo_stack):
    """Transformer rows of 12 tokens (length class 16) in a job; requests of 9-16 tokens ride along:
    everything is padded to the longest, masked, and cut back, so every output is exact."""
    client, model = fifo_stack.client(), fifo_stack.home / "models" / "transformer.onnx"
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 1000, size=(30_000, 12)).astype(np.int64)  # about 1.5 s of work
    job = submit_job(fifo_stack, "tokens", "transformer", ids)
    wait_job(client, job["id"], until=lambda j: j["status"] == "running")
    time.sleep(0.2)

    sequences = [rng.integers(1, 1000, size=(1, length)).astype(np.int64) for length in (9, 14, 16)]
    results = call_all(fifo_stack, [{"model": "transformer", "inputs": {"input_ids": s.tolist()}} for s in sequences])
    during = client.get(f"/v1/jobs/{job['id']}")

    assert during["status"] == "running" and during["chunks_done"] == 0, during
    for sequence, result in zip(sequences, results, strict=True):
        assert result["status"] == "succeeded" and result["batch_size"] == MAX_BATCH and result["job_rows"], result
        np.testing.assert_allclose(np.array(result["outputs"]["embedding"]), direct_run(model, sequence, 1),
                                   rtol=1e-4, atol=1e-5)
    assert wait_job(client, job["id"])["status"] == "succeeded"
    outputs = np.load(fifo_stack.home / "tokens-out" / "embedding.npy")
    np.testing.assert_allclose(outputs, direct_run(model, ids, 64), rtol=1e-4, atol=1e-5)


def test_a_batch_of_requests_with_rows_to_spare_takes_a_waiting_chunk_along(fifo_stack):
    """While a large transformer request holds the slot, three convnet requests and then a convnet job queue
    up (FIFO: requests first). The slot leases the requests' batch of 3 (of 8) and the chunk with it: 5 rows
    of the chunk's first mini-batch fill the requests' run. (The slot is held by a request, not a chunk: a
    chunk's part file is still being written when it ends, and a slot whose commits are all pending leases
    requests without a chunk until one is done, `Commits.has_room`.)"""
    client = fifo_stack.client()
    rng = np.random.default_rng(2)
    long_ids = rng.integers(1, 1000, size=(20_000, 12)).astype(np.int64)  # one run of about a second
    busy = client.post("/v1/requests", {"model": "transformer",
                                        "inputs": {"input_ids": {"b64": encode_array(long_ids)}}})
    time.sleep(0.3)  # an idle slot leases it at once
    singles = rng.standard_normal((3, 1, 3, 32, 32)).astype(np.float32)
    ids = [client.post("/v1/requests", {"model": "convnet", "inputs": {"pixels": one.tolist()}})["id"]
           for one in singles]
    pixels = rng.standard_normal((200, 3, 32, 32)).astype(np.float32)
    job = submit_job(fifo_stack, "after", "convnet", pixels)
    still = client.get(f"/v1/requests/{busy['id']}")
    assert still["status"] == "queued", f"the transformer request ended too soon for this test: {still}"

    results = [wait_request(client, request_id) for request_id in ids]
    assert all(result["batch_size"] == MAX_BATCH and result["job_rows"] == MAX_BATCH - 3 for result in results), results
    model = fifo_stack.home / "models" / "convnet.onnx"
    for one, result in zip(singles, results, strict=True):
        np.testing.assert_allclose(np.array(result["outputs"]["logits"]), direct_run(model, one, 1),
                                   rtol=1e-4, atol=1e-5)
    assert wait_job(client, job["id"])["status"] == "succeeded"
    np.testing.assert_allclose(np.load(fifo_stack.home / "after-out" / "logits.npy"), direct_run(model, pixels, 64),
                               rtol=1e-4, atol=1e-5)
    assert wait_request(client, busy["id"])["rows"] == len(long_ids)


def wait_request(client, request_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while (result := client.get(f"/v1/requests/{request_id}"))["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, result
        time.sleep(0.05)
    assert result["status"] == "succeeded", result
    return result


def test_a_request_that_fills_its_batch_alone_runs_apart_between_two_mini_batches(fifo_stack):
    """An 8-row request leaves no row empty for job rows: it runs as a batch of its own on the chunk's
    slot before the next mini-batch (FIFO: only riding lets it in before the chunk ends), exact."""
    client, model = fifo_stack.client(), fifo_stack.home / "models" / "convnet.onnx"
    rng = np.random.default_rng(4)
    job = submit_job(fifo_stack, "apart", "convnet", rng.standard_normal((1500, 3, 32, 32)).astype(np.float32))
    wait_job(client, job["id"], until=lambda j: j["status"] == "running")
    time.sleep(0.2)

    pixels = rng.standard_normal((MAX_BATCH, 3, 32, 32)).astype(np.float32)
    result = client.post("/v1/requests", {"model": "convnet", "inputs": {"pixels": pixels.tolist()}, "wait": True})
    during = client.get(f"/v1/jobs/{job['id']}")

    assert result["status"] == "succeeded" and result["batch_size"] == 1 and result["job_rows"] == 0, result
    assert during["status"] == "running" and during["chunks_done"] == 0, during
    np.testing.assert_allclose(np.array(result["outputs"]["logits"]), direct_run(model, pixels, MAX_BATCH),
                               rtol=1e-4, atol=1e-5)
    assert wait_job(client, job["id"])["status"] == "succeeded"


def test_a_chunk_whose_ticket_is_replaced_midway_still_runs_once_to_its_end(fifo_stack):
    """Every ticket taken for lost while a chunk runs (as after a long stall): the chunk, still leased
    to its worker, stops looking for riders and finishes; it is not run a second time."""
    client, store = fifo_stack.client(), fifo_stack.store
    job = submit_job(fifo_stack, "stale", "convnet",
                     np.random.default_rng(5).standard_normal((1500, 3, 32, 32)).astype(np.float32))
    wait_job(client, job["id"], until=lambda j: j["status"] == "running")
    time.sleep(0.2)
    store.client.delete(store.keys.tickets)

    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded" and done["chunk_runs"] == 1, done
    assert job_progress.last_error(store, job["id"]) is None  # no attempt failed on the way
