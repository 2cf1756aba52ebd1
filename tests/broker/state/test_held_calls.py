"""Commands sent on a thread's own connection (`broker/state/held_calls.py`): the same replies and errors as
redis-py's own calls, and redis-py's call where the fast way cannot go."""

from __future__ import annotations

import pytest
import redis

from broker.state.held_calls import send_held
from broker.state.store import Store


def test_replies_are_the_raw_replies_of_each_command_in_order(store: Store) -> None:
    key = store.keys.request("held")
    store.client.hset(key, mapping={"inputs": "abc", "rows": 3})
    replies = send_held(store.client, [("HGET", key, "inputs"), ("HGET", key, "missing"), ("HGET", key, "rows")],
                        lambda: pytest.fail("the held connection was not used"))
    assert replies == ["abc", None, "3"]


def test_an_error_reply_raises_and_leaves_the_connection_in_step(store: Store) -> None:
    key = store.keys.request("held-error")
    store.client.set(key, "text")
    with pytest.raises(redis.ResponseError):
        send_held(store.client, [("HGET", key, "x"), ("GET", key)], lambda: pytest.fail("no fallback"))
    assert store.client.get(key) == "text"  # (the next reply read is this command's own)


def test_a_script_redis_forgot_is_loaded_again_by_redis_py(store: Store) -> None:
    store.client.script_flush()
    assert store.scripts.top_up_tickets(keys=[store.keys.tickets, store.keys.ticket_seq, store.keys.doorbell],
                                         args=[1.0, 1]) == ["t1"]


def test_an_argument_hiredis_does_not_pack_gets_redis_pys_error(store: Store) -> None:
    with pytest.raises(redis.DataError):
        store.scripts.top_up_tickets(keys=[store.keys.tickets, store.keys.ticket_seq, store.keys.doorbell],
                                     args=[None, 0])


def test_a_connection_the_server_closed_is_dropped_and_the_call_goes_through_redis_py(store: Store) -> None:
    client = store.client
    client.ping()
    store.pooled_client.client_kill_filter(_id=client.client_id())
    key = store.keys.request("held-reconnect")
    used: list[bool] = []

    def through_redis_py() -> list[int]:
        used.append(True)
        return [client.exists(key)]

    assert send_held(client, [("EXISTS", key)], through_redis_py) == [0]
    assert used, "the closed connection's failure did not reach the fallback"
