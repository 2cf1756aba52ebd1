"""One waiter thread per API process delivers every waiting request's result (real Redis)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from broker.errors import StoreBusy
from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from sits_api.intake.result_inbox import Delivery, ResultInbox
from tests.leasing import lease_items
from tests.waiting import eventually

MODEL = "mlp@v1"


def spec(request_id: str, reply_to: str) -> RequestSpec:
    return RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.full((1, 4), float(request_id[1:]), np.float32)}, rows=1, tokens=None,
                       bucket="features", factors={"enqueued_at": time.time()}, reply_to=reply_to)


def run_as_a_worker(store: Store, count: int) -> None:
    """Lease the waiting requests as one batch and complete them, each with its own input doubled."""
    leased = lease_items(store, MODEL, now=time.time(), lease_seconds=60, max_items=count)
    assert len(leased) == count
    inputs = requests.load_inputs(store, leased)
    results = [RequestResult(item, outputs={"y": tensors["features"] * 2})
               for item, tensors in zip(leased, inputs, strict=True) if tensors is not None]
    requests.complete_requests(store, results, now=time.time(), keep_seconds=60, batch_size=count, worker="w")


def test_each_waiting_request_gets_its_own_result_through_the_process_inbox(store: Store) -> None:
    inbox = ResultInbox(store)
    got: dict[str, float] = {}

    def wait_for(request_id: str) -> None:
        with inbox.expecting(request_id) as answer:
            requests.submit_request(store, spec(request_id, answer.reply_to), score=1.0, now=time.time(),
                                    max_age_seconds=60)
            result = answer.wait(10)
        assert result is not None and result.status == "succeeded"
        got[request_id] = float(result.outputs["y"][0, 0])

    threads = [threading.Thread(target=wait_for, args=(f"r{n}",)) for n in range(1, 9)]
    for thread in threads:
        thread.start()
    eventually(lambda: store.client.zcard(store.keys.ready(MODEL)) >= 8, timeout=10, interval=0.01)
    run_as_a_worker(store, 8)
    for thread in threads:
        thread.join(10)

    assert got == {f"r{n}": 2.0 * n for n in range(1, 9)}
    assert inbox.waiting() == 0
    assert store.client.llen(inbox.key) == 0  # drained


def test_a_result_that_comes_after_its_waiter_gave_up_stays_readable(store: Store) -> None:
    inbox = ResultInbox(store)
    with inbox.expecting("r1") as answer:
        requests.submit_request(store, spec("r1", answer.reply_to), score=1.0, now=time.time(), max_age_seconds=60)
        assert answer.wait(0.05) is None
    assert inbox.waiting() == 0

    run_as_a_worker(store, 1)

    record = requests.get_request(store, "r1")
    assert record.status == "succeeded" and float(record.outputs["y"][0, 0]) == 2.0
    # the waiter drops what nobody awaits
    assert eventually(lambda: store.client.llen(inbox.key) == 0, timeout=5, interval=0.01)


def test_a_request_nobody_waits_for_keeps_its_result_in_its_hash_alone(store: Store) -> None:
    inbox = ResultInbox(store)
    with inbox.expecting("r1", wait=False) as answer:
        assert answer.reply_to == "" and answer.wait(1) is None  # (at once)
        requests.submit_request(store, spec("r1", answer.reply_to), score=1.0, now=time.time(), max_age_seconds=60)
    run_as_a_worker(store, 1)

    assert list(store.client.scan_iter(match=store.keys.request("r1") + "*")) == [store.keys.request("r1")]
    assert store.client.llen(inbox.key) == 0  # (no list holds the result again)
    assert requests.wait_for_request(store, "r1", timeout=1).status == "succeeded"


def test_a_forked_process_waits_on_an_inbox_of_its_own(store: Store) -> None:
    inbox = ResultInbox(store)
    parent_key = inbox.key
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # gunicorn forks its workers from the process that made the app
        try:
            os.write(write, inbox.key.encode())
        finally:
            os._exit(0)
    os.close(write)
    child_key = os.read(read, 1000).decode()
    os.close(read)
    os.waitpid(child, 0)

    assert child_key and child_key != parent_key and str(child) in child_key


def test_the_waiter_carries_on_after_redis_went_away(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    try:
        store = Store.connect(server.url)
        inbox = ResultInbox(store, block_seconds=0.1)
        assert inbox.key
        server.stop()
        time.sleep(0.5)  # the waiter's calls fail meanwhile
        server.start()
        with inbox.expecting("r1") as answer:
            requests.submit_request(store, spec("r1", answer.reply_to), score=1.0, now=time.time(),
                                    max_age_seconds=60)
            run_as_a_worker(store, 1)
            result = answer.wait(10)
        assert result is not None and float(result.outputs["y"][0, 0]) == 2.0
    finally:
        server.stop()


def test_a_delivery_hands_over_the_first_result_once_it_is_in() -> None:
    delivery = Delivery()
    assert delivery.take(0.01) is None  # (nothing yet: the wait times out)
    threading.Timer(0.05, delivery.put, args=({"id": "r1", "status": "succeeded"},)).start()
    assert delivery.take(5.0) == {"id": "r1", "status": "succeeded"}
    delivery.put({"id": "r1", "status": "failed"})  # (a second result changes nothing)
    assert delivery.take(0.0) == {"id": "r1", "status": "succeeded"}


def test_the_waiter_carries_on_after_an_error_redis_answers_and_an_entry_it_cannot_read(store: Store) -> None:
    inbox = ResultInbox(store, block_seconds=0.1)
    store.client.set(inbox.key, "not a list")  # every pop is refused (WRONGTYPE), as by a Redis that misbehaves
    with inbox.expecting("r0") as answer:
        assert answer.wait(0.7) is None  # (the pops fail meanwhile; the thread pauses between them)
    store.client.delete(inbox.key)
    store.client.rpush(inbox.key, "{not json", "[1, 2]")  # entries that are no result's fields
    with inbox.expecting("r1") as answer:
        requests.submit_request(store, spec("r1", answer.reply_to), score=1.0, now=time.time(), max_age_seconds=60)
        run_as_a_worker(store, 1)
        result = answer.wait(10)

    assert result is not None and float(result.outputs["y"][0, 0]) == 2.0


def test_the_waiter_carries_on_after_redis_was_busy_with_a_long_script(store: Store,
                                                                       redis_server: EmbeddedRedis) -> None:
    admin = store.pooled_client
    limit = admin.config_get("lua-time-limit")["lua-time-limit"]
    admin.config_set("lua-time-limit", 50)  # BUSY for everyone else after 50 ms of a script
    spin = ("local t0 = redis.call('TIME') repeat local t = redis.call('TIME') "
            "until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > 1000000 return 1")
    other = Store.connect(redis_server.url)
    inbox = ResultInbox(store, block_seconds=0.1)
    try:
        slow = threading.Thread(target=lambda: other.pooled_client.eval(spin, 0))  # (another client's long call)
        slow.start()
        time.sleep(0.3)
        with inbox.expecting("r0") as answer:  # the waiter starts during the script: its pops answer BUSY
            with pytest.raises(StoreBusy, match="long script"):
                requests.submit_request(store, spec("r9", answer.reply_to), score=1.0, now=time.time(),
                                        max_age_seconds=60)
            answer.wait(0.2)
        slow.join(10)
        with inbox.expecting("r1") as answer:
            requests.submit_request(store, spec("r1", answer.reply_to), score=1.0, now=time.time(),
                                    max_age_seconds=60)
            run_as_a_worker(store, 1)
            result = answer.wait(10)
    finally:
        admin.config_set("lua-time-limit", limit)

    assert result is not None and float(result.outputs["y"][0, 0]) == 2.0
