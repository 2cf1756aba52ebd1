"""Holds: a key one process owns for a while, by a token of its own, renewed and dropped only by it.

A hold is taken with `SET NX PX` under a random token, and renewed or dropped by `keep_hold.lua`,
which acts only while the key still holds that token. A plain `PEXPIRE` or `DEL` would let a holder
whose hold lapsed (a long pause, or a failover that lost the key) extend or drop the hold another
process has taken since, so that a third could take it beside that one.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from broker.state.store import Store, translate_redis_errors


@dataclass(frozen=True)
class Hold:
    """One taken hold: its key, its holder's token, and how long each renewal lasts."""

    store: Store
    key: str
    token: str
    hold_ms: int

    def renew(self) -> bool:
        """Make the hold last `hold_ms` from now; False when it had lapsed or another holds it."""
        with translate_redis_errors():
            return bool(self.store.scripts.keep_hold(keys=[self.key], args=[self.token, self.hold_ms]))

    def drop(self) -> bool:
        """Let another take it at once; False (and nothing deleted) when another holds it already."""
        with translate_redis_errors():
            return bool(self.store.scripts.keep_hold(keys=[self.key], args=[self.token, 0]))


def take_hold(store: Store, key: str, hold_ms: int) -> Hold | None:
    """The hold of `key` for `hold_ms`, or None while another holds it."""
    token = secrets.token_hex(8)
    with translate_redis_errors():
        taken = store.client.set(key, token, nx=True, px=hold_ms)
    return Hold(store, key, token, hold_ms) if taken else None
