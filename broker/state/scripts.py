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
from broker.state.replies import lua_reply_tables


@cache
def _lua_file(name: str) -> str:
    return resources.files("broker.state").joinpath("lua", f"{name}.lua").read_text()


@cache
def script_text(name: str) -> str:
    """The source registered for `broker/state/lua/<name>.lua`: the reply codes (`broker/state/replies.py`),
    the shared helpers of `lib.lua`, then the script."""
    return lua_reply_tables() + _lua_file("lib") + _lua_file(name)


class Scripts:
    """The registered scripts of one Redis client, one typed attribute each, named as its file in
    `broker/state/lua/`: `scripts.lease_batch(keys=..., args=...)`."""

    enqueue_items: HeldScript
    lease_batch: HeldScript
    head_company: HeldScript
    queue_snapshot: HeldScript
    lease_riders: HeldScript
    return_items: HeldScript
    ack_chunk: HeldScript
    start_item: HeldScript
    finish_item: HeldScript
    stop_job: HeldScript
    count_jobs: HeldScript
    forget_chunks: HeldScript
    reap_leases: HeldScript
    retry_item: HeldScript
    note_failure: HeldScript
    take_reaper_turn: HeldScript
    keep_hold: HeldScript
    top_up_tickets: HeldScript
    release_ticket: HeldScript
    extend_leases: HeldScript
    submit_request: HeldScript
    complete_requests: HeldScript
    rescore: HeldScript
    re_estimate: HeldScript
    psa_jump: HeldScript
    prune_queue: HeldScript
    expire_requests: HeldScript
    note_usage: HeldScript
    index_ready: HeldScript
    claim_slot: HeldScript
    settle_run: HeldScript
    split_chunk: HeldScript

    def __init__(self, client: redis.Redis) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, HeldScript(client, client.register_script(script_text(name))))


SCRIPT_NAMES: tuple[str, ...] = tuple(Scripts.__annotations__)
"""Every script of `broker/state/lua/` but `lib.lua`, whose helpers go in front of each."""


class HeldScript:
    """A registered script, sent on its client's own connection (`broker/state/held_calls.py`): a script
    call is the commonest command of the online path, one per request and several per batch. A Redis
    that does not know it (NOSCRIPT: a replica promoted by a failover, which has none, or a restart)
    gets it loaded and the call sent again, by redis-py's `Script`; in a pipeline, by `call_pipelined`."""

    def __init__(self, client: redis.Redis, script: Script) -> None:
        self._client = client
        self._script = script

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        replies = send_held(self._client, [self.command(keys, args)], lambda: [self._script(keys=keys, args=args)])
        return replies[0]

    def command(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> tuple[Any, ...]:
        """The EVALSHA command of a call, for a pipeline (`call_pipelined`)."""
        return ("EVALSHA", self._script.sha, len(keys), *keys, *args)

    def load(self) -> None:
        """Load the script into the Redis its client reaches now (SCRIPT LOAD)."""
        self._script.sha = self._client.script_load(self._script.script)


ScriptCall = tuple[HeldScript, Sequence[Any], Sequence[Any]]
"""A script call for `call_pipelined`: the script, its keys, its arguments."""


def call_pipelined(client: Any, calls: Sequence[ScriptCall]) -> list[Any]:
    """The replies of script `calls`, sent in one pipeline (no transaction): one round trip.

    redis-py's pipeline loads its scripts only before its first try, not after a reconnect: a pipeline
    that reconnected to a new primary after a failover meets NOSCRIPT, as does one sent as
    `EVALSHA` commands. So a call answered NOSCRIPT has its script loaded and is sent again, once. A
    NOSCRIPT call never ran, and the calls that ran are not sent again. Any other error reply raises
    once every call has been answered."""
    replies = _pipelined(client, calls)
    again = [index for index, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]
    if again:
        for script in {id(calls[index][0]): calls[index][0] for index in again}.values():
            script.load()
        for index, reply in zip(again, _pipelined(client, [calls[index] for index in again]), strict=True):
            replies[index] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _pipelined(client: Any, calls: Sequence[ScriptCall]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        pipe.execute_command(*script.command(keys, args))
    return list(pipe.execute(raise_on_error=False))
