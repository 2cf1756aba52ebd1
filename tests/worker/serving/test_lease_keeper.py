"""A batch of online requests keeps its leases while it runs, however long the run (real Redis, a real
`WorkerContext` and ONNX Runtime session; the run is made slow by a pause before it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases, reaping
from broker.state.store import Store
from sits_worker.serving import lease_keeper
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.lease_keeper import LeaseKeeper
from sits_worker.serving.request_runs import run_requests
from tests.leasing import lease_items
from tests.worker.worker_helpers import mlp_worker_context

LEASE_SECONDS = 0.4
TICKET = "ticket-1"


@pytest.fixture
def ctx(store: Store, zoo_dir: Path) -> WorkerContext:
    return mlp_worker_context(store, zoo_dir, Settings().with_overrides(scheduler={"lease_timeout": LEASE_SECONDS}))


def leased_requests(store: Store, count: int) -> list[leases.LeasedItem]:
    """`count` one-row MLP requests, leased for `LEASE_SECONDS` under `TICKET` (touched now)."""
    rng = np.random.default_rng(0)
    for index in range(count):
        spec = RequestSpec(request_id=f"r{index}", model_name="mlp", model_version="v1",
                           inputs={"features": rng.standard_normal((1, 64), dtype=np.float32)}, rows=1,
                           tokens=None, bucket="", factors={"level": 0})
        requests.submit_request(store, spec, score=float(index), now=time.time(), max_age_seconds=60)
    store.client.zadd(store.keys.tickets, {TICKET: time.time()})
    items = lease_items(store, "mlp@v1", now=time.time(), lease_seconds=LEASE_SECONDS, max_items=count,
                               ticket=TICKET)
    assert len(items) == count
    return items


def test_a_run_longer_than_the_lease_is_not_reaped_run_twice_or_failed(
        ctx: WorkerContext, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the reaper took a long batch's requests back while they ran: another stream ran them
    again, and after `max_attempts` such takes they failed as if their workers had died."""
    items = leased_requests(store, 3)
    reaped: list[int] = []
    run = ctx.run

    def slow_run(*args: Any, **kwargs: Any) -> Any:  # a big batch on a slow device: 3 leases long
        for _ in range(12):
            time.sleep(LEASE_SECONDS / 4)
            reaped.append(reaping.reap_expired_leases(store, now=time.time(), max_attempts=1).returned)
        return run(*args, **kwargs)

    monkeypatch.setattr(ctx, "run", slow_run)
    started = time.time()

    assert run_requests(ctx, items, TICKET) == 3

    assert reaped == [0] * 12
    for item in items:
        done = requests.get_request(store, item.payload["req"])
        assert done.status == "succeeded", done
    assert float(store.client.zscore(store.keys.tickets, TICKET)) > started + LEASE_SECONDS  # the ticket too


def test_leases_are_extended_only_while_held_and_a_reaped_lease_stays_reaped(store: Store) -> None:
    items = leased_requests(store, 2)
    keeper = LeaseKeeper(store, LEASE_SECONDS)

    def deadlines() -> list[float | None]:
        return [store.client.zscore(store.keys.inflight("mlp@v1"), item.item_id) for item in items]

    first = deadlines()
    with keeper.holding(items[:1]):
        time.sleep(LEASE_SECONDS * 0.6)
        store.client.zadd(store.keys.inflight("mlp@v1"), {items[0].item_id: 0}, xx=True)  # as a late reaper pass
        reaping.reap_expired_leases(store, now=time.time(), max_attempts=3)
        time.sleep(LEASE_SECONDS * 0.6)
    held, unheld = deadlines()
    assert held is None  # reaped: not put back in flight by a later extension
    assert unheld == first[1]  # not held: never extended

    with keeper.holding(items[1:]):
        time.sleep(LEASE_SECONDS * 0.6)
    assert deadlines()[1] > first[1]
    assert keeper.extend_due() == 0  # nothing held any more


def test_a_run_that_outlasts_max_leases_held_is_no_longer_extended(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung run (a driver that never returns) must not keep its requests and ticket from the reaper for ever."""
    monkeypatch.setattr(lease_keeper, "MAX_LEASES_HELD", 2)
    monkeypatch.setattr(lease_keeper, "MIN_HELD_SECONDS", 0.0)
    [item] = leased_requests(store, 1)
    keeper = LeaseKeeper(store, LEASE_SECONDS)

    def deadline() -> float:
        return float(store.client.zscore(store.keys.inflight("mlp@v1"), item.item_id))

    with keeper.holding([item]):  # (the keeper's own thread extends, every eighth of a lease)
        seen = [deadline()]
        for _ in range(12):  # three leases
            time.sleep(LEASE_SECONDS / 4)
            seen.append(deadline())
        time.sleep(LEASE_SECONDS / 2)  # past the last extension's lease
        last = deadline()

    assert len(set(seen[:9])) >= 3  # extended (at least twice) while held for under MAX_LEASES_HELD leases ...
    assert seen[-2] == seen[-1] == last  # ... then no more, however long the run goes on
    assert last < time.time()  # the reaper may take it back now
