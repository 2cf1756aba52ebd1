"""A run that takes several lease timeouts, through a real worker process, runs once.

An online batch is one `session.run`; while it runs, only the worker's lease keeper
(`sits_worker/serving/lease_keeper.py`, a thread of the worker process) keeps its leases and its batch ticket
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
from pathlib import Path

import numpy as np
import pytest

from broker.online.requests import encode_array
from broker.state.store import Store
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import direct_run, register, stack_settings, wait_job

LEASE_SECONDS = 1.0
TOKENS = 128
RUN_SECONDS = 3.5
"""How long the one run should take: 3-4 leases. Its rows are sized to this machine (`rows_for_a_long_run`):
about 4,000 on the development machine (about 1,150 rows a second on one ORT thread). Long rows rather
than many short ones, so the outputs (64 floats a row) stay a small JSON answer."""
MOST_ROWS = 10_000
"""As many rows as a request body may carry as base64 .npy (api.max_body_bytes, 16 MiB)."""
CHECKED_ROWS = 32


def rows_for_a_long_run(model: Path) -> int:
    """Rows that take the worker about `RUN_SECONDS` in one run, timed here on 256 rows with the worker's one
    ORT thread; a machine so fast that `MOST_ROWS` take under 2.5 leases cannot show a run this long."""
    sample = np.random.default_rng(0).integers(1, 1000, size=(256, TOKENS)).astype(np.int64)
    direct_run(model, sample[:16], 16)  # warm-up
    started = time.perf_counter()
    direct_run(model, sample, len(sample))
    rate = len(sample) / (time.perf_counter() - started)
    if rate * 2.5 * LEASE_SECONDS > MOST_ROWS:
        pytest.skip(f"this CPU runs {rate:,.0f} rows/s: {MOST_ROWS} rows (the most a body carries) take under"
                    " 2.5 leases")
    return max(1_000, int(rate * RUN_SECONDS))


@pytest.fixture(scope="module")
def long_run_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("long-runs") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        scheduler={"lease_timeout": f"{LEASE_SECONDS}s", "reap_interval": "0.1s",
                   "ticket_timeout": "2s", "ticket_linger": "1s"},  # the linger may be at most half the timeout
        jobs={"max_attempts": 1})
    model = build_zoo(home / "models")["transformer"]
    rows = rows_for_a_long_run(model)
    running = Stack(settings, worker_count=1, api_port=0).start()
    register(running.client(), "transformer", model)
    yield running, rows
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


def test_an_online_run_longer_than_several_leases_keeps_its_lease_and_runs_once(
        long_run_stack: tuple[Stack, int]) -> None:
    stack, rows = long_run_stack
    client, store = stack.client(), stack.store
    ids = np.random.default_rng(11).integers(1, 1000, size=(rows, TOKENS)).astype(np.int64)
    submitted = client.post("/v1/requests", {"model": "transformer",
                                             "inputs": {"input_ids": {"b64": encode_array(ids)}}})
    model_ref = f"transformer@{submitted['model_version']}"

    watched = watch_request(store, submitted["id"], model_ref)
    result = client.get(f"/v1/requests/{submitted['id']}")

    # one lease taken back would have failed it (1 attempt)
    assert result["status"] == "succeeded", str({k: v for k, v in result.items() if k != "outputs"})
    assert watched.leased_for_seconds > 2 * LEASE_SECONDS, f"the run ended too soon for this test: {watched}"
    assert watched.attempts == {"1"} and not watched.back_in_queue_after_lease, watched  # leased once, never reaped
    assert watched.lease_deadlines[-1] - watched.lease_deadlines[0] > LEASE_SECONDS, watched  # the keeper extended it
    assert result["rows"] == rows and result["batch_size"] == 1 and result["job_rows"] == 0, {
        k: v for k, v in result.items() if k != "outputs"}
    assert "reaper:" not in worker_log(stack), "a lease returned, an item dead or a ticket taken for lost"
    embedding = np.array(result["outputs"]["embedding"])
    assert embedding.shape == (rows, 64)
    model = stack.home / "models" / "transformer.onnx"
    for checked in (slice(0, CHECKED_ROWS), slice(rows - CHECKED_ROWS, rows)):
        np.testing.assert_allclose(embedding[checked], direct_run(model, ids[checked], CHECKED_ROWS),
                                   rtol=1e-4, atol=1e-5)


def worker_log(stack: Stack, since: int = 0) -> str:
    """The worker's log from byte `since` on."""
    with open(stack.home / "logs" / "worker0.log", "rb") as log:
        log.seek(since)
        return log.read().decode(errors="replace")


def test_a_job_chunk_whose_one_mini_batch_takes_several_leases_keeps_its_lease_and_runs_once(
        long_run_stack: tuple[Stack, int]) -> None:
    """A chunk extends its own lease and ticket between mini-batches; while one mini-batch runs (here the
    whole chunk, several leases long), the lease keeper holds them."""
    stack, rows = long_run_stack
    client, home = stack.client(), stack.home
    ids = np.random.default_rng(12).integers(1, 1000, size=(rows, TOKENS)).astype(np.int64)
    np.save(home / "long.npy", ids)
    log_before = (home / "logs" / "worker0.log").stat().st_size
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(home / "long.npy"),
                                   "chunk_size": rows, "batch_size": rows, "output_dir": str(home / "long-out")})

    done = wait_job(client, job["id"], timeout=60)

    assert done["status"] == "succeeded", done["error"]  # one lease taken back would have failed it (1 attempt)
    assert done["chunk_runs"] == 1 and done["chunks_done"] == 1, done
    assert done["finished_at"] - done["started_at"] > 2 * LEASE_SECONDS, f"the run ended too soon for this test: {done}"
    assert "reaper:" not in worker_log(stack, log_before), "a lease returned or the ticket taken for lost"
    outputs = np.load(home / "long-out" / "embedding.npy")
    model = home / "models" / "transformer.onnx"
    for checked in (slice(0, CHECKED_ROWS), slice(rows - CHECKED_ROWS, rows)):
        np.testing.assert_allclose(outputs[checked], direct_run(model, ids[checked], CHECKED_ROWS),
                                   rtol=1e-4, atol=1e-5)
