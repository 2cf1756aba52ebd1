"""A worker's memory watch: injected jitter read through the real reading path, the steps it takes,
and the leases of a degraded worker (real Redis, a real `WorkerContext`, the zoo MLP)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from broker.config.settings import Settings
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases
from broker.queueing.scoring import Factors, Weights, queue_key
from broker.state.store import Store
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.leasing import lease
from tests.worker.worker_helpers import mlp_worker_context

GIB = 2**30
DEGRADE = {"window": "1s", "sample_interval": "0.1s", "step_interval": "0.2s", "calm_for": "0.5s",
           "memory_limit": "16GiB"}


def _ctx(store: Store, zoo_dir: Path, **faults: Any) -> WorkerContext:
    return mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        faults={"enabled": True, **faults}, degrade=DEGRADE))


def _submit(store: Store, request_id: str, level: int) -> None:
    factors = Factors(level=level, enqueued_at=time.time())
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None,
                       bucket="features:64", factors=factors.to_dict(), owner="key", tenant="acme")
    requests.submit_request(store, spec, score=queue_key(factors, Weights()), now=time.time(), max_age_seconds=600)


def test_injected_jitter_swings_every_other_reading_while_it_lasts(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, memory_reading="1GiB", memory_jitter="512MiB", memory_jitter_after="0.2s",
               memory_jitter_for="0.3s")

    assert [ctx.memory_reading() for _ in range(3)] == [GIB] * 3  # not yet
    time.sleep(0.25)
    swinging = [ctx.memory_reading() for _ in range(4)]
    assert sorted(set(swinging)) == [GIB, GIB + 512 * 2**20] and swinging[0] != swinging[1]
    time.sleep(0.3)
    assert [ctx.memory_reading() for _ in range(3)] == [GIB] * 3  # over


def test_calm_memory_keeps_every_class_served(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, memory_reading="1GiB")
    for tick in range(20):
        ctx.memory_watch.sample(1000.0 + tick * 0.1)

    assert ctx.memory_watch.step == 0 and ctx.memory_watch.lease_classes() is None
    assert ctx.memory_watch.info()["changes"] == []


def test_a_jittering_worker_pauses_p2_serves_p0_and_restores_once_calm(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, memory_jitter="4GiB", memory_jitter_for="0.5s")  # 25 % of 16 GiB
    watch, now = ctx.memory_watch, 1000.0
    for _ in range(5):  # (the third reading is the first to fall back: jitter from then on)
        watch.sample(now)
        now += 0.1
    assert watch.step == 2 and watch.info()["name"] == "p2-paused"
    assert [change["step"] for change in watch.info()["changes"]] == [1, 2]

    _submit(store, "p2", 3)
    _submit(store, "p0", 13)
    notes = leases.LeaseNotes()
    assert [item.item_id for item in lease(ctx, "mlp@v1", "")] == ["p0"]
    assert lease(ctx, "mlp@v1", "", notes=notes) == [] and notes.paused
    assert store.client.zscore(store.keys.ready("mlp@v1"), "p2") is not None  # kept queued

    time.sleep(0.55)  # the injected jitter is over
    while watch.step and now < 1010:
        watch.sample(now)
        now += 0.1
    assert watch.step == 0 and [change["step"] for change in watch.info()["changes"]] == [1, 2, 1, 0]
    assert now - 1000.5 > 2 * 0.5  # a step back each calm_for, once the jittering readings left the window
    assert [item.item_id for item in lease(ctx, "mlp@v1", "")] == ["p2"]


def test_a_failed_ordering_read_keeps_the_step_s_classes_and_the_last_ordering(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, memory_jitter="4GiB", memory_jitter_for="5s")
    watch, now = ctx.memory_watch, 1000.0
    for _ in range(3):  # down to step 1 by the third reading
        watch.sample(now)
        now += 0.1
    assert watch.step == 1
    before = watch.lease_classes()

    store.drop_connection(1)  # the ordering read of the next sample fails: Redis out of reach a moment
    for _ in range(3):  # (past step_interval: step 2)
        watch.sample(now)
        now += 0.1

    classes = watch.lease_classes()
    assert watch.step == 2 and before is not None and classes is not None
    assert classes["demote"] == before["demote"]  # the same (dynamic) ordering
    assert 0 in classes["ranks"] and 0 not in before["ranks"]  # and the new step's classes: P2 paused
