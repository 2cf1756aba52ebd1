"""A hostile tenant floods a small Redis with large online requests (real Redis, the API app, no worker).

Counting requests alone (`max_queued`) lets one tenant's few hundred large requests fill Redis's
`maxmemory`; every tenant's next write is then refused (503 `store_full`). Its budget of queued input
bytes (`max_queued_bytes`) stops the flood at its own 429, and the other tenant's requests go on. The
test fails on the code before the budget: the flood fills Redis and the other tenant gets 503.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from broker.online import requests
from broker.online.requests import encode_array
from broker.state.embedded import EmbeddedRedis
from broker.state.keys import Keys
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from broker.tenants.usage import day_number
from sits_api.app import create_app
from tests.api.api_helpers import Api, error_of, make_settings
from tests.leasing import lease_items

MAXMEMORY = 24 * 2**20
"""The throw-away Redis's `maxmemory`: a flood of a few dozen 1 MiB requests fills it."""
BUDGET = 3 * 2**20
"""`evil`'s `max_queued_bytes`: an eighth of that Redis, two of the flood's requests."""


@dataclass(frozen=True)
class Floodable:
    store: Store
    evil: Api
    alice: Api


@pytest.fixture
def floodable(tmp_path: Path, zoo_dir: Path) -> Iterator[Floodable]:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False, maxmemory=MAXMEMORY).start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    store = Store(client=client, keys=Keys(prefix="t" + uuid.uuid4().hex[:10]))
    settings = make_settings(server, store, tmp_path, zoo_dir).with_overrides(
        tenants={"evil": {"max_queued_bytes": BUDGET}, "acme": {}})
    test_client = create_app(settings, store=store).test_client()
    admin = Api(test_client, create_api_key(store, "test", "admin"))
    assert admin.post("/v1/models", json={"name": "mlp", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201
    try:
        yield Floodable(store, Api(test_client, create_api_key(store, "mallory", "user", tenant="evil")),
                        Api(test_client, create_api_key(store, "alice", "user", tenant="acme")))
    finally:
        client.close()
        server.stop()


def rows(count: int) -> dict[str, Any]:
    """A v1 request of `count` MLP rows, sent as base64 .npy (cheap to send, 256 bytes a row in Redis)."""
    return {"model": "mlp", "inputs": {"features": {"b64": encode_array(np.ones((count, 64), np.float32))}}}


def test_a_tenant_flooding_large_requests_stops_at_its_byte_budget_and_another_tenant_s_requests_go_on(
        floodable: Floodable) -> None:
    flood = rows(4096)  # 1 MiB of float32, about 1.4 MB as Redis holds it
    answers = [floodable.evil.post("/v1/requests", json=flood) for _ in range(40)]  # 40 MiB: past maxmemory

    codes = [answer.status_code for answer in answers]
    assert codes[:2] == [202, 202] and set(codes[2:]) == {429}, codes
    refused = answers[-1]
    assert int(refused.headers["Retry-After"]) >= 1
    assert "max_queued_bytes" in error_of(refused) and f"{BUDGET:,} bytes" in error_of(refused), error_of(refused)
    assert refused.get_json()["code"] == "queue_full"
    v2 = floodable.evil.post("/v2/models/mlp/infer", json={"inputs": [
        {"name": "features", "shape": [4096, 64], "datatype": "FP32", "data": [1.0] * (4096 * 64)}]})
    assert v2.status_code == 429 and "max_queued_bytes" in error_of(v2), v2.get_json()  # v2 is capped alike

    other = floodable.alice.post("/v1/requests", json=rows(4096))
    assert other.status_code == 202, other.get_json()  # acme's request is queued: Redis has room
    used = int(floodable.store.client.info("memory")["used_memory"])
    assert used < MAXMEMORY / 2, used


def test_one_request_larger_than_the_whole_budget_is_a_413_that_names_it(floodable: Floodable) -> None:
    answer = floodable.evil.post("/v1/requests", json=rows(3 * 4096))  # 3 MiB raw, more in base64

    assert answer.status_code == 413 and answer.get_json()["code"] == "payload_too_large", answer.get_json()
    assert "tenants.evil.max_queued_bytes" in error_of(answer)


def test_answers_kept_in_redis_count_against_the_budget_until_they_expire(floodable: Floodable) -> None:
    """Answers as large as their inputs (an identity-sized model) stay in Redis `online.result_ttl`: before, each
    answer gave its inputs' bytes back, and a tenant under its budget filled Redis with results."""
    codes = []
    for _ in range(3):
        answer = floodable.evil.post("/v1/requests", json=rows(4096))
        codes.append(answer.status_code)
        if answer.status_code != 202:
            break
        model_ref = f"mlp@{answer.get_json()['model_version']}"
        [item] = lease_items(floodable.store, model_ref, now=time.time(), lease_seconds=30, max_items=1)
        outputs = {"y": np.ones((4096, 64), np.float32)}
        requests.complete_requests(floodable.store, [requests.RequestResult(item, outputs=outputs)], now=time.time(),
                                   keep_seconds=600, batch_size=1, worker="w", run_started=time.time(), run_rows=4096)

    assert codes == [202, 202, 429]  # two kept results, then the budget is spent
    assert "2 results kept" in error_of(answer) and "max_queued_bytes" in error_of(answer), error_of(answer)
    assert answer.get_json()["code"] == "queue_full" and int(answer.headers["Retry-After"]) >= 1


def test_outputs_larger_than_their_inputs_are_held_to_the_budget_too(floodable: Floodable) -> None:
    """Inputs are counted at submit, outputs only once answered: a model whose outputs dwarf its inputs (a
    sequence model's S x S scores) let a tenant keep many times its budget in Redis, a few hundred bytes of
    input at a time. A result that would take the tenant past its budget now fails instead of being kept: a
    413 when it is larger than the whole budget, a 429 to retry when the tenant's other results fill it."""
    def answered(rows_out: int) -> tuple[dict[str, Any], int]:
        answer = floodable.evil.post("/v1/requests", json=rows(1))
        assert answer.status_code == 202, error_of(answer)
        model_ref = f"mlp@{answer.get_json()['model_version']}"
        [item] = lease_items(floodable.store, model_ref, now=time.time(), lease_seconds=30, max_items=1)
        outputs = {"y": np.ones((rows_out, 64), np.float32)}  # (256 bytes a row raw, about 340 kept)
        requests.complete_requests(floodable.store, [requests.RequestResult(item, outputs=outputs)], now=time.time(),
                                   keep_seconds=600, batch_size=1, worker="w", run_started=time.time(), run_rows=1)
        record = floodable.evil.get(f"/v1/requests/{answer.get_json()['id']}").get_json()
        return record, int(floodable.store.client.hget(floodable.store.keys.tenant_queued_bytes("evil"), "total"))

    too_large, after_first = answered(4 * 4096)  # about 5.6 MB kept, with a 3 MiB budget
    kept, after_second = answered(4096)  # about 1.4 MB: fits
    crowded, after_third = answered(6144)  # about 2.1 MB: fits alone, not beside the second

    assert too_large["status"] == "failed" and too_large["error_code"] == "payload_too_large", too_large
    assert "max_queued_bytes" in too_large["error"] and after_first < 4096
    assert kept["status"] == "succeeded" and 1_300_000 < after_second < BUDGET
    assert crowded["status"] == "failed" and crowded["error_code"] == "queue_full", crowded
    assert after_third - after_second < 2048  # (its failure is kept, not its outputs)
    bill = floodable.store.client.hgetall(floodable.store.keys.tenant_bill("evil", day_number(time.time())))
    assert bill.get("failed") == "2", bill  # (billed as the failures they are)
    assert floodable.alice.post("/v1/requests", json=rows(1)).status_code == 202
