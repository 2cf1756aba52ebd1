"""Jobs with deadlines on a real stack: refused when they cannot make it, accepted and on time when they can,
flagged under `admission: flag`, and served earliest deadline first.

One CPU worker with one stream, the zoo MLP registered twice with a measured profile (`profile_mode:
full`): `mlp` under the default `sla.admission: reject`, `mlp_flag` under `flag`. A 200,000-row job is
about half a second of the MLP's work here; the deadlines are chosen far from that (a tenth of a second
is refused, a minute is accepted), so that the machine's speed cannot decide the tests.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import stack_settings, wait_job

ROWS = 200_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("deadlines") / "home"
    settings = stack_settings(home, streams=1).with_overrides(sla={"models": {"mlp_flag": {"admission": "flag"}}})
    running = Stack(settings, worker_count=1, api_port=0).start()
    model = build_zoo(home / "models")["mlp"]
    client = running.client()
    for name in ("mlp", "mlp_flag"):
        client.post("/v1/models", {"name": name, "path": str(model), "profile_mode": "full"})
        _wait_profiled(running, name)
    features = np.random.default_rng(0).standard_normal((ROWS, 64)).astype(np.float32)
    np.save(home / "features.npy", features)
    yield running
    running.stop()


def _wait_profiled(stack: Stack, name: str) -> None:
    ends = time.monotonic() + 60
    while stack.client().get(f"/v1/models/{name}").get("profile_status") != "ready":
        assert time.monotonic() < ends, f"model {name} was not profiled in 60 s"
        time.sleep(0.1)


def _submit(stack: Stack, output: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    """POST /v1/jobs; (status, body) whatever the status."""
    home = stack.settings.paths.home
    body = {"model": "mlp", "input_batch": str(home / "features.npy"), "output_dir": str(home / output), **fields}
    request = urllib.request.Request(f"{stack.api_url}/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {stack.api_key}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_an_infeasible_deadline_is_refused_with_the_predicted_finish_and_the_earliest_one(stack: Stack) -> None:
    before = time.time()
    status, body = _submit(stack, "refused", deadline_s=0.1)

    assert status == 422, body
    assert body["code"] == "deadline_infeasible"
    assert body["error"].startswith("cannot finish before ") and "predicted" in body["error"]
    assert "rows) on 1 worker" in body["error"] and "earliest feasible deadline" in body["error"]
    assert body["predicted_finish"] > before + 0.1
    assert body["earliest_deadline"] >= body["predicted_finish"]
    listed = stack.client().get("/v1/jobs")["jobs"]
    assert not [job for job in listed if job["output_dir"].endswith("/refused")]  # nothing was queued


def test_the_earliest_feasible_deadline_is_accepted_and_a_feasible_job_meets_its_deadline(stack: Stack) -> None:
    status, refused = _submit(stack, "tight", deadline_s=0.1)
    assert status == 422
    status, job = _submit(stack, "earliest", deadline=_rfc3339(refused["earliest_deadline"] + 60))
    assert status in (200, 201), job
    assert job["deadline"] == pytest.approx(refused["earliest_deadline"] + 60)
    assert job["predicted_finish"] is not None and job["predicted_finish"] < job["deadline"]
    assert job["at_risk"] is False and job["deadline_met"] is None
    assert 0.0 <= job["sla_risk"] < 0.5

    done = wait_job(stack.client(), job["id"], timeout=120)

    assert done["status"] == "succeeded"
    assert done["finished_at"] <= done["deadline"] and done["deadline_met"] is True
    assert done["sla_risk"] == 0.0
    assert 0 < done["busy_seconds"] < done["finished_at"] - done["created_at"] + 1  # slot time its chunks ran


def test_flag_mode_accepts_an_infeasible_job_and_marks_it_at_risk(stack: Stack) -> None:
    status, job = _submit(stack, "flagged", model="mlp_flag", deadline_s=0.05)

    assert status in (200, 201), job
    assert job["at_risk"] is True and job["predicted_finish"] > job["deadline"]
    assert job["sla_risk"] > 0.5
    done = wait_job(stack.client(), job["id"], timeout=120)
    assert done["status"] == "succeeded" and done["deadline_met"] is False  # it ran all the same


def test_a_later_job_with_a_nearer_deadline_runs_before_an_earlier_one_without(stack: Stack) -> None:
    """Earliest deadline first at equal priority: a job queued behind 20 chunks of another, but due in
    a minute, takes the stream at the next chunk boundary and finishes first."""
    status, first = _submit(stack, "no-deadline", chunk_size=10_000)
    assert status in (200, 201)
    status, urgent = _submit(stack, "urgent", chunk_size=10_000, deadline_s=60)
    assert status in (200, 201), urgent

    done_first = wait_job(stack.client(), first["id"], timeout=120)
    done_urgent = wait_job(stack.client(), urgent["id"], timeout=120)

    assert done_first["status"] == done_urgent["status"] == "succeeded"
    assert done_urgent["finished_at"] < done_first["finished_at"]
    assert done_urgent["deadline_met"] is True and done_first["deadline_met"] is None


def test_bad_deadlines_are_refused_with_what_to_write(stack: Stack) -> None:
    cases = [
        ({"deadline": "tomorrow"}, 400, "is not an RFC 3339 time"),
        ({"deadline": "2026-12-01T10:42:00"}, 400, "has no time zone"),
        ({"deadline": _rfc3339(time.time() - 3600)}, 422, "has passed"),
        ({"deadline": "2020-01-01T00:00:00Z"}, 400, "more than a day before now"),
        ({"deadline": _rfc3339(time.time() + 60), "deadline_s": 60}, 400, "not both"),
        ({"deadline_s": -5}, 400, "deadline_s"),
    ]
    for fields, status, message in cases:
        got, body = _submit(stack, "bad", **fields)
        assert (got, message in body["error"]) == (status, True), (fields, body)


def _rfc3339(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def test_sitsctl_submits_with_a_deadline_and_shows_the_refusal_or_the_prediction(stack: Stack) -> None:
    from click.testing import CliRunner

    from sits_api.cli.main import cli

    home = stack.settings.paths.home
    env = {"SITS_API_URL": stack.api_url, "SITS_API_KEY": stack.api_key}
    args = ["job", "submit", "--model", "mlp", "--input-batch", str(home / "features.npy")]
    runner = CliRunner()

    refused = runner.invoke(cli, [*args, "--output-dir", str(home / "cli-refused"), "--deadline", "100ms"], env=env)
    assert refused.exit_code == 1 and "cannot finish before" in refused.output, refused.output
    assert "earliest feasible deadline" in refused.output and "deadline_s" in refused.output

    accepted = runner.invoke(cli, [*args, "--output-dir", str(home / "cli-ok"), "--deadline", "5m", "--wait"], env=env)
    assert accepted.exit_code == 0, accepted.output
    assert " accepted, due " in accepted.output and "predicted " in accepted.output and "risk 0." in accepted.output
    job_id = accepted.output.split()[1]
    status = runner.invoke(cli, ["job", "status", job_id], env=env)
    assert status.exit_code == 0 and "succeeded" in status.output and "deadline met" in status.output, status.output

    bad = runner.invoke(cli, [*args, "--output-dir", str(home / "cli-bad"), "--deadline", "soon"], env=env)
    assert bad.exit_code == 2 and "is not a deadline" in bad.output


def test_finished_jobs_calibrate_their_models_speed(stack: Stack) -> None:
    """The jobs above finished; the next submit drops them from the active index, and their run times
    over what the profile foresaw calibrate each model version that ran."""
    status, job = _submit(stack, "calibrated", deadline_s=600)
    assert status in (200, 201)
    factors = stack.store.client.hgetall(stack.store.keys.admission_calibration)
    ref = job["model_version"]  # by content: mlp and mlp_flag share it
    assert ref in factors and 0.5 <= float(factors[ref]) <= 10.0 and float(factors[ref]) != 1.0


def test_reaper_passes_score_running_deadline_jobs_and_ended_ones_train_the_predictor(stack: Stack) -> None:
    """A job of 40 chunks runs for a few reaper passes (every 0.5 s here): each scores it with the
    violation predictor and keeps a snapshot of its features; once it ended and left the active index, its
    snapshots, labelled met, update the predictor's weights."""
    status, job = _submit(stack, "predicted", chunk_size=5_000, deadline_s=600)
    assert status in (200, 201)
    key = stack.store.keys.job(job["id"])
    ends = time.monotonic() + 60
    while not stack.store.client.hget(key, "sla_risk_model"):
        assert time.monotonic() < ends, "no reaper pass scored the running job"
        time.sleep(0.05)
    assert 0.0 <= float(stack.store.client.hget(key, "sla_risk_model")) < 0.5
    wait_job(stack.client(), job["id"], timeout=120)
    while int(stack.store.client.hget(stack.store.keys.sla_model, "jobs") or 0) < 1:
        assert time.monotonic() < ends + 30, "no ended job trained the predictor"
        time.sleep(0.1)
    assert "lateness" in json.loads(stack.store.client.hget(stack.store.keys.sla_model, "weights"))


def test_the_worker_notes_when_each_chunk_of_a_running_job_begins_and_the_record_keeps_it_to_itself(
        stack: Stack) -> None:
    """Admission holds a slot that runs a later job's chunk only for what is left of it, from when the job's
    latest chunk began: the worker stamps that on the job's hash as each chunk starts. Its 20 chunks run one
    after another on the one stream, so the stamp moves on while the job runs; the API does not show it."""
    status, job = _submit(stack, "stamped", chunk_size=10_000)
    assert status in (200, 201)
    key = stack.store.keys.job(job["id"])
    stamps: set[float] = set()
    ends = time.monotonic() + 60
    while stack.store.client.hget(key, "status") in ("queued", "running"):
        assert time.monotonic() < ends, "the job did not finish in 60 s"
        if stamp := stack.store.client.hget(key, "chunk_started_at"):
            stamps.add(float(stamp))
        time.sleep(0.005)
    done = wait_job(stack.client(), job["id"])
    assert done["status"] == "succeeded" and "chunk_started_at" not in done
    started, last = (float(stack.store.client.hget(key, field)) for field in ("started_at", "chunk_started_at"))
    assert len(stamps) >= 2 and started <= min(stamps) and max(stamps) <= last < done["finished_at"]
