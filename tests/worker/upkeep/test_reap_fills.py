"""A reaper pass completes the fill, or the stop, of a job whose API process died between two of its calls
(real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import slices as job_slices
from broker.jobs import stops as job_stops
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.serving.context import WorkerContext
from sits_worker.upkeep.reaper import reap
from tests.leasing import lease_items


def worker_context(store: Store) -> WorkerContext:
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                         sessions=SessionCache(Device("cpu"), 1))


def job_spec(job_id: str, *, rows_total: int) -> jobs.JobSpec:
    """A job of `rows_total` chunks of one row."""
    return jobs.JobSpec(job_id=job_id, model_name="mlp", model_version="v1", input_batch="/data/in.npy",
                        input_format="npy", input_checksum="sha256:0123abcd", output_dir="/data/out",
                        output_names=["logits"], rows_total=rows_total, chunk_size=1, batch_size=1)


def test_a_reaper_pass_queues_the_chunks_a_dead_fill_left_out(store: Store) -> None:
    ctx = worker_context(store)
    now = time.time()
    job_fills.create_job(store, job_spec("cut", rows_total=6), now=now)
    ready = store.keys.ready("mlp@v1")
    store.client.zrem(ready, *(jobs.chunk_item_id("cut", index) for index in range(2, 6)))  # as if never queued
    store.client.zadd(store.keys.jobs_filling, {"cut": now})
    sent: list[str] = []

    reap(ctx, sent.append, now=now + 1)  # its caller may only be slow
    assert store.client.zcard(ready) == 2

    reap(ctx, sent.append, now=now + job_slices.FILL_STALLED_SECONDS + 1)
    assert sorted(store.client.zrange(ready, 0, -1)) == [jobs.chunk_item_id("cut", index) for index in range(6)]
    assert store.client.zcard(store.keys.jobs_filling) == 0


class CallerDied(Exception):
    """The API process making a sliced call died (SIGKILL) before its next call."""


def cut_after_first_call(store: Store, script: str, call: Callable[[], object]) -> None:
    """Run `call` as a process killed after its first call of `script` leaves it (the real script runs)."""
    registered = getattr(store.scripts, script)
    made: list[int] = []

    def first_only(*, keys: list[str], args: list[object]) -> object:
        if made:
            raise CallerDied
        made.append(1)
        return registered(keys=keys, args=args)

    setattr(store.scripts, script, first_only)
    try:
        call()
    except CallerDied:
        pass
    finally:
        setattr(store.scripts, script, registered)


def test_a_reaper_pass_takes_out_the_items_a_dead_stop_left(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_slices, "ENQUEUE_SLICE", 3)
    ctx, sent = worker_context(store), list[str]()
    now = time.time()
    job_fills.create_job(store, job_spec("cut", rows_total=8), now=now)
    job_fills.create_job(store, job_spec("other", rows_total=4), now=now)
    cut_after_first_call(store, "stop_job",
                         lambda: job_stops.stop_job(store, "cut", status="cancelled", error="", now=now))
    ready = store.keys.ready("mlp@v1")
    assert len([item for item in store.client.zrange(ready, 0, -1) if item.startswith("cut:")]) == 5

    reap(ctx, sent.append, now=now + 1)  # its caller may only be slow
    assert store.client.zcard(ready) == 5 + 4

    reap(ctx, sent.append, now=now + job_slices.FILL_STALLED_SECONDS + 1)
    assert store.client.zrange(ready, 0, -1) == [jobs.chunk_item_id("other", index) for index in range(4)]
    assert store.client.zcard(store.keys.jobs_stopping) == 0
    assert jobs.get_job(store, "cut", now=now).status == "cancelled"


def test_a_reaper_pass_completes_a_dead_resume_taking_leases_back_at_once(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_slices, "ENQUEUE_SLICE", 3)
    ctx, sent = worker_context(store), list[str]()
    now = time.time()
    job_fills.create_job(store, job_spec("run", rows_total=6), now=now)
    lease_items(store, "mlp@v1", now=now, lease_seconds=600, max_items=6)  # the run that died
    cut_after_first_call(store, "enqueue_items", lambda: job_fills.resume_job(store, "run", now=now))
    ready, inflight = store.keys.ready("mlp@v1"), store.keys.inflight("mlp@v1")
    assert store.client.zcard(ready) == 3 and store.client.zcard(inflight) == 3

    reap(ctx, sent.append, now=now + job_slices.FILL_STALLED_SECONDS + 1)  # long before those leases run out

    assert sorted(store.client.zrange(ready, 0, -1)) == [jobs.chunk_item_id("run", index) for index in range(6)]
    assert store.client.zcard(inflight) == 0 and store.client.zcard(store.keys.jobs_filling) == 0
