"""A worker's memory reservation for what one lease runs, and the admission hold it replaces (real Redis,
a real `WorkerContext`)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker import queues, registry, requests
from broker.config import Settings
from broker.requests import RequestSpec
from broker.reservation import MemoryLedger
from broker.store import Store
from sits_worker.context import WorkerContext
from sits_worker.devices import Device
from sits_worker.leasing import reserved
from sits_worker.runtime import SessionCache

MIB = 2**20
TOKEN_MODEL = {"name": "tok", "version": "v1", "path": "/nowhere.onnx",
               "signature": {"inputs": [], "outputs": [{"name": "embedding"}]},
               "static_profile": {"sequence_axis": {"input": "ids", "axis": 1}, "activation_bytes_per_token": MIB // 8,
                                  "activation_bytes_per_sample": 16 * MIB, "reference_sequence_length": 128,
                                  "flops_per_sample": 5e7}}


@pytest.fixture
def ctx(store: Store) -> WorkerContext:
    registry.save_model_version(store, TOKEN_MODEL)
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=2,
                         sessions=SessionCache(Device("cpu"), 1), ledger=MemoryLedger(64 * 1024 * MIB, 2 * MIB))


def leased(store: Store, *, chunk_batch: int | None, request_tokens: int | None) -> list[queues.LeasedItem]:
    items = []
    if request_tokens:
        spec = RequestSpec(request_id="r1", model_name="tok", model_version="v1",
                           inputs={"ids": np.zeros((1, request_tokens), np.int64)}, rows=1, tokens=request_tokens,
                           bucket=f"ids:~{request_tokens}", factors={"level": 0}, padded_tokens=request_tokens)
        requests.submit_request(store, spec, score=1.0, now=time.time(), max_age_seconds=60)
        items += queues.lease_batch(store, "tok@v1", now=time.time(), lease_seconds=60, max_items=8)
    if chunk_batch:
        payload = {"kind": "chunk", "job": "j1", "chunk": 0, "start": 0, "stop": 1024, "batch_size": chunk_batch}
        items.append(queues.LeasedItem("j1:0", "tok@v1", payload, 1))
    return items


def test_a_chunk_carried_by_a_token_request_reserves_its_own_rows_too(ctx: WorkerContext, store: Store) -> None:
    """The chunk's mini-batches (and their riders) are counted by rows, the request by its tokens:
    the request's few tokens must not stand for the whole lease."""
    with reserved(ctx, leased(store, chunk_batch=256, request_tokens=None)):
        alone = ctx.ledger.stats()["used_bytes"]
    with reserved(ctx, leased(store, chunk_batch=256, request_tokens=16)):
        together = ctx.ledger.stats()["used_bytes"]

    assert alone == (256 + 64) * 16 * MIB  # its batch plus a full batch of riders (max_batch_size 64)
    assert together == alone + 16 * MIB // 8  # plus the request's 16 tokens
    assert ctx.ledger.stats()["reserved_bytes"] == 0


def test_the_admission_hold_is_released_even_when_the_real_reservation_fails(ctx: WorkerContext,
                                                                             store: Store) -> None:
    hold = ctx.ledger.reserve(100 * MIB, now=time.time(), expected_seconds=1.0)
    broken = [queues.LeasedItem("x", "missing@v9", {"kind": "request", "rows": 1}, 1)]  # its model is unknown

    with pytest.raises(Exception, match="not registered"), reserved(ctx, broken, replacing=hold):
        pass

    assert ctx.ledger.stats()["reserved_bytes"] == 0
