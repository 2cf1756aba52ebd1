"""`/v1/schedules` against a real Redis (no worker, no beat): what a schedule must be to be made, whose it
is, and a release made by the releaser's own function: once per run, refused with its reason."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.errors import RetryableError
from broker.schedules import runs
from broker.schedules.records import Run, slot_job_id
from broker.schedules.stats import read_schedule_stats
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import revoke_api_keys
from sits_api.schedules import definitions
from sits_api.schedules.release import release_run
from sits_api.state import app_state
from tests.api.api_helpers import Api, error_of, two_tenants_sharing_roots
from tests.api.api_helpers import tenant_key as key


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    return two_tenants_sharing_roots(redis_server, store, tmp_path, zoo_dir)


def schedule_body(tmp_path: Path, mlp_input: Path, name: str = "nightly", **fields: Any) -> dict[str, Any]:
    return {"name": name, "cron": "30 17 * * 1-5", "timezone": "Europe/Paris", "window": "17:30-19:30",
            "job": {"model": "mlp", "input_batch": str(mlp_input),
                                      "output_dir": str(tmp_path / "out" / "{date}" / "{slot}")}, **fields}


def made(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post("/v1/schedules", json=body)
    assert response.status_code == 201, error_of(response)
    return dict(response.get_json())


def test_a_schedule_is_made_shown_with_its_next_slot_and_listed(api: Api, mlp: dict[str, Any], mlp_input: Path,
                                                                tmp_path: Path) -> None:
    shown = made(api, schedule_body(tmp_path, mlp_input, deadline="2h"))

    assert shown["name"] == "nightly" and shown["owner"] == "test" and shown["deadline"] == 7200
    assert shown["next_slot"].endswith(("15:30:00Z", "16:30:00Z")) and shown["runs"] == []
    assert [item["name"] for item in api.get("/v1/schedules").get_json()["schedules"]] == ["nightly"]
    assert "generation" not in shown and "revision" not in shown


@pytest.mark.parametrize(("fields", "problem"), [
    ({"cron": "30 17 * *"}, "five fields"),
    ({"cron": "0 0 31 2 *"}, "real date"),
    ({"deadline": "1000d"}, "at most 366d"),
    ({"every": "10s"}, "either cron"),
    ({"timezone": "Mars/Olympus"}, "IANA"),
    ({"window": "25:00-26:00"}, "not one of a day"),
    ({"deadline": "soon"}, "not a duration"),
    ({"catch_up": "always"}, "catch_up"),
    ({"after": ["nothing"]}, "no schedule of tenant"),
    ({"after": ["nightly"]}, "after itself"),
    ({"name": "bad name"}, "name"),
])
def test_a_bad_schedule_is_a_400_that_says_what_to_fix(api: Api, mlp: dict[str, Any], mlp_input: Path,
                                                      tmp_path: Path, fields: dict[str, Any], problem: str) -> None:
    response = api.post("/v1/schedules", json=schedule_body(tmp_path, mlp_input, **fields))

    assert response.status_code == 400 and problem in error_of(response)


def test_what_a_schedule_would_submit_is_checked_as_a_job_submit(api: Api, mlp: dict[str, Any], mlp_input: Path,
                                                                 tmp_path: Path) -> None:
    body = schedule_body(tmp_path, mlp_input)
    outside = {**body, "job": {**body["job"], "output_dir": "/etc/{date}"}}
    braces = {**body, "job": {**body["job"], "output_dir": str(tmp_path / "{day}")}}
    unknown = {**body, "job": {**body["job"], "model": "nope"}}
    own_deadline = {**body, "job": {**body["job"], "deadline_s": 60}}

    assert api.post("/v1/schedules", json=outside).status_code == 403
    assert "{day}" in error_of(api.post("/v1/schedules", json=braces))
    assert api.post("/v1/schedules", json=unknown).status_code == 404
    assert "schedule's deadline" in error_of(api.post("/v1/schedules", json=own_deadline))
    assert api.get("/v1/schedules").get_json()["schedules"] == []


def test_a_loop_of_steps_is_refused(api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    made(api, schedule_body(tmp_path, mlp_input, name="extract"))
    made(api, schedule_body(tmp_path, mlp_input, name="score", after=["extract"]))

    response = api.client.patch("/v1/schedules/extract", headers=api.headers, json={"after": ["score"]})

    assert response.status_code == 400 and "loop" in error_of(response)


def test_another_tenant_s_schedule_answers_as_a_missing_one(client: FlaskClient, store: Store, mlp: dict[str, Any],
                                                           mlp_input: Path, tmp_path: Path) -> None:
    alice, gary = key(client, store, "alice", "user", "acme"), key(client, store, "gary", "user", "globex")
    boss, viewer = key(client, store, "boss", "tenant-admin", "acme"), key(client, store, "vic", "viewer", "acme")
    made(alice, schedule_body(tmp_path, mlp_input))

    missing = gary.get("/v1/schedules/nothing")
    for call in (gary.get("/v1/schedules/nightly"), gary.delete("/v1/schedules/nightly"),
                 gary.post("/v1/schedules/nightly/pause"), gary.post("/v1/schedules/nightly/run"),
                 gary.client.patch("/v1/schedules/nightly", headers=gary.headers, json={"paused": True})):
        assert call.status_code == 404 and error_of(call) == error_of(missing).replace("nothing", "nightly")
    assert gary.get("/v1/schedules?tenant=acme").get_json()["schedules"] == []  # ?tenant= is an admin's
    assert [s["name"] for s in viewer.get("/v1/schedules").get_json()["schedules"]] == ["nightly"]
    assert viewer.post("/v1/schedules/nightly/pause").status_code == 403
    assert boss.post("/v1/schedules/nightly/pause").get_json()["paused"] is True
    assert made(gary, schedule_body(tmp_path, mlp_input))["tenant"] == "globex"  # names are per tenant


def test_patch_pause_resume_and_delete(api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    made(api, schedule_body(tmp_path, mlp_input))

    changed = api.client.patch("/v1/schedules/nightly", headers=api.headers,
                               json={"every": "10s", "window": None, "catch_up": "skip"}).get_json()
    paused = api.post("/v1/schedules/nightly/pause").get_json()
    resumed = api.post("/v1/schedules/nightly/resume").get_json()

    assert changed["every"] == 10 and changed["cron"] is None and changed["window"] is None
    assert changed["catch_up"] == "skip" and paused["paused"] and paused["next_slot"] is None
    assert not resumed["paused"] and resumed["next_slot"]
    assert api.delete("/v1/schedules/nightly").status_code == 204
    assert api.get("/v1/schedules/nightly").status_code == 404


def test_a_tenant_holds_at_most_its_schedules(client: FlaskClient, store: Store, settings: Settings,
                                              mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    with client.application.app_context():
        app_state().settings = settings.with_overrides(beat={"max_schedules_per_tenant": 1})
    alice = key(client, store, "alice", "user", "acme")
    made(alice, schedule_body(tmp_path, mlp_input, name="one"))

    response = alice.post("/v1/schedules", json=schedule_body(tmp_path, mlp_input, name="two"))

    assert response.status_code == 429 and "max_schedules_per_tenant" in error_of(response)


def test_run_now_releases_one_job_under_the_slot_s_id_and_shows_it(api: Api, mlp: dict[str, Any], mlp_input: Path,
                                                                   tmp_path: Path) -> None:
    made(api, schedule_body(tmp_path, mlp_input))

    response = api.post("/v1/schedules/nightly/run")
    shown = api.get("/v1/schedules/nightly").get_json()

    assert response.status_code == 201, error_of(response)
    run = response.get_json()
    assert run["status"] == "released" and run["manual"] and run["job_status"] == "queued"
    assert shown["runs"][0]["job_id"] == run["job_id"]
    job = api.get(f"/v1/jobs/{run['job_id']}").get_json()
    assert job["owner"] == "test" and "/out/" in job["output_dir"] and "{" not in job["output_dir"]


def claimed_run(app: Flask, store: Store, name: str = "nightly", *, tenant: str = "test",
                slot: int | None = None) -> tuple[str, Run]:
    """A run of the schedule claimed at `slot`, as the beat claims one. By default its next slot: a slot of its
    own whose window is still open whenever the test runs (the current second is outside the schedule's window
    in the evening, and a release then finds the run missed)."""
    from broker.schedules import book

    schedule = book.get_schedule(store, tenant, name)
    slot = schedule.cadence().next_slot(time.time()) if slot is None else slot
    run = Run(slot=slot, status="releasing", job_id=slot_job_id(schedule, slot), due_at=slot, claimed_at=slot)
    assert runs.claim_slot(store, schedule, run, next_due=None, now=slot, runs_kept=10, manual=True).claimed
    return schedule.member, run


def release(app: Flask, member: str, slot: int) -> str:
    state = app.extensions["sits"]
    return release_run(state.settings, state.store, state.dispatcher, state.tenants, member, slot).outcome


def test_a_run_released_by_two_releasers_at_once_makes_one_job(app: Flask, api: Api, store: Store,
                                                               mlp: dict[str, Any], mlp_input: Path,
                                                               tmp_path: Path) -> None:
    made(api, schedule_body(tmp_path, mlp_input))
    member, run = claimed_run(app, store)
    start = threading.Barrier(4)
    outcomes: list[str] = []

    def releaser() -> None:
        start.wait()
        outcomes.append(release(app, member, run.slot))

    threads = [threading.Thread(target=releaser) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.client.delete(store.keys.release_lease(f"{member}|{run.slot}"))  # as once beat.release_timeout passed
    again = release(app, member, run.slot)  # a message delivered twice, after the first was done

    assert sorted(outcomes) == ["busy", "busy", "busy", "released"] and again == "settled"
    jobs = api.get("/v1/jobs").get_json()["jobs"]
    assert [job["id"] for job in jobs] == [run.job_id]
    assert read_schedule_stats(store)[("test", "nightly")].get("released") == 1


def test_a_release_that_keeps_failing_for_a_while_is_refused_after_its_tries_not_sent_for_ever(
        app: Flask, api: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant that keeps its input changing makes every release of a run end retryable ("changed while it was
    being read"); each try reads the whole file on a releaser every tenant shares."""
    from sits_api.schedules import release as releases

    made(api, schedule_body(tmp_path, mlp_input))
    member, run = claimed_run(app, store)

    def changing(*_: object, **__: object) -> None:
        raise RetryableError(f"input {mlp_input} changed while it was being read; submit again once it is written")

    monkeypatch.setattr(releases, "_submit", changing)
    for _ in range(releases.RELEASE_TRIES - 1):
        with pytest.raises(RetryableError):
            release(app, member, run.slot)
        assert runs.get_run(store, member, run.slot).status == "releasing"  # (sent again by the beat)
    outcome = release(app, member, run.slot)

    refused = runs.get_run(store, member, run.slot)
    assert outcome == "refused" and refused.status == "refused" and refused.reason_code == "unavailable"
    assert refused.reason.startswith(f"refused after {releases.RELEASE_TRIES} tries") and "changed" in refused.reason


def test_a_run_whose_job_was_made_is_never_refused_however_often_its_settling_fails(
        app: Flask, api: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sits_api.schedules import release as releases

    made(api, schedule_body(tmp_path, mlp_input))
    member, run = claimed_run(app, store)

    def unsettled(*_: object, **__: object) -> None:
        raise RetryableError("Redis cannot serve this now: retry in a moment")

    monkeypatch.setattr(releases, "_released", unsettled)  # (the job is made; recording it fails)
    for _ in range(releases.RELEASE_TRIES + 1):
        with pytest.raises(RetryableError):
            release(app, member, run.slot)

    assert runs.get_run(store, member, run.slot).status == "releasing"  # (sent again, never refused)
    assert [job["id"] for job in api.get("/v1/jobs").get_json()["jobs"]] == [run.job_id]


def test_a_release_longer_than_its_hold_keeps_the_run_from_a_second_releaser(
        app: Flask, api: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large input's read and checksum may outlast `beat.release_timeout`; the beat then sends the run again,
    and a second releaser must find it held, not start a second read beside the first."""
    from sits_api.schedules import release as releases

    made(api, schedule_body(tmp_path, mlp_input))
    member, run = claimed_run(app, store)
    state = app.extensions["sits"]
    settings = state.settings.with_overrides(beat={"release_timeout": 1.0})
    reading = threading.Event()
    submit = releases._submit

    def slow(*args: Any, **kwargs: Any) -> None:
        reading.set()
        time.sleep(3.5)  # (three and a half holds' length)
        submit(*args, **kwargs)

    monkeypatch.setattr(releases, "_submit", slow)
    first: list[str] = []
    releaser = threading.Thread(target=lambda: first.append(releases.release_run(
        settings, store, state.dispatcher, state.tenants, member, run.slot).outcome))
    releaser.start()
    assert reading.wait(5)
    time.sleep(2.2)  # (past two holds' length)
    second = releases.release_run(settings, store, state.dispatcher, state.tenants, member, run.slot).outcome
    releaser.join()

    assert second == "busy" and first == ["released"]


def test_a_release_whose_job_cannot_be_made_is_refused_with_its_reason_and_counted(
        app: Flask, client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    alice = key(client, store, "alice", "user", "acme")
    made(alice, schedule_body(tmp_path, mlp_input, job={"model": "mlp", "output_dir": str(tmp_path / "{slot}"),
                                                         "input_batch": str(tmp_path / "in-{date}.npy")}))
    member, run = claimed_run(app, store, tenant="acme")

    outcome = release(app, member, run.slot)

    refused = runs.get_run(store, member, run.slot)
    assert outcome == "refused" and refused is not None and refused.status == "refused"
    assert "in-" in refused.reason and refused.reason_code
    totals = read_schedule_stats(store)[("acme", "nightly")]
    assert totals.get("refused") == 1 and totals.refusals == {refused.reason_code: 1}
    shown = alice.get("/v1/schedules/nightly").get_json()["runs"][0]
    assert shown["status"] == "refused" and shown["reason"] == refused.reason and shown["job_id"] is None


def test_a_release_acts_as_its_owner_as_it_stands_then(app: Flask, client: FlaskClient, store: Store,
                                                        mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    alice = key(client, store, "alice", "user", "acme")
    made(alice, schedule_body(tmp_path, mlp_input))
    revoke_api_keys(store, "alice")
    member, run = claimed_run(app, store, tenant="acme")

    assert release(app, member, run.slot) == "refused"
    refused = runs.get_run(store, member, run.slot)
    assert refused is not None and "no key of that name" in refused.reason and refused.reason_code == "forbidden"


def test_a_release_deadline_admission_refuses_is_recorded_on_its_run(app: Flask, api: Api, store: Store,
                                                                     mlp: dict[str, Any], mlp_input: Path,
                                                                     tmp_path: Path) -> None:
    made(api, schedule_body(tmp_path, mlp_input, deadline="2h"))
    member, run = claimed_run(app, store)

    outcome = release(app, member, run.slot)  # no worker is alive: no deadline can be met

    refused = runs.get_run(store, member, run.slot)
    assert outcome == "refused" and refused is not None and refused.reason_code == "deadline_infeasible"
    assert "no live worker" in refused.reason
    assert api.get("/v1/jobs").get_json()["jobs"] == []


def test_a_claim_lost_with_a_failover_and_made_again_meets_the_job_of_the_first(app: Flask, api: Api, store: Store,
                                                                                mlp: dict[str, Any], mlp_input: Path,
                                                                                tmp_path: Path) -> None:
    made(api, schedule_body(tmp_path, mlp_input))
    member, first = claimed_run(app, store)
    assert release(app, member, first.slot) == "released"
    # an asynchronous failover lost the run and the releaser's hold, not the job: the slot is claimed again
    store.client.delete(store.keys.schedule_runs(member), store.keys.schedule_run_slots(member),
                        store.keys.release_lease(f"{member}|{first.slot}"))
    _, again = claimed_run(app, store, slot=first.slot)

    assert again.job_id == first.job_id and release(app, member, again.slot) == "released"
    assert [job["id"] for job in api.get("/v1/jobs").get_json()["jobs"]] == [first.job_id]


def test_creates_at_once_cannot_each_pass_the_release_rate_against_the_others_absence(
        client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Many creates sent at once each read the tenant's schedules before any of the others is stored. The
    rate is checked again inside the write's transaction; here the early read is made to see none, as each
    racing create's does."""
    alice = key(client, store, "alice", "user", "acme")
    for name in ("fast1", "fast2"):
        made(alice, schedule_body(tmp_path, mlp_input, name=name, cron=None, every="1s", window=None))
    monkeypatch.setattr(definitions.book, "list_schedules", lambda *_, **__: [])  # (the racing creates' view)

    third = alice.post("/v1/schedules", json=schedule_body(tmp_path, mlp_input, name="fast3", cron=None, every="1s",
                                                           window=None))

    assert third.status_code == 400 and "max_releases_per_minute" in error_of(third)
    monkeypatch.undo()
    assert [schedule["name"] for schedule in alice.get("/v1/schedules").get_json()["schedules"]] == ["fast1", "fast2"]


def test_changes_at_once_cannot_each_pass_the_release_rate_against_the_others_old_periods(
        client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two PATCHes sent at once each read the tenant's schedules with the other's old period. The rate is
    checked inside the change's transaction, among the schedules it reads; here the early read is made to
    see none, as a racing change's does."""
    alice = key(client, store, "alice", "user", "acme")
    made(alice, schedule_body(tmp_path, mlp_input, name="fast1", cron=None, every="1s", window=None))
    made(alice, schedule_body(tmp_path, mlp_input, name="fast2", cron=None, every="2s", window=None))
    made(alice, schedule_body(tmp_path, mlp_input, name="nightly"))  # 60 + 30 + 1 a minute
    monkeypatch.setattr(definitions.book, "list_schedules", lambda *_, **__: [])  # (the racing changes' view)

    faster = alice.client.patch("/v1/schedules/fast2", headers=alice.headers, json={"every": "1s"})

    assert faster.status_code == 400 and "max_releases_per_minute" in error_of(faster)
    monkeypatch.undo()
    assert alice.get("/v1/schedules/fast2").get_json()["every"] in (2, 2.0, "2s")


def test_a_tenant_s_schedules_ask_for_at_most_its_releases_a_minute(client: FlaskClient, store: Store,
                                                                    settings: Settings, mlp: dict[str, Any],
                                                                    mlp_input: Path, tmp_path: Path) -> None:
    """One tenant's seconds-level schedules would keep the shared releasers busy: past
    `beat.max_releases_per_minute` (120: two `every: 1s` schedules) a schedule is refused, for its tenant."""
    alice, gary = key(client, store, "alice", "user", "acme"), key(client, store, "gary", "user", "globex")
    for name in ("fast1", "fast2"):
        made(alice, schedule_body(tmp_path, mlp_input, name=name, cron=None, every="1s", window=None))

    third = alice.post("/v1/schedules", json=schedule_body(tmp_path, mlp_input, name="fast3", cron=None, every="1s",
                                                           window=None))
    slower = alice.client.patch("/v1/schedules/fast2", headers=alice.headers, json={"every": "2s"})

    assert third.status_code == 400 and "max_releases_per_minute" in error_of(third)
    assert slower.status_code == 200  # (a patch counts the schedule once, at its new period)
    made(alice, schedule_body(tmp_path, mlp_input, name="nightly"))  # a cron asks for 1 a minute: 60 + 30 + 1
    made(gary, schedule_body(tmp_path, mlp_input, name="fast1", cron=None, every="1s", window=None))  # its own


def test_a_user_cannot_tell_whether_another_user_of_its_tenant_has_a_schedule_of_a_name(
        client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """Naming another user's schedule in `after` answers as naming none: the same 400, the same words."""
    alice, bob = key(client, store, "alice", "user", "acme"), key(client, store, "bob", "user", "acme")
    made(bob, schedule_body(tmp_path, mlp_input, name="secret"))

    others = alice.post("/v1/schedules", json=schedule_body(tmp_path, mlp_input, name="mine", after=["secret"]))
    missing = alice.post("/v1/schedules", json=schedule_body(tmp_path, mlp_input, name="mine", after=["nothing"]))

    assert others.status_code == missing.status_code == 400
    assert error_of(others) == error_of(missing).replace("'nothing'", "'secret'")
    boss = key(client, store, "boss", "tenant-admin", "acme")  # (one that may read it may chain after it)
    made(boss, schedule_body(tmp_path, mlp_input, name="after-secret", after=["secret"]))


def test_a_tenant_s_releases_beyond_its_place_go_back_to_the_beat_and_the_others_go_on(
        app: Flask, client: FlaskClient, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """A release reads and checksums its job's input: one tenant's many runs due together, each of a large
    file, held every releaser thread while the other tenants' runs waited. Past `beat.releases_per_tenant`
    (1) at once, a run goes back to the beat, to be sent again a second later."""
    from broker.schedules.release_places import give_back_release_place, take_release_place
    alice, gary = key(client, store, "alice", "user", "acme"), key(client, store, "gary", "user", "globex")
    made(alice, schedule_body(tmp_path, mlp_input))
    theirs_body = schedule_body(tmp_path, mlp_input)
    theirs_body["job"]["output_dir"] = str(tmp_path / "globex-out" / "{slot}")
    made(gary, theirs_body)
    member, run = claimed_run(app, store, tenant="acme")
    others, theirs = claimed_run(app, store, tenant="globex")
    timeout = app.extensions["sits"].settings.beat.release_timeout
    assert take_release_place(store, "acme", "acme|etl|1", most=1, hold_seconds=60, now=time.time())  # (at work)

    turned = release(app, member, run.slot)
    resend_at = store.client.zscore(store.keys.schedule_runs_releasing, f"{member}|{run.slot}")
    meanwhile = release(app, others, theirs.slot)
    now = alice.post("/v1/schedules/nightly/run")  # (made on the caller's own API thread: no place to wait for)
    give_back_release_place(store, "acme", "acme|etl|1")
    later = release(app, member, run.slot)

    assert turned == "deferred" and meanwhile == "released" and later == "released"
    assert now.status_code == 201 and now.get_json()["status"] == "released", now.get_json()
    assert resend_at is not None and abs(resend_at + timeout - 1.0 - time.time()) < 5  # (the beat sends it again soon)
    assert not store.client.exists(store.keys.tenant_releases("acme"))  # (each release gave its place back)
