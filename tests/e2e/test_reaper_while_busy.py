"""Expired leases come back while every stream slot of every worker runs a long batch.

The reaper pass runs on a thread of each worker process (`sits_worker/upkeep/reaper.py`), not as a Celery
task: one queued behind the stream slots (they are the threads pool's threads) would wait for a
chunk to end. Here one worker's two slots each run a long transformer chunk while an item leased by
a "dead" worker (leased straight through `broker.queueing.queues` with a short lease and never acked) expires;
it must be back in its queue within a few reap intervals, long before either chunk ends.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import queues
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import FAST_RECOVERY, register, stack_settings, wait_job
from tests.leasing import lease_items
from tests.waiting import eventually

STREAMS = 2
ROWS_PER_CHUNK = 3000
SEQUENCE = 512  # ~6 ms a row on one core of the 2-core development machine: each chunk runs well over 10 s
DEAD_LEASE_SECONDS = 1.0
REAP_INTERVAL_SECONDS = float(FAST_RECOVERY["reap_interval"].rstrip("s"))


@pytest.fixture
def busy_stack(tmp_path, zoo_dir):
    settings = stack_settings(tmp_path / "home", streams=STREAMS, model_roots=(zoo_dir,)).with_overrides(
        scheduler={"yield_check_interval": "1h"})  # the chunks keep their slots: nothing runs between mini-batches
    running = Stack(settings, worker_count=1, api_port=0).start()
    yield running
    running.stop_child("worker0", kill=True)  # its chunks would otherwise run to their end on SIGTERM
    running.stop()


def test_an_expired_lease_returns_to_its_queue_while_every_stream_slot_is_busy(busy_stack, zoo_dir):
    client = busy_stack.client()
    store = busy_stack.store
    transformer = register(client, "transformer", zoo_dir / "transformer.onnx")["ref"]
    mlp = register(client, "mlp", zoo_dir / "mlp.onnx")
    token_ids = np.random.default_rng(7).integers(1, 1000, size=(STREAMS * ROWS_PER_CHUNK, SEQUENCE))
    np.save(busy_stack.home / "tokens.npy", token_ids.astype(np.int64))
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(busy_stack.home / "tokens.npy"),
                                   "output_dir": str(busy_stack.home / "out"), "chunk_size": ROWS_PER_CHUNK,
                                   "batch_size": 16})
    assert eventually(lambda: queues.queue_depths(store).get(transformer, {}).get("inflight", 0) >= STREAMS,
                      timeout=30, interval=0.05), "the worker's slots did not both lease a chunk"

    # A worker that dies right after its lease: the item is never run, acked or extended.
    spec = RequestSpec(request_id="r-of-a-dead-worker", model_name="mlp", model_version=mlp["version"],
                       inputs={"features": np.zeros((1, 64), dtype=np.float32)}, rows=1, tokens=None, bucket="",
                       factors={"level": 0})
    requests.submit_request(store, spec, score=0.0, now=time.time(), max_age_seconds=600)
    [leased] = lease_items(store, spec.model_ref, now=time.time(), lease_seconds=DEAD_LEASE_SECONDS,
                                  max_items=1)
    expires_at = time.monotonic() + DEAD_LEASE_SECONDS

    back_by = expires_at + 5 * REAP_INTERVAL_SECONDS
    while store.client.zscore(store.keys.ready(spec.model_ref), leased.item_id) is None:
        assert time.monotonic() < back_by, (
            f"the expired lease was not returned within 5 reap intervals of its expiry "
            f"(queues: {queues.queue_depths(store)})")
        time.sleep(0.05)

    # The slots were busy all along: both chunks still run (none acked, both still leased).
    running = wait_job(client, job["id"], until=lambda j: True)
    assert running["status"] == "running" and running["chunks_done"] == 0, running
    assert queues.queue_depths(store)[transformer]["inflight"] == STREAMS
