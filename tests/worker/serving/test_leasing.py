"""A worker's memory reservation for what one lease runs, and the admission hold it replaces (real Redis,
a real `WorkerContext`)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.memory.ledger import MemoryLedger
from broker.memory.reservation import Admission, admit_and_hold
from broker.models import registry
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.leasing import admitted, batch_cost, lease
from tests.leasing import lease_items

MIB = 2**20
TOKEN_MODEL = {"name": "tok", "version": "v1", "path": "/nowhere.onnx",
               "signature": {"inputs": [], "outputs": [{"name": "embedding"}]},
               "static_profile": {"sequence_axis": {"input": "ids", "axis": 1}, "activation_bytes_per_token": MIB // 8,
                                  "activation_bytes_per_sample": 16 * MIB, "reference_sequence_length": 128,
                                  "flops_per_sample": 5e7}}
FULL = Admission("tok@v1", 64, 8192)
"""A full admission of the token model (its online batch limits)."""


@pytest.fixture
def ctx(store: Store) -> WorkerContext:
    registry.save_model_version(store, TOKEN_MODEL)
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=2,
                         sessions=SessionCache(Device("cpu"), 1), ledger=MemoryLedger(64 * 1024 * MIB, 2 * MIB))


def leased(store: Store, *, chunk_batch: int | None, request_tokens: int | None) -> list[leases.LeasedItem]:
    items = []
    if request_tokens:
        spec = RequestSpec(request_id="r1", model_name="tok", model_version="v1",
                           inputs={"ids": np.zeros((1, request_tokens), np.int64)}, rows=1, tokens=request_tokens,
                           bucket=f"ids:~{request_tokens}", factors={"level": 0}, padded_tokens=request_tokens)
        requests.submit_request(store, spec, score=1.0, now=time.time(), max_age_seconds=60)
        items += lease_items(store, "tok@v1", now=time.time(), lease_seconds=60, max_items=8)
    if chunk_batch:
        payload = {"kind": "chunk", "job": "j1", "chunk": 0, "start": 0, "stop": 1024, "batch_size": chunk_batch}
        items.append(leases.LeasedItem("j1:0", "tok@v1", payload, 1))
    return items


def test_a_chunk_carried_by_a_token_request_reserves_its_own_rows_too(ctx: WorkerContext, store: Store) -> None:
    """The chunk's mini-batches (and their riders) are counted by rows, the request by its tokens:
    the request's few tokens must not stand for the whole lease."""
    with admitted(ctx, leased(store, chunk_batch=256, request_tokens=None), FULL, hold=None):
        alone = ctx.ledger.stats()["used_bytes"]
    with admitted(ctx, leased(store, chunk_batch=256, request_tokens=16), FULL, hold=None) as runnable:
        together = ctx.ledger.stats()["used_bytes"]
        assert len(runnable.items) == 2

    assert alone == (256 + 64) * 16 * MIB  # its batch plus a full batch of riders (max_batch_size 64)
    assert together == alone + 16 * MIB // 8  # plus the request's 16 tokens
    assert ctx.ledger.stats()["reserved_bytes"] == 0


def test_the_admission_hold_is_released_even_when_the_real_reservation_fails(ctx: WorkerContext,
                                                                             store: Store) -> None:
    hold = ctx.ledger.reserve(100 * MIB, now=time.time(), expected_seconds=1.0)
    broken = [leases.LeasedItem("x", "missing@v9", {"kind": "request", "rows": 1}, 1)]  # its model is unknown

    with pytest.raises(Exception, match="not registered"), admitted(ctx, broken, FULL, hold=hold):
        pass

    assert ctx.ledger.stats()["reserved_bytes"] == 0


# A job chunk is admitted by its own need: its job's batch size (and a batch of riders), not the online batch.

def small_ctx(store: Store) -> WorkerContext:
    """A worker whose device holds 8 GiB: a 256-row chunk of the token model (with 64 rows of riders)
    needs 5 GiB, a full online batch 1 GiB."""
    registry.save_model_version(store, TOKEN_MODEL)
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=2,
                         sessions=SessionCache(Device("cpu"), 1), ledger=MemoryLedger(8 * 1024 * MIB, 2 * MIB))


def queue_job(store: Store, *, batch_size: int = 256) -> str:
    spec = jobs.JobSpec(job_id="j1", model_name="tok", model_version="v1", input_batch="/in.jsonl",
                        input_format="jsonl", input_checksum="sha256:0", output_dir="/out",
                        output_names=["embedding"], rows_total=2048, chunk_size=1024, batch_size=batch_size)
    job_fills.create_job(store, spec, now=time.time())
    return jobs.chunk_item_id("j1", 0)


def decide_and_lease(ctx: WorkerContext, store: Store) -> tuple[list[leases.LeasedItem], Admission, int | None]:
    snapshot = ctx.queue_watcher.snapshot()
    [admission], hold = admit_and_hold(["tok@v1"], lambda ref: batch_cost(ctx, ref), ctx.ledger, now=time.time(),
                                       backfill=False, head_items=snapshot.head_items)
    return lease(ctx, "tok@v1", "", admission=admission), admission, hold


def test_a_chunk_that_does_not_fit_goes_back_unrun_and_its_claim_holds_the_head_until_it_fits(
        store: Store) -> None:
    ctx = small_ctx(store)
    first = queue_job(store)
    running = ctx.ledger.reserve(4 * 1024 * MIB, now=time.time(), expected_seconds=1.0)  # 4 GiB free

    leased, admission, hold = decide_and_lease(ctx, store)  # the online batch (1 GiB) fits: admitted
    assert [item.item_id for item in leased] == [first]
    with admitted(ctx, leased, admission, hold=hold) as runnable:
        assert runnable.items == [] and runnable.handle is None

    # Back at the head of its queue at once, its lease attempt not counted; the hold is gone.
    assert store.client.zrange(store.keys.ready("tok@v1"), 0, 0) == [first]
    assert store.client.zcard(store.keys.inflight("tok@v1")) == 0
    assert store.client.hget(store.keys.attempts, first) is None
    assert ctx.ledger.stats()["reserved_bytes"] == 4 * 1024 * MIB
    # While the running batch holds the memory, the chunk's claim keeps its model from being admitted
    # (it is not leased and returned over and over).
    assert admit_and_hold(["tok@v1"], lambda ref: batch_cost(ctx, ref), ctx.ledger, now=time.time(),
                          backfill=False, head_items=ctx.queue_watcher.snapshot().head_items) == ([], None)

    ctx.ledger.release(running, now=time.time())
    leased, admission, hold = decide_and_lease(ctx, store)
    with admitted(ctx, leased, admission, hold=hold) as runnable:
        assert [item.item_id for item in runnable.items] == [first]
        assert ctx.ledger.stats()["used_bytes"] == (256 + 64) * 16 * MIB  # the chunk's own need
    assert ctx.ledger.stats()["reserved_bytes"] == 0


def test_a_chunk_larger_than_the_device_runs_when_nothing_else_does(store: Store) -> None:
    ctx = small_ctx(store)
    first = queue_job(store, batch_size=1024)  # (1024 + 64) rows x 16 MiB: 17 GiB, on an 8 GiB device

    leased, admission, hold = decide_and_lease(ctx, store)
    with admitted(ctx, leased, admission, hold=hold) as runnable:
        assert [item.item_id for item in runnable.items] == [first]


def test_a_cut_admission_runs_no_chunk_beyond_its_cut(store: Store) -> None:
    """A backfill cut to a memory hole (and to end in time) must not lease a chunk that outgrows it."""
    ctx = small_ctx(store)
    first = queue_job(store, batch_size=32)  # (32 + 64) rows: 1.5 GiB
    cut = Admission("tok@v1", 64, 0, cut=True, budget_bytes=1024 * MIB)
    leased = lease(ctx, "tok@v1", "", admission=cut, within_cut=True)

    with admitted(ctx, leased, cut, hold=None) as runnable:
        assert runnable.items == [] and runnable.handle is None
    assert store.client.zrange(store.keys.ready("tok@v1"), 0, 0) == [first]


def test_requests_that_took_a_chunk_along_run_without_it_when_it_does_not_fit(store: Store) -> None:
    ctx = small_ctx(store)
    chunk = queue_job(store)
    spec = RequestSpec(request_id="r1", model_name="tok", model_version="v1",
                       inputs={"ids": np.zeros((1, 16), np.int64)}, rows=1, tokens=16,
                       bucket="ids:~16", factors={"level": 0}, padded_tokens=16)
    requests.submit_request(store, spec, score=-1e9, now=time.time(), max_age_seconds=60)  # ahead of the chunk
    ctx.ledger.reserve(4 * 1024 * MIB, now=time.time(), expected_seconds=1.0)

    leased, admission, hold = decide_and_lease(ctx, store)
    assert len(leased) == 1  # carry_chunk is off in decide_and_lease: lease again with it
    leases.return_unrun(store, leased)
    leased = lease(ctx, "tok@v1", "", admission=admission, carry_chunk=True)
    assert [item.payload["kind"] for item in leased] == ["request", "chunk"]

    with admitted(ctx, leased, admission, hold=hold) as runnable:
        assert [item.payload["kind"] for item in runnable.items] == ["request"]
    assert store.client.zrange(store.keys.ready("tok@v1"), 0, -1) == [chunk, jobs.chunk_item_id("j1", 1)]
    assert ctx.ledger.claim_of("tok@v1", chunk) is None  # it did not head its queue: no claim


def test_urgent_requests_served_between_a_chunk_s_mini_batches_use_its_memory_but_no_more(
        store: Store) -> None:
    """They run instead of the chunk's next mini-batch, so the chunk's reservation is theirs to use;
    what it does not cover must fit the free memory, else they are left for another slot."""
    from sits_worker.serving.between_minibatches import _serve_one_urgent_batch

    ctx = small_ctx(store)
    spec = RequestSpec(request_id="r1", model_name="tok", model_version="v1",  # 8,192 tokens: 1 GiB
                       inputs={"ids": np.zeros((1, 8192), np.int64)}, rows=1, tokens=8192,
                       bucket="ids:~8192", factors={"level": 15}, padded_tokens=8192)
    requests.submit_request(store, spec, score=-1e9, now=time.time(), max_age_seconds=60)
    store.client.delete(store.keys.doorbell)  # (the submit rang it)
    other = ctx.ledger.reserve(7 * 1024 * MIB + 256 * MIB, now=time.time(), expected_seconds=1.0)  # another slot's
    chunk = ctx.ledger.reserve(512 * MIB, now=time.time(), expected_seconds=1.0)  # 256 MiB free

    assert not _serve_one_urgent_batch(ctx, ctx.queue_watcher.snapshot(), chunk_score=0.0, ticket="",
                                   chunk_reservation=chunk)
    assert store.client.zcard(store.keys.ready("tok@v1")) == 1  # never leased: cut to the room, it did not fit
    assert store.client.hlen(store.keys.attempts) == 0 and store.client.llen(store.keys.doorbell) == 0
    assert ctx.ledger.stats()["batches_running"] == 2  # nothing left behind

    ctx.ledger.release(other, now=time.time())
    ctx.ledger.reserve(6 * 1024 * MIB + 512 * MIB, now=time.time(), expected_seconds=1.0)
    ctx.ledger.release(chunk, now=time.time())
    chunk = ctx.ledger.reserve(1024 * MIB, now=time.time(), expected_seconds=1.0)  # the chunk's own 1 GiB covers it
    assert ctx.ledger.free_bytes() < 1024 * MIB

    assert _serve_one_urgent_batch(ctx, ctx.queue_watcher.snapshot(), chunk_score=0.0, ticket="",
                                   chunk_reservation=chunk)
    assert store.client.zcard(store.keys.ready("tok@v1")) == 0
    assert ctx.ledger.stats()["batches_running"] == 2
