"""The drain loop's bounds (real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.monitoring.batch_sizes import decode_batch_sizes
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import tickets
from broker.state.store import Store
from sits_worker.serving import drain_loop
from sits_worker.serving.drain_report import DrainReport
from sits_worker.upkeep.heartbeat import flush_batch_sizes
from tests.worker.worker_helpers import mlp_worker_context


@pytest.mark.timeout(30)  # (without the bound the loop never returns)
def test_a_loop_that_sees_no_work_while_release_says_work_waits_yields_at_its_slice_end(
        store: Store, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work that came in between the snapshot and the release is looked for again at once; but were the
    two ever to disagree for good (a watcher missing a queue, as one could before), the loop must not
    spin on Redis with its ticket for ever: it yields at the end of its time slice."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        scheduler={"ticket_time_slice": 0.2, "ticket_linger": 0}))
    [ticket] = tickets.top_up_tickets(store, now=time.time(), target=1)
    calls: list[float] = []

    def work_waits(store: Store, ticket: str) -> bool:
        calls.append(time.monotonic())
        return False

    monkeypatch.setattr(tickets, "release_ticket", work_waits)
    began = time.monotonic()

    assert drain_loop.drain(ctx, ticket) == "yield"
    assert 0.2 <= time.monotonic() - began < 5 and len(calls) > 1


def test_a_paused_slot_passes_on_a_ring_it_could_not_use_to_the_next_waiter_once_a_second(store: Store) -> None:
    """Redis hands a ring to the client that blocked first: a calm worker's slot waiting meanwhile gets
    the ring a paused slot was woken by, and the paused slot passes on no more than once a second."""
    got: list[object] = []

    def calm_slot() -> None:  # (its own thread: its own connection)
        got.append(store.client.blpop([store.keys.doorbell], timeout=2))

    paused = drain_loop.PausedRing()
    paused.woken = True  # its last wait was ended by a ring, and its lease found only paused work again
    blocked_before = store.client.info("clients")["blocked_clients"]
    waiter = threading.Thread(target=calm_slot)
    waiter.start()
    while store.client.info("clients")["blocked_clients"] <= blocked_before:  # (the calm slot blocks first)
        time.sleep(0.005)

    paused.wait(store, "")
    waiter.join(3)

    assert got and got[0] is not None  # the calm slot got the passed ring
    assert not paused.woken  # and the paused slot's own wait timed out
    tickets.ring_doorbell(store)
    paused.wait(store, "")  # woken by a ring again ...
    assert paused.woken
    paused.wait(store, "")  # ... but within a second of passing one on: no ring passed, the wait times out
    assert not paused.woken and store.client.llen(store.keys.doorbell) == 0


def test_a_drain_reports_what_it_ran_and_its_runs_reach_the_batch_size_histograms(
        store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """The drain task's Celery result (what Flower shows) says what ran under the ticket: its runs, their
    rows, the requests and chunks, the model versions; the same runs are the ones the worker's heartbeat
    adds to the batch size histograms."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(scheduler={"ticket_linger": 0}))
    for index in range(3):
        spec = RequestSpec(request_id=f"r{index}", model_name="mlp", model_version="v1",
                           inputs={"features": np.ones((1, 64), dtype=np.float32)}, rows=1, tokens=None, bucket="",
                           factors={"level": 0})
        requests.submit_request(store, spec, score=0.0, now=time.time(), max_age_seconds=60)
    np.save(tmp_path / "in.npy", np.zeros((40, 64), dtype=np.float32))
    job = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                       input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                       output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=40, chunk_size=20,
                       batch_size=16)
    job_fills.create_job(store, job, now=time.time())
    [ticket] = tickets.top_up_tickets(store, now=time.time(), target=1)
    report = DrainReport()

    assert drain_loop.drain(ctx, ticket, report) == "released"
    flush_batch_sizes(ctx)

    result = json.loads(json.dumps(report.to_json()))  # (a Celery result: plain JSON)
    assert result == {"outcome": "released", "batches": report.batches, "rows": 43, "requests": 3, "chunks": 2,
                      "models": ["mlp@v1"]}
    assert report.batches >= 4  # two mini-batches of each chunk (16 and 4 rows), the requests' batch unless they rode
    assert jobs.get_job(store, job.job_id, now=time.time()).status == "succeeded"
    sizes = decode_batch_sizes(store.client.hgetall(store.keys.batch_sizes))
    assert set(sizes) == {("mlp@v1", "rows")}  # (no tokens: the mlp is no token model)
    assert sizes[("mlp@v1", "rows")].count == report.batches and sizes[("mlp@v1", "rows")].total == 43
    assert ctx.batch_sizes.pending() == {}
