"""Schedules on a real stack: Redis, the API, one worker, the beat and a releaser (`sitsctl up`'s processes).

One stack for the module, its beat and worker shared by the tests. What is checked: releases within a
second of their slots, a beat SIGKILLed and restarted (with a second beat beside it) doubling no slot and
catching a missed one up once (`catch_up: once`) or not (`skip`), and a two-step chain run in order, held
by its first step's failure and released by that step's resume.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from broker.schedules import runs as schedule_runs
from broker.schedules.records import Run, member_of
from broker.state.embedded import free_port
from sits_api.cli.client import ApiClient
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, stack_settings, wait_job

BEAT = {"tick": "0.2s", "turn_timeout": "1s", "release_timeout": "5s"}
"""A second beat takes over within a second of the first one's death; a lost release is sent again after 5 s."""


def softmax_model(path: Path, width: int = 10) -> Path:
    """logits [batch, width] -> probabilities: the second step of a chain, fed the mlp's outputs."""
    graph = helper.make_graph([helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1)], "softmax",
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One CPU worker, the beat and a releaser; mlp, its copy 'extract' (whose runs fail for the first
    second after the first one failed: a step that fails, then works once resumed) and 'softmax'."""
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("schedules") / "home"
    settings = stack_settings(home).with_overrides(
        beat=BEAT, faults={"enabled": True, "fail_models": {"extract": "invalid_model"}, "fail_models_for": "1s"})
    running = Stack(settings, worker_count=1, api_port=0, beat=True).start()
    client = running.client()
    zoo = build_zoo(home / "models")
    register(client, "mlp", zoo["mlp"])
    register(client, "extract", zoo["mlp"])
    register(client, "softmax", softmax_model(home / "softmax.onnx"))
    np.save(home / "features.npy", np.random.default_rng(0).standard_normal((8, 64), dtype=np.float32))
    yield running
    running.stop()


def make(client: ApiClient, name: str, **fields: Any) -> dict[str, Any]:
    return dict(client.post("/v1/schedules", {"name": name, **fields}))


def job(stack: Stack, model: str, output: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "input_batch": str(stack.home / "features.npy"),
            "output_dir": str(stack.home / "out" / output), **fields}


def runs_of(stack: Stack, name: str) -> list[Run]:
    """Every kept run of the stack admin's schedule `name`, oldest first."""
    return sorted(schedule_runs.recent_runs(stack.store, member_of("sitsctl-up", name), 1000),
                  key=lambda run: run.slot)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.1)
    return found


def settled(stack: Stack, name: str) -> list[Run]:
    """The schedule paused, its runs once none is releasing any more."""
    stack.client().post(f"/v1/schedules/{name}/pause")
    return wait_for(f"{name}'s releases settled", lambda: (found := runs_of(stack, name)) and all(
        run.status != "releasing" for run in found) and found)


def jobs_under(stack: Stack, folder: str) -> list[dict[str, Any]]:
    """The jobs whose output folder lies under `<home>/out/<folder>`."""
    root = str(stack.home / "out" / folder) + os.sep
    return [item for item in stack.client().get("/v1/jobs?limit=10000")["jobs"] if item["output_dir"].startswith(root)]


def check_released_on_time(stack: Stack, name: str, *, seconds: float) -> list[Run]:
    """Run an every-1s schedule for `seconds`: each slot in between released once, within 1 s of it."""
    client = stack.client()
    make(client, name, every="1s", job=job(stack, "mlp", f"{name}/{{slot}}"))
    time.sleep(seconds)
    found = settled(stack, name)
    slots = [run.slot for run in found]
    assert slots == list(range(slots[0], slots[0] + len(slots))) and len(slots) >= seconds - 1, slots
    assert all(run.status == "released" and run.lateness is not None and run.lateness < 1.0 for run in found), [
        (run.slot, run.status, run.lateness, run.reason) for run in found]
    made = jobs_under(stack, name)
    assert sorted(item["id"] for item in made) == sorted(run.job_id for run in found)  # one job per slot
    return found


def test_an_every_second_schedule_is_released_within_a_second_of_each_slot(stack: Stack) -> None:
    found = check_released_on_time(stack, "ticks", seconds=4)

    shown = stack.client().get("/v1/schedules/ticks")["runs"]
    assert shown[0]["job_id"] == found[-1].job_id and shown[0]["lateness_s"] < 1.0
    assert {run["status"] for run in shown} == {"released"}


def test_a_beat_killed_and_restarted_beside_a_second_doubles_no_slot_and_catches_up_once(stack: Stack) -> None:
    client = stack.client()
    make(client, "catch-once", every="2s", catch_up="once", job=job(stack, "mlp", "catch-once/{slot}"))
    make(client, "catch-skip", every="2s", catch_up="skip", job=job(stack, "mlp", "catch-skip/{slot}"))
    wait_for("a first release of each", lambda: all(
        any(run.status == "released" for run in runs_of(stack, name)) for name in ("catch-once", "catch-skip")))

    stack.stop_child("beat", kill=True)  # SIGKILL: its turn is left to lapse
    killed_at = time.time()
    last_before = {name: max(run.slot for run in runs_of(stack, name)) for name in ("catch-once", "catch-skip")}
    time.sleep(4.5)  # two slots pass with no beat
    stack.start_beat("beat")
    stack.start_beat("beat-2")  # and a second beat at once: one of them holds the turn
    wait_for("a release after the restart", lambda: all(
        any(run.slot > killed_at + 4.5 and run.status == "released" for run in runs_of(stack, name))
        for name in ("catch-once", "catch-skip")), timeout=20)

    for name, caught_up in (("catch-once", "released"), ("catch-skip", "missed")):
        found = settled(stack, name)
        after = [run for run in found if run.slot > last_before[name]]
        decided_late = [run for run in after if run.catch_up]
        assert [run.status for run in decided_late] == [caught_up], [(r.slot, r.status, r.catch_up) for r in after]
        released = [run for run in found if run.status == "released"]
        made = jobs_under(stack, name)
        assert sorted(item["id"] for item in made) == sorted(run.job_id for run in released), name
        assert len({item["output_dir"] for item in made}) == len(made)  # no slot doubled


def test_a_two_step_chain_runs_in_order_is_held_by_a_failed_step_and_released_by_its_resume(stack: Stack) -> None:
    client = stack.client()
    make(client, "extract", every="2s", job=job(stack, "extract", "chain/{slot}/extract"))
    chain = stack.home / "out" / "chain" / "{slot}"
    make(client, "score", every="2s", after=["extract"],
         job={"model": "softmax", "input_batch": str(chain / "extract" / "logits.npy"),
              "output_dir": str(chain / "score")})

    # the first slot's extract fails (its model's runs fail for a second): its score waits, held, saying so
    first = wait_for("a failed first step", lambda: next((run for run in runs_of(stack, "extract") if run.job_id and
                     client.get(f"/v1/jobs/{run.job_id}")["status"] == "failed"), None) if any(
                     run.status == "released" for run in runs_of(stack, "extract")) else None)
    held = wait_for("the second step held by it", lambda: next(
        (run for run in client.get("/v1/schedules/score")["runs"] if run["slot"] == _iso(first.slot)
         and run["status"] == "held" and "failed" in (run["reason"] or "")), None))
    assert f"sitsctl job resume {first.job_id}" in held["reason"]
    time.sleep(1.2)  # the fault is over
    client.post(f"/v1/jobs/{first.job_id}/resume")
    wait_job(client, first.job_id, until=lambda found: found["status"] == "succeeded", timeout=30)

    # that slot's score is released now, and the next slots run in order
    def three_scored() -> list[Run]:
        scored = [run for run in runs_of(stack, "score") if run.status == "released" and run.slot >= first.slot]
        done = [run for run in scored if client.get(f"/v1/jobs/{run.job_id}")["status"] == "succeeded"]
        return done if len(done) >= 3 else []

    scored = wait_for("three slots scored", three_scored, timeout=30)
    extracts = {run.slot: run for run in settled(stack, "extract")}
    settled(stack, "score")
    assert scored[0].slot == first.slot
    for run in scored[:3]:
        before = client.get(f"/v1/jobs/{extracts[run.slot].job_id}")
        after = client.get(f"/v1/jobs/{run.job_id}")
        assert before["status"] == "succeeded" and after["created_at"] >= before["finished_at"]
        probabilities = np.load(Path(after["output_dir"]) / "probabilities.npy")
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)  # fed the first step's logits


def _iso(slot: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(slot, UTC).isoformat().replace("+00:00", "Z")


@pytest.mark.slow
def test_a_seconds_schedule_is_released_within_a_second_of_each_slot_for_a_minute_and_flower_shows_it(
        stack: Stack) -> None:
    port = free_port("127.0.0.1")
    env = {**os.environ, "SITS_CONFIG": str(stack.config_path), "SITS_REDIS_URL": stack.settings.redis.url,
           "SITS_HOME": str(stack.home), "FLOWER_UNAUTHENTICATED_API": "true"}
    flower = subprocess.Popen([sys.executable, "-m", "celery", "-A", "sits_worker", "flower", f"--port={port}",
                               "--address=127.0.0.1"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for("flower", lambda: _get(f"http://127.0.0.1:{port}/healthcheck") is not None)
        found = check_released_on_time(stack, "minute", seconds=60)
        tasks = _get(f"http://127.0.0.1:{port}/api/tasks?taskname=sits.release_schedule&limit=1000")
        assert tasks is not None
        released = {task["args"] for task in tasks.values() if task.get("state") == "SUCCESS"}
        assert len(released) >= len(found) - 2, (len(released), len(found))
        rescores = _get(f"http://127.0.0.1:{port}/api/tasks?taskname=sits.rescore_queues&limit=1000")
        done = [task for task in (rescores or {}).values() if task.get("state") == "SUCCESS"]
        assert len(done) >= 60 / 5 - 2 and all("models_looked_at" in task["result"] for task in done), rescores
    finally:
        flower.terminate()
        flower.wait(10)


def _get(url: str) -> Any:
    import json

    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = answer.read()
    except OSError:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body


def test_the_beat_sends_the_queues_re_scoring_and_a_releaser_runs_it(stack: Stack) -> None:
    """Every `beat.rescore_every` (5 s) a releaser runs `sits.rescore_queues`: a pass leaves its mark for each
    model queue it looked at (`broker/queueing/re_estimate.py`)."""
    client = stack.client()
    made = client.post("/v1/jobs", job(stack, "mlp", "rescore"))
    wait_job(client, made["id"])
    marks = wait_for("a re-scoring pass's marks", lambda: stack.store.client.hgetall(stack.store.keys.rescore_marks),
                     timeout=20)
    assert any(ref.startswith("mlp@") for ref in marks), marks
