"""A reaper pass completes the fill of a job whose API process died between two enqueue calls (real
Redis, a real `WorkerContext`)."""

from __future__ import annotations

import time

from broker import jobs
from broker.config import Settings
from broker.store import Store
from sits_worker.context import WorkerContext
from sits_worker.devices import Device
from sits_worker.dispatch import reap
from sits_worker.runtime import SessionCache


def test_a_reaper_pass_queues_the_chunks_a_dead_fill_left_out(store: Store) -> None:
    ctx = WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                        sessions=SessionCache(Device("cpu"), 1))
    now = time.time()
    spec = jobs.JobSpec(job_id="cut", model_name="mlp", model_version="v1", input_batch="/data/in.npy",
                        input_format="npy", input_checksum="sha256:0123abcd", output_dir="/data/out",
                        output_names=["logits"], rows_total=6, chunk_size=1, batch_size=1)
    jobs.create_job(store, spec, now=now)
    ready = store.keys.ready("mlp@v1")
    store.client.zrem(ready, *(jobs.chunk_item_id("cut", index) for index in range(2, 6)))  # as if never queued
    store.client.zadd(store.keys.jobs_filling, {"cut": now})
    sent: list[str] = []

    reap(ctx, sent.append, now=now + 1)  # its caller may only be slow
    assert store.client.zcard(ready) == 2

    reap(ctx, sent.append, now=now + jobs.FILL_STALLED_SECONDS + 1)
    assert sorted(store.client.zrange(ready, 0, -1)) == [jobs.chunk_item_id("cut", index) for index in range(6)]
    assert store.client.zcard(store.keys.jobs_filling) == 0
