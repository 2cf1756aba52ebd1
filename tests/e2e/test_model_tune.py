"""Tuning a model's batching on a real stack: the API, one CPU worker of two streams, the beat and a releaser.

One stack for the module. What is checked: `sitsctl model tune` sweeps a small space through the intake,
prints the front and the pick as JSON, charts it, and `--apply` makes the worker batch by it (`source:
tuned`); a live override's `streams` cap keeps a model's batches off a second slot, and a kind of device
the override bars leases none of the model's requests until it is lifted; the beat's batching controller
steps a `closed_loop` model from its answers, and workers and `/metrics` show its settings; its weight
learner credits windows to the live weights and makes its proposals the live policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from broker.state.store import Store
from broker.tuning import learning, live
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, stack_settings
from tests.waiting import eventually


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("tune") / "home"
    settings = stack_settings(home, streams=2).with_overrides(
        online={"models": {"mlp-loop": {"closed_loop": True, "target_p99": "200ms"}}},
        tuning={"controller": {"every": "0.5s", "patience": 1, "cooldown": "0s", "min_answered": 5},
                "weights": {"every": "0.5s"}})
    running = Stack(settings, worker_count=1, api_port=0, beat=True).start()
    zoo = build_zoo(home / "models")
    register(running.client(), "mlp", zoo["mlp"])
    register(running.client(), "mlp-loop", zoo["mlp"])
    register(running.client(), "convnet", zoo["convnet"])
    yield running
    running.stop()


def sitsctl(stack: Stack, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"SITS_HOME": str(stack.home)}
    env.pop("SITS_API_URL", None)
    env.pop("SITS_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "sits_api.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_model_tune_sweeps_picks_within_the_bound_charts_and_applies(stack: Stack) -> None:
    chart = stack.home / "front.png"
    result = sitsctl(stack, "model", "tune", "mlp", "--p99", "1s", "--method", "brute", "--batch-sizes", "1,16",
                     "--delays-ms", "0,2", "--streams", "1,2", "--concurrency", "1,8", "--cell-seconds", "0.5",
                     "--apply", "--chart", str(chart), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    shown = json.loads(result.stdout[:result.stdout.rindex("}") + 1])
    [tuning] = shown["tunings"]
    assert tuning["device_kind"] == "cpu" and tuning["status"] == "done", tuning
    points = tuning["points"]
    assert len(points) == 16  # 2 x 2 x 2 settings, each at 1 and 8 clients
    assert {(p["setting"]["max_batch_size"], p["setting"]["max_queue_delay_ms"], p["setting"]["streams"])
            for p in points} == {(b, d, s) for b in (1, 16) for d in (0, 2) for s in (1, 2)}
    assert all(p["answered"] > 0 and p["refused"] == 0 for p in points), points
    assert tuning["headroom"] == 0.2
    within = [p for p in points if p["p99_ms"] <= 800]  # (the bound less the default headroom of 20 %)
    chosen = tuning["chosen"]
    assert chosen["throughput"] == max(p["throughput"] for p in within)
    for point in tuning["front"]:  # no point beats a front point on both figures
        assert not any(p["throughput"] > point["throughput"] and p["p99_ms"] < point["p99_ms"] for p in points)
    assert tuning["verified"]["setting"] == chosen["setting"] and tuning["verified"]["answered"] > 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    model = stack.client().get("/v1/models/mlp")
    assert model["batching"]["source"] == "tuned"
    assert model["batching"]["max_batch_size"] == chosen["setting"]["max_batch_size"]
    assert model["batching"]["streams"] == chosen["setting"]["streams"]
    assert model["tuned_batching"]["cpu"]["p99_bound_ms"] == 1000
    store = Store.of(stack.settings.redis)
    assert live.read(store, model["ref"]) is None  # the sweep's trial override is gone
    names = [json.loads(raw).get("name") for raw in store.client.hvals(store.keys.api_keys)]
    assert not [name for name in names if name.startswith("sits-tune-")]  # and so is the key its clients used

    again = sitsctl(stack, "model", "tune", "mlp", "--p99", "1ms", "--method", "brute", "--json")
    assert again.returncode == 0, again.stdout + again.stderr  # cached: picked again from the same points
    [cached] = json.loads(again.stdout[:again.stdout.rindex("}") + 1])["tunings"]
    assert cached["points"] == points and cached["p99_bound_ms"] == 1


def _send(stack: Stack, count: int) -> list[dict[str, Any]]:
    """`count` one-row convnet requests at once (a run of milliseconds: two slots overlap), each waited for."""
    client = stack.client()
    rows = np.random.default_rng(3).standard_normal((count, 3, 32, 32)).astype(np.float32)
    answers: list[dict[str, Any]] = []

    def one(row: np.ndarray) -> None:
        answers.append(client.post("/v1/requests?wait=true", {"model": "convnet",
                                                               "inputs": {"pixels": [row.tolist()]}}))
    threads = [threading.Thread(target=one, args=(row,)) for row in rows]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers


def _overlapping(answers: list[dict[str, Any]]) -> int:
    """How many pairs of distinct batches ran at the same time (by their requests' run intervals)."""
    runs = sorted({(a["started_at"], a["finished_at"]) for a in answers})
    return sum(1 for i, (_, end) in enumerate(runs) for start, _ in runs[i + 1:] if start < end)


def test_a_streams_cap_keeps_the_model_on_one_slot_and_a_barred_kind_leases_none(stack: Stack) -> None:
    store = Store.of(stack.settings.redis)
    ref = stack.client().get("/v1/models/convnet")["ref"]
    one_by_one = live.Knobs(max_batch_size=1, max_queue_delay=0.0, streams=2)  # (whatever the tuned pick set)
    live.write(store, ref, live.LiveBatching("trial", until=time.time() + 60, by_kind={"cpu": one_by_one}))
    time.sleep(1.0)  # (workers read overrides every 0.5 s)
    free = _send(stack, 48)
    assert len(free) == 48 and all(a["status"] == "succeeded" for a in free)
    assert _overlapping(free) > 0  # two slots run batches of one side by side

    live.write(store, ref, live.LiveBatching("trial", until=time.time() + 60,
                                             by_kind={"cpu": live.Knobs(max_batch_size=1, max_queue_delay=0.0,
                                                                        streams=1)}))
    time.sleep(1.0)
    capped = _send(stack, 48)
    assert len(capped) == 48 and all(a["status"] == "succeeded" for a in capped)
    assert _overlapping(capped) == 0

    live.write(store, ref, live.LiveBatching("trial", until=time.time() + 60, by_kind={"gpu": one_by_one},
                                             others=live.BARRED))
    time.sleep(1.0)
    client = stack.client()
    queued = client.post("/v1/requests", {"model": "convnet", "inputs": {"pixels": [[[[0.5] * 32] * 32] * 3]}})
    time.sleep(1.5)
    assert client.get(f"/v1/requests/{queued['id']}")["status"] == "queued"  # no cpu slot leases it
    assert live.clear(store, ref, source="trial")
    deadline = time.monotonic() + 10
    while client.get(f"/v1/requests/{queued['id']}")["status"] != "succeeded" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.get(f"/v1/requests/{queued['id']}")["status"] == "succeeded"


def test_the_batching_controller_steers_a_closed_loop_model_from_its_answers(stack: Stack) -> None:
    client = stack.client()
    store = Store.of(stack.settings.redis)
    ref = client.get("/v1/models/mlp-loop")["ref"]
    rows = np.random.default_rng(5).standard_normal((1, 64)).astype(np.float32).tolist()
    ends = time.monotonic() + 4
    while time.monotonic() < ends:  # (answers for the controller's windows)
        assert client.post("/v1/requests?wait=true", {"model": "mlp-loop", "inputs": {"features": rows}})[
            "status"] == "succeeded"
    override = live.read(store, ref)
    assert override is not None and override.source == "controller" and override.knobs_for("cpu", now=time.time())
    assert client.get("/v1/models/mlp-loop")["batching"]["source"] == "controller"
    state = json.loads(store.client.hget(store.keys.controllers, f"{ref}|cpu"))
    assert state["answered"] >= 5 and state["p99"] is not None  # (the worker noted its answers' latencies)
    with urllib.request.urlopen(urllib.request.Request(
            f"{client.url}/metrics", headers={"Authorization": f"Bearer {client.key}"}), timeout=30) as answer:
        text = answer.read().decode()
    shown = [line for line in text.splitlines() if line.startswith("sits_batching_live_max_batch_size{")]
    assert any('model="mlp-loop"' in line and 'source="controller"' in line for line in shown), shown


def test_the_weight_learner_makes_its_proposals_the_live_policy(stack: Stack) -> None:
    client = stack.client()
    store = Store.of(stack.settings.redis)
    rows = np.random.default_rng(7).standard_normal((1, 64)).astype(np.float32).tolist()
    ends = time.monotonic() + 15
    while time.monotonic() < ends:  # (answers for the learner's windows, at two priority classes, until it tried one)
        for priority in (4, 12):
            client.post("/v1/requests?wait=true", {"model": "mlp", "inputs": {"features": rows}, "priority": priority})
        state = learning.read_state(store)
        if state is not None and state.draws >= 1 and time.monotonic() > ends - 12:
            break

    def proposal_is_live() -> bool:  # (a pass writes the policy and its state one after the other: read both
        nonlocal state, policy       # until a read falls between two passes)
        state, policy = learning.read_state(store), client.get("/v1/policy")
        proposed = None if state is None else state.candidate if state.trying == "candidate" else state.incumbent
        return proposed is not None and all(abs(policy[name] - getattr(proposed, name)) < 1e-9
                                            for name in ("alpha", "beta", "gamma", "delta"))

    policy: dict = {}
    assert eventually(proposal_is_live, timeout=5, interval=0.05), (state, policy)
    assert state is not None and state.observed_at is not None and time.time() - state.observed_at < 10
    assert state.draws >= 1  # (a candidate was drawn and tried)
