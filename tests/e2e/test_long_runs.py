"""A run that takes several lease timeouts, through a real worker process, runs once.

An online batch is one `session.run`; while it runs, only the worker's lease keeper
(`sits_worker/lease_keeper.py`, a thread of the worker process) keeps its leases and its batch ticket
alive. Here the lease is 1 s, the ticket 2 s, the reaper passes every 0.1 s and an item has a single
attempt (`jobs.max_attempts: 1`), so one lease taken back by the reaper fails the request at once
instead of running it a second time; and the test watches Redis meanwhile for any sign of a second
lease. (A lease shorter than 1 s leaves the keeper, which extends every quarter of a lease on a
thread that wakes every eighth, too little slack on a loaded two-core machine.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from broker.requests import encode_array
from broker.store import Store
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import direct_run, register, stack_settings, wait_job

LEASE_SECONDS = 1.0
ROWS, TOKENS = 4000, 128
"""About 3.5 s of one ORT thread on the development machine's CPU (about 1,150 rows a second): 3-4 leases.
Long rows rather than many short ones, so the outputs (64 floats a row) stay a small JSON answer."""
CHECKED_ROWS = 32


@pytest.fixture(scope="module")
def long_run_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("long-runs") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        scheduler={"lease_timeout": f"{LEASE_SECONDS}s", "reap_interval": "0.1s",
                   "ticket_timeout": "2s", "ticket_linger": "1s"},  # the linger may be at most half the timeout
        jobs={"max_attempts": 1})
    running = Stack(settings, worker_count=1, api_port=0).start()
    register(running.client(), "transformer", build_zoo(home / "models")["transformer"])
    yield running
    running.stop()


@dataclass
class Watched:
    """What the test saw of one request's item in Redis while it was queued or leased."""

    attempts: set[str] = field(default_factory=set)
    lease_deadlines: list[float] = field(default_factory=list)
    leased_for_seconds: float = 0.0
    back_in_queue_after_lease: bool = False


def watch_request(store: Store, request_id: str, model_ref: str, *, timeout: float = 60.0) -> Watched:
    """Poll the request's item (its id is the request's) until the request is no longer queued."""
    watched, leased_at = Watched(), None
    deadline = time.monotonic() + timeout
    while store.client.hget(store.keys.request(request_id), "status") == "queued":
        assert time.monotonic() < deadline, f"request {request_id} not done in {timeout}s"
        pipe = store.client.pipeline(transaction=False)
        pipe.hget(store.keys.attempts, request_id)
        pipe.zscore(store.keys.inflight(model_ref), request_id)
        pipe.zscore(store.keys.ready(model_ref), request_id)
        attempts, lease_deadline, ready_score = pipe.execute()
        if attempts is not None:
            watched.attempts.add(attempts)
        if lease_deadline is not None:
            leased_at = leased_at or time.monotonic()
            watched.leased_for_seconds = time.monotonic() - leased_at
            if not watched.lease_deadlines or lease_deadline != watched.lease_deadlines[-1]:
                watched.lease_deadlines.append(lease_deadline)
        if ready_score is not None and leased_at is not None:
            watched.back_in_queue_after_lease = True
        time.sleep(0.05)
    return watched


def test_an_online_run_longer_than_several_leases_keeps_its_lease_and_runs_once(long_run_stack: Stack) -> None:
    client, store = long_run_stack.client(), long_run_stack.store
    ids = np.random.default_rng(11).integers(1, 1000, size=(ROWS, TOKENS)).astype(np.int64)
    submitted = client.post("/v1/requests", {"model": "transformer",
                                             "inputs": {"input_ids": {"b64": encode_array(ids)}}})
    model_ref = f"transformer@{submitted['model_version']}"

    watched = watch_request(store, submitted["id"], model_ref)
    result = client.get(f"/v1/requests/{submitted['id']}")

    assert result["status"] == "succeeded", result  # one lease taken back would have failed it (1 attempt)
    assert watched.leased_for_seconds > 2 * LEASE_SECONDS, f"the run ended too soon for this test: {watched}"
    assert watched.attempts == {"1"} and not watched.back_in_queue_after_lease, watched  # leased once, never reaped
    assert watched.lease_deadlines[-1] - watched.lease_deadlines[0] > LEASE_SECONDS, watched  # the keeper extended it
    assert result["rows"] == ROWS and result["batch_size"] == 1 and result["job_rows"] == 0, {
        k: v for k, v in result.items() if k != "outputs"}
    log = (long_run_stack.home / "logs" / "worker0.log").read_text()
    assert "reaper:" not in log, log  # no lease returned, no item dead, no ticket taken for lost
    embedding = np.array(result["outputs"]["embedding"])
    assert embedding.shape == (ROWS, 64)
    model = long_run_stack.home / "models" / "transformer.onnx"
    for rows in (slice(0, CHECKED_ROWS), slice(ROWS - CHECKED_ROWS, ROWS)):
        np.testing.assert_allclose(embedding[rows], direct_run(model, ids[rows], CHECKED_ROWS), rtol=1e-4, atol=1e-5)



def test_a_job_chunk_whose_one_mini_batch_takes_several_leases_keeps_its_lease_and_runs_once(
        long_run_stack: Stack) -> None:
    """A chunk extends its own lease between mini-batches; while one mini-batch runs (here the whole
    chunk, several leases long), the lease keeper holds it."""
    client, home = long_run_stack.client(), long_run_stack.home
    ids = np.random.default_rng(12).integers(1, 1000, size=(ROWS, TOKENS)).astype(np.int64)
    np.save(home / "long.npy", ids)
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(home / "long.npy"),
                                   "chunk_size": ROWS, "batch_size": ROWS, "output_dir": str(home / "long-out")})

    done = wait_job(client, job["id"], timeout=60)

    assert done["status"] == "succeeded", done["error"]  # one lease taken back would have failed it (1 attempt)
    assert done["chunk_runs"] == 1 and done["chunks_done"] == 1, done
    assert done["finished_at"] - done["started_at"] > 2 * LEASE_SECONDS, f"the run ended too soon for this test: {done}"
    outputs = np.load(home / "long-out" / "embedding.npy")
    model = home / "models" / "transformer.onnx"
    for rows in (slice(0, CHECKED_ROWS), slice(ROWS - CHECKED_ROWS, ROWS)):
        np.testing.assert_allclose(outputs[rows], direct_run(model, ids[rows], CHECKED_ROWS), rtol=1e-4, atol=1e-5)
