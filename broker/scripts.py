"""Loading the Lua scripts in `broker/lua/` and registering them with a Redis client.

Each script is one atomic operation (STYLE.md, "Redis and Lua"); its text is
read once with `importlib.resources` and registered once per client, so
every call is an EVALSHA of one stable SHA. A script cannot call another, so
the helpers they share (`lib.lua`: the ticket check, the doorbell, the
ticket top-up, `number_or`, the per-status job counts) are put in front of each script's text.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis

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
        self._scripts = {name: client.register_script(script_text(name)) for name in SCRIPT_NAMES}

    def __getattr__(self, name: str) -> Any:
        try:
            return self._scripts[name]
        except KeyError:
            raise AttributeError(name) from None
