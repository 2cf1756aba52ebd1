"""Two tenants flooding one model with online requests split the device by their shares, through a real stack.

S1 is guaranteed 70 % of the fleet, S2 30 %. Each floods the zoo convnet through v2 infer with 8
closed-loop clients (threads, each sending its next request when its last is answered) on one worker
with one stream slot. Merged batches would take every waiting request, 8 of each tenant, and split the
device about evenly; the lease instead gives S2 its share's part of S1's rows, and holds S2's other
requests while S1's clients are between an answer and their next call. So the device time billed splits
70/30, S1 keeps most of what it gets alone, and S2 alone still gets the whole device.

The device is made slow and steady by fault injection, as in `test_fair_share.py`: 20 ms added to every
run. A run then costs about the same whatever its rows, as on a GPU's flat latency curve, and its bill is
split by rows (`shares.attribute`): the device time follows the shares only if the runs hold both
tenants' rows in that ratio, with no run of S2's left-over requests alone. The run costs no CPU, so the
two cores stay free for the API, the clients and Redis, and the split measures the scheduler.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import numpy as np
import pytest

from broker.tenants.apikeys import create_api_key
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, stack_settings
from tests.e2e.test_fair_share import billed

CLIENTS = 8
RUN_LATENCY = "20ms"
WARM_SECONDS = 2.0
SHARED_SECONDS = 8.0
ALONE_SECONDS = 4.0
MAX_CALLS = 20_000
"""Calls one client makes at most in a phase (each phase is bounded by time too)."""


@pytest.fixture(scope="module")
def shares_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("online-shares") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        tenants={"s1": {"guaranteed_share": 0.7, "limit": 1.2}, "s2": {"guaranteed_share": 0.3, "limit": 3.0}},
        fair_share={"usage_half_life": "10s"}, faults={"enabled": True, "run_latency": RUN_LATENCY})
    running = Stack(settings, worker_count=1, api_port=0).start()
    register(running.client(), "convnet", build_zoo(home / "models")["convnet"])
    yield running
    running.stop()


def infer_body() -> bytes:
    pixels = np.random.default_rng(3).standard_normal(3 * 32 * 32).round(3)
    return json.dumps({"inputs": [{"name": "pixels", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                   "data": pixels.tolist()}]}).encode()


def flood(stack: Stack, keys: dict[str, str], seconds: float) -> dict[str, list[float]]:
    """`CLIENTS` closed-loop clients per tenant of `keys` calling v2 infer for `seconds`: each tenant's
    latencies (s) of the calls answered within the time. Every call must succeed."""
    url = urlsplit(stack.api_url)
    body = infer_body()
    latencies: dict[str, list[float]] = {tenant: [] for tenant in keys}
    failures: list[str] = []
    lock = threading.Lock()
    ends = time.monotonic() + seconds

    def client(tenant: str) -> None:
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
        headers = {"Authorization": f"Bearer {keys[tenant]}", "Content-Type": "application/json"}
        try:
            for _ in range(MAX_CALLS):
                if time.monotonic() >= ends:
                    return
                started = time.perf_counter()
                connection.request("POST", "/v2/models/convnet/infer", body=body, headers=headers)
                response = connection.getresponse()
                answer = response.read()
                with lock:
                    if response.status != 200:
                        failures.append(f"{response.status} {answer[:200]!r}")
                    elif time.monotonic() < ends:
                        latencies[tenant].append(time.perf_counter() - started)
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(tenant,), daemon=True) for tenant in keys for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    assert not failures, failures[:5]
    return latencies


def phase(stack: Stack, keys: dict[str, str], seconds: float) -> tuple[dict[str, float], dict[str, int]]:
    """Flood for `seconds`: the device-seconds billed to each tenant meanwhile and the calls it got answered."""
    before = billed(stack.store)
    latencies = flood(stack, keys, seconds)
    time.sleep(0.2)  # (bills are written at most 50 ms late)
    after = billed(stack.store)
    spent = {tenant: after.get(tenant, 0.0) - before.get(tenant, 0.0) for tenant in keys}
    return spent, {tenant: len(values) for tenant, values in latencies.items()}


@pytest.fixture(scope="module")
def keys(shares_stack: Stack) -> dict[str, str]:
    """Each tenant's API key."""
    return {tenant: create_api_key(shares_stack.store, f"{tenant}-key", "user", tenant=tenant)
            for tenant in ("s1", "s2")}


# (20 s; by default tests/broker/queueing/test_share_split.py and tests/worker/tenancy/test_shared_batches.py split
# leased batches by shares against a real Redis)
@pytest.mark.slow
def test_two_tenants_flooding_one_model_online_split_the_device_by_their_shares(shares_stack: Stack,
                                                                                 keys: dict[str, str]) -> None:
    flood(shares_stack, keys, WARM_SECONDS)  # (sessions built, usage found its level)

    spent, served = phase(shares_stack, keys, SHARED_SECONDS)
    s1_share = spent["s1"] / (spent["s1"] + spent["s2"])
    assert abs(s1_share - 0.7) <= 0.05, (spent, served)

    alone_spent, alone = phase(shares_stack, {"s1": keys["s1"]}, ALONE_SECONDS)
    s1_rate, s1_alone_rate = served["s1"] / SHARED_SECONDS, alone["s1"] / ALONE_SECONDS
    assert s1_rate >= 0.7 * s1_alone_rate, (served, alone)

    lone_spent, lone = phase(shares_stack, {"s2": keys["s2"]}, ALONE_SECONDS)  # the over-share tenant alone
    assert lone["s2"] >= 0.8 * alone["s1"], (lone, alone)  # full batches: what S1 got alone
    assert lone_spent["s2"] >= 0.8 * alone_spent["s1"], (lone_spent, alone_spent)  # the whole device


@pytest.mark.slow
def test_the_split_holds_over_a_minute_of_flooding(shares_stack: Stack, keys: dict[str, str]) -> None:
    flood(shares_stack, keys, WARM_SECONDS)
    quarters = [phase(shares_stack, keys, 15.0) for _ in range(4)]
    total = {tenant: sum(spent[tenant] for spent, _ in quarters) for tenant in keys}
    assert abs(total["s1"] / sum(total.values()) - 0.7) <= 0.03, quarters
    for spent, served in quarters:
        assert abs(spent["s1"] / sum(spent.values()) - 0.7) <= 0.05, (spent, served)
        assert served["s2"] > 0, (spent, served)  # the over-share tenant is slowed, never stalled
