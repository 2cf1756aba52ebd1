"""A device that fails a model's runs opens that worker's circuit breaker, its work moves to the other
worker, and a probe batch closes the breaker once the fault is lifted: a real stack (Redis, API, two
Celery workers) in which one worker injects the failures (`faults.workers`, `faults.fail_models_for`),
so every failure takes the worker's real error path."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sits_api.cli.client import ApiClient
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import FAST_RECOVERY, collect, register, stack_settings

WINDOW = 20.0
COOL_DOWN = 1.5
FAULT_SECONDS = 3.0
"""worker0 fails every run of mlp for this long after its first failure: then its device has recovered."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("breaker-stack") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        scheduler={**FAST_RECOVERY, "reap_interval": "0.2s"},
        online={"models": {"mlp": {"max_batch_size": 1, "max_queue_delay": 0}}},  # one request a batch
        retry={"run_timeout": {"attempts": 10, "backoff": "0.2s"}},
        breaker={"min_runs": 3, "window": f"{WINDOW}s", "cool_down": f"{COOL_DOWN}s"},
        faults={"enabled": True, "workers": ["sits0-*"], "fail_models": {"mlp": "run_timeout"},
                "fail_models_for": f"{FAULT_SECONDS}s"})
    running = Stack(settings, worker_count=2, api_port=0).start()
    register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
    yield running
    running.stop()


def _burst(client: ApiClient, count: int = 6) -> list[str]:
    rows = np.random.default_rng(0).standard_normal((count, 64)).astype(np.float32)
    return [client.post("/v1/requests", {"model": "mlp", "inputs": {"features": row[None].tolist()}})["id"]
            for row in rows]


def _breaker(client: ApiClient, worker_prefix: str) -> dict[str, Any] | None:
    return next((entry for entry in client.get("/v1/status")["breakers"]
                 if entry["worker"].startswith(worker_prefix) and entry["model"].startswith("mlp@")), None)


def _until(client: ApiClient, state: str, timeout: float) -> tuple[dict[str, Any], list[str]]:
    """Send bursts of requests until worker0's breaker of mlp is in `state`; (it, the ids sent)."""
    sent: list[str] = []
    deadline = time.monotonic() + timeout
    while (entry := _breaker(client, "sits0-")) is None or entry["state"] != state:
        assert time.monotonic() < deadline, f"worker0's breaker of mlp is not {state} after {timeout}s: {entry}"
        sent += _burst(client)
        time.sleep(0.3)
    return entry, sent


def test_a_failing_device_opens_its_breaker_work_moves_and_a_probe_closes_it_once_the_fault_is_lifted(
        stack: Stack) -> None:
    client = stack.client()
    started = time.time()

    opened, before = _until(client, "open", timeout=WINDOW)

    assert opened["since"] - started < WINDOW and opened["opened"] >= 1
    assert opened["last_error"].startswith("run_timeout: injected fault"), opened
    assert opened["retry_at"] == pytest.approx(opened["since"] + COOL_DOWN)
    healthy = _breaker(client, "sits1-")
    assert healthy is None or healthy["state"] == "closed"
    state = [line for line in _metrics(stack).splitlines()
             if line.startswith('sits_breaker_state{model="mlp"') and 'worker="sits0-' in line]
    assert state and state[0].endswith((" 2.0", " 1.0")), state  # open, or half-open by now

    # while it is open, the other worker runs everything; the requests that failed on worker0 ran again there
    while_open = _burst(client)
    answered = collect(client, while_open, timeout=30)
    assert all(result["status"] == "succeeded" for result in answered.values()), answered
    ran_while_open = [request_id for request_id, result in answered.items()
                      if result["finished_at"] < opened["retry_at"]]
    assert ran_while_open, answered
    assert all(_served_by(stack, request_id).startswith("sits1-") for request_id in ran_while_open), answered

    closed, after = _until(client, "closed", timeout=30)  # probes fail until the fault passes, then one succeeds

    assert closed["since"] >= opened["since"] + COOL_DOWN
    done = collect(client, before + after, timeout=60)
    assert all(result["status"] == "succeeded" for result in done.values()), [
        result for result in done.values() if result["status"] != "succeeded"]
    assert any(_served_by(stack, request_id).startswith("sits0-") and result["finished_at"] >= closed["since"] - 0.5
               for request_id, result in done.items()) or _served_by_worker0_again(stack)


def _metrics(stack: Stack) -> str:
    request = urllib.request.Request(stack.api_url + "/metrics", headers={"Authorization": f"Bearer {stack.api_key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def _served_by(stack: Stack, request_id: str) -> str:
    """The worker that ran a request (its record's `worker` field, which the API does not show)."""
    assert stack.store is not None
    return str(stack.store.client.hget(stack.store.keys.request(request_id), "worker") or "")


def _served_by_worker0_again(stack: Stack) -> bool:
    """Whether worker0, its breaker closed, takes mlp's work again."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        answered = collect(stack.client(), _burst(stack.client()), timeout=30)
        if any(_served_by(stack, request_id).startswith("sits0-") for request_id in answered):
            return True
    return False
