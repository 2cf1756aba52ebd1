"""`GET/POST /v1/schedules/plan` against a real Redis (no worker): a window's runs, learnt from their last
released jobs, staggered to a lower peak with every run on time; `apply` stores offsets and caps, whose
next release carries the cap as its job's `max_slots`; another tenant's schedules are neither planned
nor changed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from tests.api.api_helpers import Api, error_of, two_tenants_sharing_roots
from tests.api.api_helpers import tenant_key as key

WINDOW = {"window": "17:00-20:00", "day": "2030-01-07", "slots": "8"}


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    # (no worker runs here: admission would refuse every deadline; it flags instead)
    return two_tenants_sharing_roots(redis_server, store, tmp_path, zoo_dir).with_overrides(sla={"admission": "flag"})


def daily(api: Api, name: str, minute: int, mlp_input: Path, tmp_path: Path) -> None:
    body = {"name": name, "cron": f"{minute} 17 * * *", "deadline": "2h",
            "job": {"model": "mlp", "input_batch": str(mlp_input), "chunk_size": 1,
                    "output_dir": str(tmp_path / name / "{slot}")}}
    response = api.post("/v1/schedules", json=body)
    assert response.status_code == 201, error_of(response)


def ran_once(api: Api, name: str) -> dict[str, Any]:
    response = api.post(f"/v1/schedules/{name}/run")
    if response.status_code == 409:  # (a run of this second already: run-now makes one a second)
        time.sleep(1.0)
        response = api.post(f"/v1/schedules/{name}/run")
    run = response.get_json()
    assert run["status"] == "released", run
    return dict(run)


def test_a_window_s_runs_are_staggered_to_a_lower_peak_all_on_time_and_applied(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    for index in range(5):
        daily(api, f"step{index}", 30 + index, mlp_input, tmp_path)
        ran_once(api, f"step{index}")  # (what a run costs is learnt from its last released job)

    planned = api.get("/v1/schedules/plan", query_string=WINDOW)

    assert planned.status_code == 200, error_of(planned)
    plan = planned.get_json()
    assert plan["feasible"] and len(plan["runs"]) == 5 and plan["left_out"] == []
    assert plan["before"]["peak_slots"] > plan["after"]["peak_slots"] >= 1
    assert all(run["on_time"] and run["admitted"] and run["max_slots"] for run in plan["runs"])
    assert plan["runs"][0]["slot"] == "2030-01-07T17:30:00Z" and plan["applied"] == []
    assert api.get("/v1/schedules/step1").get_json()["slot_cap"] is None  # a GET changes nothing

    applied = api.post("/v1/schedules/plan", json={**WINDOW, "slots": 8}).get_json()

    assert sorted(applied["applied"]) == [f"step{index}" for index in range(5)]
    for run in applied["runs"]:
        shown = api.get(f"/v1/schedules/{run['schedule']}").get_json()
        assert (shown["release_offset"], shown["slot_cap"]) == (run["offset_s"], run["max_slots"])
    job = api.get(f"/v1/jobs/{ran_once(api, 'step1')['job_id']}").get_json()
    assert job["max_slots"] == applied["runs"][1]["max_slots"]


def test_a_schedule_that_never_ran_is_left_out_with_why(api: Api, mlp: dict[str, Any], mlp_input: Path,
                                                        tmp_path: Path) -> None:
    daily(api, "fresh", 30, mlp_input, tmp_path)

    plan = api.get("/v1/schedules/plan", query_string=WINDOW).get_json()

    assert plan["runs"] == [] and plan["left_out"][0]["schedule"] == "fresh"
    assert "run-now" in plan["left_out"][0]["reason"]


def test_another_tenant_s_schedules_are_neither_planned_nor_changed(
        client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    alice, gary = key(client, store, "alice", "user", "acme"), key(client, store, "gary", "user", "globex")
    daily(alice, "nightly", 30, mlp_input, tmp_path)
    ran_once(alice, "nightly")

    seen = gary.post("/v1/schedules/plan?tenant=acme", json=WINDOW | {"slots": 8}).get_json()

    assert seen["runs"] == [] and seen["applied"] == []
    assert alice.get("/v1/schedules/nightly").get_json()["slot_cap"] is None
    assert len(alice.get("/v1/schedules/plan", query_string=WINDOW).get_json()["runs"]) == 1


@pytest.mark.parametrize(("query", "problem"), [
    ({"window": "25:00-26:00"}, "not one of a day"),
    ({"window": "17:00-20:00", "day": "tomorrow"}, "YYYY-MM-DD"),
    ({"day": "2030-01-07"}, "needs a window"),
    ({"window": "23:00-22:00", "day": "9999-12-31"}, "outside what a plan covers: from yesterday to 3660 days"),
    ({"slots": "many"}, "whole number"),
    ({"slots": "0"}, "slots"),
    ({"timezone": "Mars/Olympus"}, "IANA"),
    ({"when": "now"}, "unknown query"),
])
def test_a_bad_plan_ask_is_a_400_that_says_what_to_fix(api: Api, query: dict[str, str], problem: str) -> None:
    response = api.get("/v1/schedules/plan", query_string=query)

    assert response.status_code == 400 and problem in error_of(response)


def test_plan_is_not_a_schedule_name(api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = api.post("/v1/schedules", json={"name": "plan", "every": "1h", "job": {
        "model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "{slot}")}})

    assert response.status_code == 400 and "planning route" in error_of(response)


def test_a_plan_past_its_work_budget_is_a_400_that_says_what_to_do(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from broker.schedules.planning import WorkBudget
    from sits_api.schedules import planner

    daily(api, "step0", 30, mlp_input, tmp_path)
    ran_once(api, "step0")
    monkeypatch.setattr(planner, "WorkBudget", lambda: WorkBudget(left=10))  # (as a plan of thousands of runs)

    response = api.get("/v1/schedules/plan", query_string=WINDOW)

    assert response.status_code == 400 and "plan a shorter window" in error_of(response)
