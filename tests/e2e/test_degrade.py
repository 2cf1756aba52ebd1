"""A worker whose device memory jitters steps its lower priority classes down and back, through a
real stack: P2 work waits while it is paused, P0 and P1 work is answered, and once the memory is calm
again every step is undone and the P2 job ends with every row exact.

The jitter is injected (`faults.memory_jitter`: every other reading 4 GiB higher, 25 % of a CPU
worker's 16 GiB) and read by the worker's real memory watch; the degrade settings are shortened so
that the whole swing takes seconds: a step down every 0.3 s, one back after 1 s of calm.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sits_api.cli.client import ApiClient
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import collect, direct_run, register, stack_settings, wait_job

JITTER_SECONDS = 7.0
"""How long the worker's readings jitter from its first one: the stack starts, and the test's checks
run, within it."""


@pytest.fixture(scope="module")
def jittery_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("degrade") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        degrade={"window": "1s", "sample_interval": "0.1s", "step_interval": "0.3s", "calm_for": "1s"},
        faults={"enabled": True, "memory_jitter": "4GiB", "memory_jitter_for": f"{JITTER_SECONDS}s"})
    running = Stack(settings, worker_count=1, api_port=0).start()
    register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
    yield running
    running.stop()


def worker_degrade(client: ApiClient) -> dict[str, Any]:
    [worker] = client.get("/v1/status")["workers"]
    return worker.get("degrade") or {}


def wait_for_step(client: ApiClient, step: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (degrade := worker_degrade(client)).get("step") != step:
        assert time.monotonic() < deadline, f"the worker did not reach degrade step {step}: {degrade}"
        time.sleep(0.1)
    return degrade


def test_jitter_pauses_p2_serves_the_top_classes_and_everything_is_restored(jittery_stack: Stack) -> None:
    client = jittery_stack.client()
    started = time.monotonic()
    paused = wait_for_step(client, 2, timeout=JITTER_SECONDS)
    assert paused["name"] == "p2-paused" and paused["jitter"] > paused["jitter_threshold"] == 0.1
    assert [change["step"] for change in paused["changes"]] == [1, 2] and paused["lowest_level"] == 8

    features = np.random.default_rng(3).standard_normal((96, 64), dtype=np.float32)
    np.save(jittery_stack.home / "low.npy", features)
    low = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(jittery_stack.home / "low.npy"),
                                   "output_dir": str(jittery_stack.home / "low-out"), "priority": 2,
                                   "chunk_size": 32})
    p2 = client.post("/v1/requests", {"model": "mlp", "inputs": {"features": features[:1].tolist()}, "priority": 3})
    top = [client.post("/v1/requests", {"model": "mlp", "inputs": {"features": features[i:i + 1].tolist()},
                                        "priority": priority})["id"] for i, priority in ((0, 13), (1, 9))]
    answered = collect(client, top, timeout=5)
    assert all(result["status"] == "succeeded" for result in answered.values())
    time.sleep(0.5)
    assert client.get(f"/v1/jobs/{low['id']}")["rows_done"] == 0
    assert client.get(f"/v1/requests/{p2['id']}")["status"] == "queued"  # kept, not failed
    checked_after = time.monotonic() - started
    assert worker_degrade(client)["step"] == 2, f"the jitter ended before the checks ({checked_after:.1f}s)"

    restored = wait_for_step(client, 0, timeout=JITTER_SECONDS + 10)
    assert [change["step"] for change in restored["changes"]] == [1, 2, 1, 0]
    done = wait_job(client, low["id"], timeout=60)
    assert done["status"] == "succeeded" and done["rows_done"] == 96
    assert collect(client, [p2["id"]], timeout=10)[p2["id"]]["status"] == "succeeded"
    outputs = np.load(jittery_stack.home / "low-out" / "logits.npy")
    expected = direct_run(jittery_stack.home / "models" / "mlp.onnx", features, 32)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-6)
    status = client.get("/v1/status")
    assert all(depth["ready"] == 0 and depth["inflight"] == 0 for depth in status["queues"].values())
