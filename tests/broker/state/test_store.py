"""A Store's connections: one held per thread, a fresh one in a forked child, back after a Redis restart."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest
import redis
from redis._parsers.base import BaseParser

from broker.errors import StoreBusy
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store, translate_redis_errors


def connection_id(store: Store) -> int:
    """Redis's id of the connection this thread's commands go over."""
    return int(store.client.client_id())


def test_each_thread_holds_one_connection_of_its_own(redis_server: EmbeddedRedis) -> None:
    store = Store.connect(redis_server.url, "tstore")
    mine = connection_id(store)
    seen: dict[str, list[int]] = {}
    all_connected = threading.Barrier(3)  # alive together: an ended thread's connection goes back to the pool

    def twice(name: str) -> None:
        seen[name] = [connection_id(store)]
        all_connected.wait(timeout=10)
        seen[name].append(connection_id(store))

    threads = [threading.Thread(target=twice, args=(f"t{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert connection_id(store) == mine  # the same connection for every command of a thread
    assert all(first == again for first, again in seen.values())
    assert len({mine, *(first for first, _ in seen.values())}) == 4  # and another one per thread


def _child_connection(url: str, parent_connection: int, store: Store, answers: multiprocessing.Queue) -> None:
    answers.put(connection_id(store) != parent_connection)


def test_more_threads_than_redis_py_s_default_pool_each_hold_a_connection(redis_server: EmbeddedRedis) -> None:
    """An API process of many request threads (`api.threads` up to 1,024): each thread's first call opens its
    held connection, and none is refused for the pool's size (redis-py allows 100 unless told)."""
    store = Store.connect(redis_server.url, "tstore")
    threads_alive = 130
    together = threading.Barrier(threads_alive)  # alive together, so no connection goes back to the pool
    failures: list[Exception] = []
    ids: set[int] = set()

    def hold() -> None:
        try:
            ids.add(connection_id(store))
        except Exception as err:  # (any failure is the test's finding)
            failures.append(err)
        together.wait(timeout=20)

    threads = [threading.Thread(target=hold) for _ in range(threads_alive)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    assert len(ids) == threads_alive


def test_a_forked_child_does_not_share_its_parent_s_socket(redis_server: EmbeddedRedis) -> None:
    store = Store.connect(redis_server.url, "tstore")
    parent = connection_id(store)
    fork = multiprocessing.get_context("fork")
    answers = fork.Queue()
    child = fork.Process(target=_child_connection, args=(redis_server.url, parent, store, answers))
    child.start()
    child.join(30)

    assert child.exitcode == 0
    assert answers.get(timeout=5) is True
    assert connection_id(store) == parent  # the parent's connection is untouched


def test_a_held_connection_works_again_after_redis_restarts(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    try:
        store = Store.connect(server.url, "tstore")
        store.client.set("k", "before")
        server.stop()
        server.start()

        assert store.client.set("k", "after") is True  # the dead socket is replaced, not reported
        assert store.client.get("k") == "after"
    finally:
        server.stop(kill=True)


@pytest.mark.parametrize("command", ["scripts", "client"])
def test_scripts_and_client_are_this_thread_s(redis_server: EmbeddedRedis, command: str) -> None:
    store = Store.connect(redis_server.url, "tstore")
    held: list[object] = []
    thread = threading.Thread(target=lambda: held.append(getattr(store, command)))
    thread.start()
    thread.join()

    assert getattr(store, command) is getattr(store, command)
    assert held[0] is not getattr(store, command)


def test_a_reply_left_unread_on_a_held_connection_is_not_taken_for_the_next_command_s(
        redis_server: EmbeddedRedis) -> None:
    """A command cut short leaves its reply on the socket; the next command must get its own."""
    store = Store.connect(redis_server.url, "tstore")
    held = store.client
    held.set("k", "before")
    held.connection.send_command("SET", "k", "after")  # its "OK" is never read
    assert held.connection.can_read(2.0)  # (it has arrived: one still on its way cannot be seen)

    assert store.client.get("k") == "after"  # not "OK"
    assert store.client.get("k") == "after"


@pytest.mark.parametrize(("reply", "says"), [
    ("READONLY You can't write against a read only replica.", "read-only replica"),
    ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", "save"),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", "master is down"),
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", "long script"),
])
def test_a_redis_that_cannot_serve_for_a_while_is_a_retryable_error_naming_why(reply: str, says: str) -> None:
    # (each reply as redis-py's parser turns it into an exception; BUSY also comes through a real Redis in
    # tests/api/intake/test_result_inbox.py)
    with pytest.raises(StoreBusy, match=says) as caught, translate_redis_errors():
        raise BaseParser.parse_error(reply)
    assert caught.value.retryable and caught.value.http_status == 503


def test_an_error_reply_of_a_command_gone_wrong_passes_as_it_is(redis_server: EmbeddedRedis) -> None:
    store = Store.connect(redis_server.url)
    store.client.set("sits-test:a-string", "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"), translate_redis_errors():
        store.client.lpush("sits-test:a-string", "y")
    store.client.delete("sits-test:a-string")
