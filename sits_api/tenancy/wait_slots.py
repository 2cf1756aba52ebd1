"""How many calls each tenant may hold waiting for their results in one API process (and, with the
same counter, how many model registrations it may run at once).

A waiting call (v1 `wait=true`, every v2 `infer`) holds one of the process's request threads until
its result comes (`api.threads` of them). Without a cap one tenant's clients could hold them all, and
every other tenant's calls, `GET /healthz` included, would queue behind them. So each tenant holds
at most `api.max_waits_per_tenant` at once per process; one more is a 429 whose message says to retry
or to submit without waiting and poll. Admin keys (operators) are not capped.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from broker.errors import QueueFull

RETRY_AFTER_SECONDS = 1
"""A waiting call ends within its deadline or `online.max_wait`; most end far sooner."""


class WaitSlots:
    """Per-tenant counts of the calls waiting in this process; thread-safe."""

    def __init__(self, what: str = "calls waiting for results", setting: str = "api.max_waits_per_tenant",
                 advice: str = "or submit without waiting and poll GET /v1/requests/<id>") -> None:
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self._what, self._setting, self._advice = what, setting, advice

    @contextlib.contextmanager
    def hold(self, tenant: str, most: int) -> Iterator[None]:
        """A slot of `tenant` for the block's length (`take`)."""
        release = self.take(tenant, most)
        try:
            yield
        finally:
            release()

    def take(self, tenant: str, most: int) -> Callable[[], None]:
        """A slot of `tenant` until the function returned is called (once); QueueFull (429) when it holds
        `most` already (0: no cap)."""
        with self._lock:
            held = self._held.get(tenant, 0)
            if most and held >= most:
                raise QueueFull(f"tenant '{tenant}' has {held} {self._what} in this API process, its limit "
                                f"({self._setting}); retry after {RETRY_AFTER_SECONDS} s (Retry-After)"
                                + (f", {self._advice}" if self._advice else ""), retry_after=RETRY_AFTER_SECONDS)
            self._held[tenant] = held + 1
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            with self._lock:
                left = self._held[tenant] - 1
                if left:
                    self._held[tenant] = left
                else:
                    del self._held[tenant]

        return release

    def held(self, tenant: str) -> int:
        """How many calls of `tenant` wait now."""
        with self._lock:
            return self._held.get(tenant, 0)
