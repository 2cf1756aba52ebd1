"""Holds: renewed and dropped only by the holder whose token the key still holds."""

from __future__ import annotations

from broker.state.holds import take_hold
from broker.state.store import Store


def test_a_hold_keeps_others_out_until_its_holder_drops_it(store: Store) -> None:
    first = take_hold(store, "hold:a", 60_000)

    assert first is not None and take_hold(store, "hold:a", 60_000) is None
    assert first.renew() and first.drop()
    assert take_hold(store, "hold:a", 60_000) is not None


def test_a_holder_whose_hold_lapsed_neither_extends_nor_drops_the_hold_taken_since(store: Store) -> None:
    first = take_hold(store, "hold:b", 60_000)
    assert first is not None
    store.client.delete("hold:b")  # (lapsed: a long pause, or a failover that lost the key)
    second = take_hold(store, "hold:b", 5_000)
    assert second is not None

    renewed, dropped = first.renew(), first.drop()

    assert not renewed and not dropped
    assert store.client.get("hold:b") == second.token and 0 < store.client.pttl("hold:b") <= 5_000
    assert take_hold(store, "hold:b", 60_000) is None  # (no third beside the second)
