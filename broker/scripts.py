"""Loading the Lua scripts in `broker/lua/` and registering them with a Redis client.

Each script is one atomic operation (STYLE.md, "Redis and Lua"); its text is
read once with `importlib.resources` and registered once per client, so
every call is an EVALSHA of one stable SHA. A script cannot call another, so
the helpers they share (`lib.lua`: the ticket check, the doorbell, the
ticket top-up, `number_or`, the per-status job counts) are put in front of each script's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import hiredis
import redis
from redis.commands.core import Script

SCRIPT_NAMES = (
    "enqueue_items",
    "lease_batch",
    "head_company",
    "queue_snapshot",
    "lease_riders",
    "return_items",
    "ack_chunk",
    "start_item",
    "finish_item",
    "stop_job",
    "count_jobs",
    "forget_chunks",
    "reap_leases",
    "retry_item",
    "note_failure",
    "take_reaper_turn",
    "top_up_tickets",
    "release_ticket",
    "submit_request",
    "complete_requests",
    "rescore",
    "psa_jump",
    "prune_queue",
    "expire_requests",
    "note_usage",
)


@cache
def _lua_file(name: str) -> str:
    return resources.files("broker").joinpath("lua", f"{name}.lua").read_text()


@cache
def script_text(name: str) -> str:
    """The source registered for `broker/lua/<name>.lua`: the shared helpers of `lib.lua`, then the script."""
    return _lua_file("lib") + _lua_file(name)


class Scripts:
    """The registered scripts of one Redis client, called as attributes: `scripts.lease_batch(keys, args)`."""

    def __init__(self, client: redis.Redis) -> None:
        self._scripts = {name: HeldScript(client, client.register_script(script_text(name)))
                         for name in SCRIPT_NAMES}

    def __getattr__(self, name: str) -> Any:
        try:
            return self._scripts[name]
        except KeyError:
            raise AttributeError(name) from None


class HeldScript:
    """A registered script, sent straight on its client's own connection.

    A `Store` gives each thread a client with one connection of its own (`broker/store.py`). There,
    redis-py's way of running a script (its argument encoder in Python, its retry wrapper, its lock)
    costs about 130 of the 180 us of client CPU a call with 30 arguments takes on a 2-core machine.
    The hot paths make one such call per online request and several per batch, so this packs the
    command with hiredis (the same bytes redis-py sends) and reads the reply off the connection.
    Anything out of the ordinary goes through redis-py's own call: a client without a connection of
    its own, an argument hiredis does not pack (redis-py's error for it), a script Redis does not
    know yet (redis-py loads it), and a connection that failed (redis-py reconnects and retries it,
    as it does for every command).
    """

    def __init__(self, client: redis.Redis, script: Script) -> None:
        self._client = client
        self._script = script

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        connection = self._client.connection
        if connection is None:
            return self._script(keys=keys, args=args)
        try:
            packed = hiredis.pack_command(("EVALSHA", self._script.sha, len(keys), *keys, *args))
        except TypeError:
            return self._script(keys=keys, args=args)
        try:
            connection.send_packed_command([packed])
            return connection.read_response()
        except redis.exceptions.NoScriptError:
            return self._script(keys=keys, args=args)
        except (redis.ConnectionError, redis.TimeoutError):
            connection.disconnect()
            return self._script(keys=keys, args=args)
