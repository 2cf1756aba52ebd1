"""Commands sent straight on a thread's own Redis connection, for the hot paths.

A `Store` gives each thread a client with one connection of its own (`broker/state/store.py`). On it,
redis-py's way of sending a command (its argument encoder in Python, its retry wrapper, its lock,
its reply callbacks) costs most of a small command's client CPU: about 130 of the 180 us of a script
call with 30 arguments on a 2-core machine, where the same bytes packed by hiredis and written to the
socket cost 45. The online path sends a script per request and several commands per batch, so its
calls go through `send_held`: the commands packed by hiredis, pipelined, and their raw replies read
off the connection (no callbacks: a command's reply as Redis sends it). Anything out of the ordinary
goes through the caller's `fallback`, redis-py's own call: a client without a connection of its own,
an argument hiredis does not pack (redis-py's error for it), a script Redis does not know yet
(redis-py loads it), and a connection that failed (redis-py reconnects and retries it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import hiredis
import redis

Result = TypeVar("Result")


def send_held(client: Any, commands: Sequence[tuple[Any, ...]], fallback: Callable[[], Result]) -> list[Any] | Result:
    """The raw replies of `commands`, sent in one write on `client`'s own connection; else `fallback()`.

    An error reply raises its ResponseError, as redis-py does; with several commands the connection
    is dropped first (replies after the error are still unread on it), and a script Redis does not
    know is not run again, as the commands before it have run. A connection that fails is
    dropped and the commands go through `fallback`, as redis-py retries a command whose connection
    failed: so a command whose reply was lost may run twice, as it may under redis-py's own retries.
    """
    connection = client.connection
    if connection is None:
        return fallback()
    try:
        packed = [hiredis.pack_command(command) for command in commands]
    except TypeError:
        return fallback()
    try:
        connection.send_packed_command(packed)
        return [connection.read_response() for _ in packed]
    except redis.ResponseError as err:
        if len(packed) > 1:
            connection.disconnect()  # (the replies after the error are still unread on it)
            raise
        if isinstance(err, redis.exceptions.NoScriptError):
            return fallback()
        raise
    except (redis.ConnectionError, redis.TimeoutError):
        connection.disconnect()
        return fallback()
