"""Loading the Lua scripts in `broker/state/lua/` and registering them with a Redis client.

Each script is one atomic operation (docs/architecture.md, `broker/state/lua`); its text is
read once with `importlib.resources` and registered once per client, so
every call is an EVALSHA of one stable SHA. A script cannot call another, so
the helpers they share (`lib.lua`: the ticket check, the doorbell, the ticket
top-up, the job counts, the latency histograms, ...) are put in front of each script's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from broker.state.held_calls import send_held

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
    "extend_leases",
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
    return resources.files("broker.state").joinpath("lua", f"{name}.lua").read_text()


@cache
def script_text(name: str) -> str:
    """The source registered for `broker/state/lua/<name>.lua`: the shared helpers of `lib.lua`, then the script."""
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
    """A registered script, sent on its client's own connection (`broker/state/held_calls.py`): a script
    call is the commonest command of the online path, one per request and several per batch."""

    def __init__(self, client: redis.Redis, script: Script) -> None:
        self._client = client
        self._script = script

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        replies = send_held(self._client, [("EVALSHA", self._script.sha, len(keys), *keys, *args)],
                            lambda: [self._script(keys=keys, args=args)])
        return replies[0]
