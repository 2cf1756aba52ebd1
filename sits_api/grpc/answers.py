"""Waiting for online results on the event loop: no thread per waiting request.

The process's one `ResultInbox` thread pops the results pushed to its inbox, as in the HTTP API
(`sits_api.intake.result_inbox`); a `LoopDelivery` hands each to the event loop that waits for it,
so a waiting request costs a future, not a thread. A request still waiting at its timeout is dealt
with then, as `request_intake.wait_for_result` does for HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from broker.online import requests
from broker.online import timeouts as request_timeouts
from broker.online.records import RequestRecord
from broker.online.requests import RequestSpec
from sits_api.intake.result_inbox import Delivery
from sits_api.state import AppState


class LoopDelivery(Delivery):
    """A result handed over to a waiting coroutine: the inbox thread wakes `loop` with it."""

    __slots__ = ("_future", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self._future: asyncio.Future[dict[str, Any]] = loop.create_future()

    def put(self, fields: dict[str, Any]) -> None:
        """Hand the result over (from the inbox thread): the loop sets the future."""
        if self.fields is None:
            super().put(fields)
            self._loop.call_soon_threadsafe(self._wake, fields)

    def _wake(self, fields: dict[str, Any]) -> None:
        if not self._future.done():
            self._future.set_result(fields)

    async def arrival(self, timeout: float) -> RequestRecord | None:
        """The finished request once it is in, waiting up to `timeout` seconds; None if it did not come."""
        done, _ = await asyncio.wait([self._future], timeout=max(timeout, 0.0))
        return requests.record_from_fields(self._future.result()) if done else None


async def wait_for_result(state: AppState, delivery: LoopDelivery, spec: RequestSpec, *, seconds: float,
                          run: Callable[..., Awaitable[Any]]) -> RequestRecord | None:
    """The finished request within `seconds`, else None; a request still waiting at its timeout is
    expired then (`broker.online.timeouts`, through `run`, which runs a blocking call off the loop):
    rejected, its failure is the answer at once; delayed, the wait goes on."""
    began = time.monotonic()
    timeout_at = spec.expires_at or spec.delay_at
    if timeout_at is None or timeout_at - time.time() >= seconds:
        return await delivery.arrival(seconds)
    result = await delivery.arrival(timeout_at - time.time())
    if result is not None:
        return result
    _, weights, ordering = state.policy.current()
    await run(request_timeouts.expire_timed_out, state.store, spec.model_ref, now=max(time.time(), timeout_at),
              weights=weights, ordering=ordering, keep_seconds=state.settings.online.result_ttl)
    return await delivery.arrival(seconds - (time.monotonic() - began))
