"""A worker's runs count on its circuit breakers, and faults aimed at one worker: real Redis, a real
`WorkerContext` running the zoo MLP, the faults on their real error path."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.errors import BadInput, InferenceTimeout
from broker.failures import breaker
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import queues, tickets
from broker.state.store import Store
from sits_worker.serving import drain_loop
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.drain_loop import _without_open_breakers
from sits_worker.serving.leasing import lease
from tests.worker.worker_helpers import mlp_worker_context

BREAKER = {"min_runs": 3, "failure_rate": 0.5, "cool_down": "30s"}


def _ctx(store: Store, zoo_dir: Path, name: str = "sits0-1@host", **faults: Any) -> WorkerContext:
    settings = Settings().with_overrides(faults={"enabled": True, **faults}, breaker=BREAKER)
    ctx = mlp_worker_context(store, zoo_dir, settings)
    ctx.name = name
    return ctx


def _feed(value: float = 0.25) -> dict[str, np.ndarray]:
    return {"features": np.full((2, 64), value, np.float32)}


def test_failed_runs_open_the_worker_s_breaker_and_bad_inputs_do_not_count(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, fail_values=[7.0])
    for _ in range(3):
        with pytest.raises(BadInput):
            ctx.run("mlp@v1", _feed(7.0), ["logits"])
    assert ctx.breakers.breaker("mlp@v1").buckets == ()  # the client's fault: no run counted

    failing = _ctx(store, zoo_dir, fail_models={"mlp": "run_timeout"})
    for _ in range(3):
        with pytest.raises(InferenceTimeout):
            failing.run("mlp@v1", _feed(), ["logits"])

    state = failing.breakers.breaker("mlp@v1")
    assert state.state == breaker.OPEN and state.last_error.startswith("run_timeout: injected fault")
    assert not failing.breakers.may_lease("mlp@v1", now=time.time())
    assert breaker.read_breakers(store)[("mlp@v1", "sits0-1@host")].state == breaker.OPEN


def test_faults_aimed_at_one_worker_spare_the_others(store: Store, zoo_dir: Path) -> None:
    aimed = {"fail_models": {"mlp": "run_timeout"}, "workers": ["sits0-*"]}
    other = _ctx(store, zoo_dir, name="sits1-1@host", **aimed)
    target = _ctx(store, zoo_dir, name="sits0-1@host", **aimed)

    assert other.run("mlp@v1", _feed(), ["logits"])[0].shape[0] == 2
    with pytest.raises(InferenceTimeout):
        target.run("mlp@v1", _feed(), ["logits"])
    assert other.breakers.breaker("mlp@v1").state == breaker.CLOSED


def test_a_model_fault_with_a_duration_stops_after_it(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, fail_models={"mlp": "run_timeout"}, fail_models_for="0.3s")
    with pytest.raises(InferenceTimeout):
        ctx.run("mlp@v1", _feed(), ["logits"])
    with pytest.raises(InferenceTimeout):
        ctx.run("mlp@v1", _feed(), ["logits"])

    time.sleep(0.35)

    assert ctx.run("mlp@v1", _feed(), ["logits"])[0].shape[0] == 2


def test_faults_refuse_a_worker_pattern_that_is_not_a_name() -> None:
    with pytest.raises(Exception, match="worker names"):
        Settings().with_overrides(faults={"enabled": True, "workers": [""]})


def _queue_requests(store: Store, count: int, first: int = 0) -> None:
    for index in range(first, first + count):
        spec = RequestSpec(request_id=f"r{index}", model_name="mlp", model_version="v1",
                           inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None,
                           bucket="", factors={"level": 0})
        requests.submit_request(store, spec, score=float(index), now=time.time(), max_age_seconds=60)


def test_an_open_breaker_leases_nothing_and_a_half_open_one_one_probe_at_a_time(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir)
    _queue_requests(store, 3)
    now = time.time()
    t1, t2 = tickets.top_up_tickets(store, now=now, target=2)
    for _ in range(3):
        ctx.breakers.note_run("mlp@v1", failed=True, error="device_oom: out of memory", now=now)

    assert lease(ctx, "mlp@v1", t1) == []
    snapshot = queues.QueueSnapshot(heads={"mlp@v1": 0.0}, earliest_deadlines={}, raw_policy="",
                                    head_items={"mlp@v1": "r0"})
    assert _without_open_breakers(ctx, snapshot).heads == {}  # to this worker the queue looks empty

    opened = ctx.breakers.breaker("mlp@v1")
    assert opened.retry_at is not None
    ctx.breakers._breakers[("mlp@v1", ctx.name)] = dataclasses.replace(opened, retry_at=now - 1)  # cool-down over
    probe = lease(ctx, "mlp@v1", t1)
    assert len(probe) >= 1 and lease(ctx, "mlp@v1", t2) == []  # the second slot waits for the probe
    ctx.run("mlp@v1", _feed(), ["logits"])  # the probe's run works
    assert ctx.breakers.breaker("mlp@v1").state == breaker.CLOSED
    _queue_requests(store, 1, first=len(probe))
    assert lease(ctx, "mlp@v1", t2)


@pytest.mark.timeout(30)
def test_a_slot_whose_only_work_its_breaker_bars_waits_on_the_doorbell_instead_of_spinning(
        store: Store, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings().with_overrides(scheduler={"ticket_time_slice": 1.0, "ticket_linger": 0.2}, breaker=BREAKER)
    ctx = mlp_worker_context(store, zoo_dir, settings)
    _queue_requests(store, 1)
    now = time.time()
    for _ in range(3):
        ctx.breakers.note_run("mlp@v1", failed=True, error="device_oom: out of memory", now=now)
    [ticket] = tickets.top_up_tickets(store, now=now, target=1)
    looks: list[float] = []
    snapshot = ctx.queue_watcher.snapshot
    monkeypatch.setattr(ctx.queue_watcher, "snapshot", lambda: looks.append(time.monotonic()) or snapshot())

    began = time.monotonic()
    outcome = drain_loop.drain(ctx, ticket)

    assert outcome == "yield" and time.monotonic() - began < 3  # its slice over, the ticket goes round again
    assert len(looks) <= 1 / drain_loop._DOORBELL_SLICE_SECONDS + 3, f"{len(looks)} looks in a 1 s slice"
    assert store.client.zcard(store.keys.ready("mlp@v1")) == 1  # the request still waits, for a healthy worker
