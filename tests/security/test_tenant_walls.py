"""A hostile tenant against the walls between tenants, through a real stack (API process, Redis, worker).

Tenants `acme` and `evil` each have a tenant admin; acme's users `alice` and `bob` work (alice
registered `shared-mlp`), and `evil`
tries what a tenant admin of its own tenant can do to reach them: a key of the same name, another
tenant's model name, its entitlements, ids that are no job's, and bodies that cost the API more to
decode than to send. Each test fails on the code before the wall was built.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from sits_worker.model.zoo import build_zoo
from tests.e2e.stack_helpers import stack_settings, wait_job

MAX_MODEL_FILE = 32 * 2**20
"""The stack's `models.max_file_size`: small, so that a file past it is cheap to make (sparse)."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any


def call(stack: Stack, key: str, method: str, path: str, body: Any = None, *, data: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 30.0) -> Reply:
    """One HTTP call to the stack's API with `key`: its status and JSON body, errors included."""
    if body is not None:
        data = json.dumps(body).encode()
    sent = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(stack.api_url + path, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return Reply(response.status, json.loads(response.read() or b"null"))
    except urllib.error.HTTPError as err:
        payload = err.read()
        try:
            return Reply(err.code, json.loads(payload))
        except ValueError:
            return Reply(err.code, payload.decode(errors="replace"))


@dataclass(frozen=True)
class Tenants:
    stack: Stack
    admin: str
    acme_admin: str
    alice: str
    bob: str
    evil_admin: str
    model_path: Path


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    home = tmp_path_factory.mktemp("walls") / "home"
    settings = stack_settings(home, streams=1).with_overrides(models={"max_file_size": MAX_MODEL_FILE})
    stack = Stack(settings, worker_count=1, api_port=0).start()
    admin = stack.api_key

    def key(name: str, role: str, tenant: str, by: str = admin) -> str:
        made = call(stack, by, "POST", "/v1/keys", {"name": name, "role": role, "tenant": tenant})
        assert made.status == 201, made
        return str(made.body["key"])

    for name in ("acme", "evil"):
        assert call(stack, admin, "PUT", f"/v1/tenants/{name}", {"guaranteed_share": 0.0}).status == 200
    acme_admin = key("acme-admin", "tenant-admin", "acme")
    model_path = build_zoo(home / "acme" / "models")["mlp"]  # (a tenant's files lie in its folder of each root)
    np.save(home / "acme" / "features.npy", np.random.default_rng(1).standard_normal((64, 64), dtype=np.float32))
    (home / "evil").mkdir()
    alice = key("alice", "user", "acme", by=acme_admin)
    assert call(stack, alice, "POST", "/v1/models", {"name": "shared-mlp", "path": str(model_path)}).status == 201
    yield Tenants(stack, admin, acme_admin, alice, key("bob", "user", "acme", by=acme_admin),
                  key("evil-admin", "tenant-admin", "evil"), model_path)
    stack.stop()


def submit_job(tenants: Tenants, key: str, output: str, **fields: Any) -> Reply:
    acme = tenants.stack.home / "acme"
    return call(tenants.stack, key, "POST", "/v1/jobs", {
        "model": "shared-mlp", "input_batch": str(acme / "features.npy"), "output_dir": str(acme / output), **fields})


# --- ownership by tenant --------------------------------------------------------------------


def test_a_tenant_admin_s_key_named_like_another_tenant_s_reaches_none_of_its_work_and_learns_nothing(
        tenants: Tenants) -> None:
    """The attack: evil's tenant admin makes a `user` key `alice` in its own tenant, to read and steer acme's
    alice's work, or to learn from a refusal that acme has an `alice`. A key name is its tenant's: the key is
    made as one named like no other tenant's key is, and every check compares tenants first."""
    stack = tenants.stack
    job = submit_job(tenants, tenants.alice, "alice-namesake-out")
    assert job.status == 201, job
    made = [call(stack, tenants.evil_admin, "POST", "/v1/keys", {"name": name, "role": "user", "tenant": "evil"})
            for name in ("alice", "nobody-has-this-name")]

    assert [reply.status for reply in made] == [201, 201], made
    evil_alice = made[0].body["key"]
    assert call(stack, evil_alice, "GET", f"/v1/jobs/{job.body['id']}").status == 404  # as an unknown id
    assert call(stack, evil_alice, "DELETE", f"/v1/jobs/{job.body['id']}").status == 404
    assert call(stack, evil_alice, "GET", "/v1/jobs").body["jobs"] == []
    assert call(stack, tenants.evil_admin, "DELETE", "/v1/keys/alice").body == {"revoked": 1}  # its own alone
    assert call(stack, tenants.alice, "GET", f"/v1/jobs/{job.body['id']}").status == 200


def test_a_key_named_like_another_tenant_s_reaches_none_of_its_work(tenants: Tenants) -> None:
    """A same-named key written into Redis by hand (or by a release that kept no per-tenant key sets) still
    reaches nothing of acme's: every check compares tenants first."""
    stack = tenants.stack
    job = submit_job(tenants, tenants.alice, "alice-out")
    assert job.status == 201, job
    job_id = job.body["id"]
    evil_alice = "sits_evil-alice-written-by-hand"
    stack.store.client.hset(stack.store.keys.api_keys, hashlib.sha256(evil_alice.encode()).hexdigest(),
                            json.dumps({"name": "alice", "role": "user", "tenant": "evil"}))

    assert call(stack, evil_alice, "GET", f"/v1/jobs/{job_id}").status == 404  # as an unknown id
    assert call(stack, evil_alice, "DELETE", f"/v1/jobs/{job_id}").status == 404
    assert job_id not in {listed["id"] for listed in call(stack, evil_alice, "GET", "/v1/jobs").body["jobs"]}
    seen = call(stack, evil_alice, "GET", "/v1/models/shared-mlp").body
    assert seen["owner"] is None and seen["path"] is None and seen["source_path"] is None
    version = call(stack, evil_alice, "POST", "/v1/models", {"name": "shared-mlp", "path": str(tenants.model_path)})
    assert version.status == 403, version  # acme's bare name keeps running acme's model
    assert call(stack, evil_alice, "POST", "/v1/jobs", {
        "model": "shared-mlp", "input_batch": str(stack.home / "evil" / "features.npy"),
        "output_dir": str(stack.home / "acme" / "alice-out")}).status == 403  # acme's folder is not evil's
    assert wait_job(stack.client(), job_id)["status"] == "succeeded"  # not cancelled by evil's alice


def test_a_tenant_s_users_add_versions_to_its_model_names_and_its_admin_routes_them(tenants: Tenants) -> None:
    """A name is its tenant's, not the registering key's: bob adds a version to the name alice
    registered, and acme's tenant admin routes it; evil's tenant admin may not."""
    stack = tenants.stack
    registration = {"name": "acme-mlp", "path": str(tenants.model_path)}
    alice_model = call(stack, tenants.alice, "POST", "/v1/models", registration)
    assert alice_model.status == 201 and alice_model.body["owner"] == "acme", alice_model

    by_bob = call(stack, tenants.bob, "POST", "/v1/models", registration)
    assert by_bob.status == 201, by_bob
    route = {"model": "acme-mlp", "split": {alice_model.body["version"]: 1.0}}
    assert call(stack, tenants.acme_admin, "PUT", "/v1/routes", route).status == 200
    assert call(stack, tenants.evil_admin, "PUT", "/v1/routes", route).status == 403


# --- each tenant's own folders -----------------------------------------------------------------


def test_another_tenant_s_input_and_output_folders_answer_as_a_path_outside_the_roots(tenants: Tenants) -> None:
    """Without roots of its own, a tenant reads and writes only its folder under each global root:
    acme's input is not evil's to read (its outputs would be evil's copy of acme's data), acme's
    folders and a running job's `.parts/` not evil's to write, and a file there that exists answers
    exactly as one that does not, so no tenant learns which of another's files exist."""
    stack, acme = tenants.stack, tenants.stack.home / "acme"
    np.save(stack.home / "evil" / "features.npy", np.zeros((4, 64), dtype=np.float32))
    evil_user = call(stack, tenants.evil_admin, "POST", "/v1/keys", {"name": "eve", "role": "user", "tenant": "evil"})
    eve = evil_user.body["key"]
    running = submit_job(tenants, tenants.bob, "bob-running")
    assert running.status == 201, running

    def job(input_batch: Path, output_dir: Path) -> Reply:
        return call(stack, eve, "POST", "/v1/jobs", {"model": "shared-mlp", "input_batch": str(input_batch),
                                                     "output_dir": str(output_dir)})

    theirs, missing = job(acme / "features.npy", stack.home / "evil" / "out"), job(acme / "nothing.npy",
                                                                                   stack.home / "evil" / "out")
    assert theirs.status == missing.status == 403 and theirs.body["code"] == "path_not_allowed", theirs
    assert theirs.body["error"].replace("features", "X") == missing.body["error"].replace("nothing", "X")
    for folder in (acme / "alice-out", acme / "bob-running" / ".parts" / running.body["id"], stack.home / "out"):
        into = job(stack.home / "evil" / "features.npy", folder)
        assert into.status == 403 and into.body["code"] == "path_not_allowed", (folder, into)
    model = call(stack, eve, "POST", "/v1/models", {"name": "evil-mlp", "path": str(tenants.model_path)})
    assert model.status == 403 and model.body["code"] == "path_not_allowed", model
    assert job(stack.home / "evil" / "features.npy", stack.home / "evil" / "out").status == 201  # its own folders


# --- ids, bodies and entitlements -------------------------------------------------------------


def test_an_id_that_is_no_job_s_answers_404_not_500(tenants: Tenants) -> None:
    """`<id>:done` names the job's set of done chunks: read as a job's hash it was a WRONGTYPE (500),
    and an oracle telling which ids exist."""
    stack = tenants.stack
    job = submit_job(tenants, tenants.bob, "bob-out")
    assert job.status == 201, job
    assert wait_job(stack.client(), job.body["id"])["status"] == "succeeded"
    assert stack.store.client.type(stack.store.keys.job_done(job.body["id"])) == "set"  # what `:done` would read

    for path in (f"/v1/jobs/{job.body['id']}:done", "/v1/jobs/j000000000000:done", "/v1/requests/rx:y"):
        answered = call(stack, tenants.admin, "GET", path)
        assert answered.status == 404 and answered.body["code"] in ("job_not_found", "not_found"), (path, answered)


def test_fifty_stacked_codings_are_refused_within_a_second(tenants: Tenants) -> None:
    body = json.dumps({"model": "shared-mlp", "inputs": {"features": [[0.0] * 64]}}).encode()
    for _ in range(50):
        body = gzip.compress(body, compresslevel=1)

    began = time.monotonic()
    answered = call(tenants.stack, tenants.bob, "POST", "/v1/requests", data=body,
                    headers={"Content-Encoding": ", ".join(["gzip"] * 50)})

    assert time.monotonic() - began < 1.0
    assert answered.status == 400 and "at most 2" in answered.body["error"], answered


def test_a_capped_tenant_may_not_ask_priority_15_or_the_vip_tier(tenants: Tenants) -> None:
    stack = tenants.stack
    assert call(stack, tenants.admin, "PUT", "/v1/tenants/acme",
                {"guaranteed_share": 0.0, "max_priority": 5, "user_tiers": ["premium"]}).status == 200
    time.sleep(0.6)  # every process reads the tenants again within half a second
    try:
        job = submit_job(tenants, tenants.bob, "bob-urgent", priority=15)
        assert job.status == 403 and job.body["code"] == "priority_not_allowed", job
        assert "max_priority" in job.body["error"] and "5" in job.body["error"]
        request = {"model": "shared-mlp", "inputs": {"features": [[0.0] * 64]}}
        vip = call(stack, tenants.bob, "POST", "/v1/requests", request | {"user_tier": "vip"})
        assert vip.status == 403 and vip.body["code"] == "tier_not_allowed", vip
        urgent = call(stack, tenants.bob, "POST", "/v1/requests", request | {"priority": 15})
        assert urgent.status == 403 and urgent.body["code"] == "priority_not_allowed", urgent
        v2 = call(stack, tenants.bob, "POST", "/v2/models/shared-mlp/infer", {
            "inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}],
            "parameters": {"priority": 1, "user_tier": "vip"}})
        assert v2.status == 403 and v2.body["code"] in ("priority_not_allowed", "tier_not_allowed"), v2
        assert call(stack, tenants.bob, "POST", "/v1/requests", request | {"user_tier": "premium"}).status in (200, 202)
    finally:
        call(stack, tenants.admin, "PUT", "/v1/tenants/acme", {"guaranteed_share": 0.0})


def test_an_oversized_model_file_is_refused_before_it_is_read(tenants: Tenants) -> None:
    """A sparse file past `models.max_file_size`: read, it would be parsed as an ONNX file of zeros
    (an invalid model after seconds of work); refused from its size, it is a 413 at once."""
    huge = tenants.stack.home / "acme" / "models" / "huge.onnx"
    with huge.open("wb") as handle:
        handle.truncate(MAX_MODEL_FILE + 1)

    began = time.monotonic()
    answered = call(tenants.stack, tenants.bob, "POST", "/v1/models", {"name": "huge", "path": str(huge)})

    assert time.monotonic() - began < 1.0
    assert answered.status == 413 and answered.body["code"] == "payload_too_large", answered
    assert "models.max_file_size" in answered.body["error"]


def test_a_full_redis_refuses_writes_with_a_retryable_503_and_reads_go_on(tenants: Tenants) -> None:
    """The embedded Redis runs with `redis.maxmemory` and evicts nothing: at it, a flood's next write is
    refused, and the API says so (503 `store_full`), instead of a 500 or Redis growing without bound."""
    stack, store = tenants.stack, tenants.stack.store
    assert int(store.client.config_get("maxmemory")["maxmemory"]) == stack.settings.redis.maxmemory > 0
    request = {"model": "shared-mlp", "inputs": {"features": [[0.0] * 64]}}
    store.client.config_set("maxmemory", "1")  # as if the flood had filled it
    try:
        refused = call(stack, tenants.bob, "POST", "/v1/requests", request)
        job = submit_job(tenants, tenants.bob, "bob-full")
        status = call(stack, tenants.admin, "GET", "/v1/status")
    finally:
        store.client.config_set("maxmemory", str(stack.settings.redis.maxmemory))

    assert refused.status == job.status == 503 and refused.body["code"] == job.body["code"] == "store_full", (
        refused, job)
    assert status.status == 200
    assert call(stack, tenants.bob, "POST", "/v1/requests", request).status in (200, 202)  # room again: accepted
