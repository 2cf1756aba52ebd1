"""API keys an API process checked lately, trusted a few seconds so that each call costs no Redis read.

Bounded: at most `MOST_KEYS` (the oldest checked dropped first), so that a tenant minting and using keys
without end grows no process's memory. A revoke in this process forgets the keys of that name and tenant (`forget`),
and a key whose check began before it is not kept after it: a call in flight while its key is revoked would
else put the key back for another `KEY_CACHE_SECONDS`. The other processes trust it until its time is up.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from broker.state.store import Store
from broker.tenants.apikeys import authenticate

KEY_CACHE_SECONDS = 5.0
"""A key that passed is trusted this long per API process (a revoked key stops working within it)."""
MOST_KEYS = 10_000
"""The most keys one process trusts at once."""


class KnownKeys:
    """The keys this process checked lately (thread-safe; `clock` passed in for tests)."""

    def __init__(self, most: int = MOST_KEYS, ttl_seconds: float = KEY_CACHE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.most, self.ttl_seconds, self._clock = most, ttl_seconds, clock
        self._keys: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._revokes = 0
        self._lock = threading.Lock()

    def identity(self, store: Store, key: str | None) -> dict[str, Any]:
        """The identity of `key`: trusted when checked within `ttl_seconds`, else checked against `store`
        (`authenticate`: Unauthorized for a missing or unknown key)."""
        now = self._clock()
        with self._lock:
            cached = self._keys.get(key) if key else None
            if cached is not None and now - cached[0] < self.ttl_seconds:
                return cached[1]
            revokes = self._revokes
        identity = authenticate(store, key)
        with self._lock:
            if key and revokes == self._revokes:  # (none revoked meanwhile: else it is checked again next time)
                self._keys[key] = (now, identity)
                self._keys.move_to_end(key)
                while len(self._keys) > self.most:
                    self._keys.popitem(last=False)
        return identity

    def forget(self, name: str, tenant: str | None = None) -> None:
        """Check the keys named `name` (of `tenant`, where given) again at their next call (they were revoked in this
        process); the others stay trusted, so that a tenant revoking keys in a loop does not turn every call, nor
        another tenant's key of the same name, into a Redis read."""
        with self._lock:
            self._revokes += 1
            for key in [key for key, (_, identity) in self._keys.items() if identity.get("name") == name
                        and (tenant is None or identity.get("tenant") == tenant)]:
                del self._keys[key]

    def __len__(self) -> int:
        return len(self._keys)
