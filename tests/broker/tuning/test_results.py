"""A sweep's records in Redis: an ask's claim when it is answered, its sweep's begin, and when either is dead."""

from __future__ import annotations

from dataclasses import replace

import pytest

from broker.errors import Conflict, QueueFull
from broker.state.store import Store
from broker.tuning import results
from broker.tuning.results import STALE_AFTER_SECONDS, Tuning


def asked(ask_id: str, kind: str = "cpu", model_ref: str = "mlp@v1", at: float = 1000.0) -> Tuning:
    return Tuning(model_ref=model_ref, device_kind=kind, method="quick", p99_bound_ms=100.0, started_at=at,
                  updated_at=at, ask_id=ask_id)


def test_a_sweep_begins_on_its_own_claim_and_no_other_ask_does(store: Store) -> None:
    results.claim(store, [asked("a"), asked("a", "gpu")], now=1000.0, most=1)
    assert results.read(store, "mlp@v1", "gpu").status == results.QUEUED  # type: ignore[union-attr]
    with pytest.raises(Conflict):
        results.begin(store, asked("b", at=1001.0), now=1001.0)
    results.begin(store, asked("a", at=1001.0), now=1001.0)
    with pytest.raises(Conflict):  # (a second copy of the same ask: it would measure the first's load)
        results.begin(store, asked("a", "gpu", at=1002.0), now=1002.0)


def test_an_ask_on_its_second_kind_holds_its_model_and_a_dead_one_does_not(store: Store) -> None:
    results.claim(store, [asked("a"), asked("a", "gpu")], now=1000.0, most=1)
    later = 1000.0 + 2 * STALE_AFTER_SECONDS  # (the gpu record's claim is old, the cpu sweep wrote just now)
    results.save(store, replace(asked("a", at=1001.0), status=results.DONE, updated_at=later))
    with pytest.raises(Conflict):
        results.claim(store, [asked("b", at=later)], now=later, most=1)
    results.begin(store, asked("a", "gpu", at=later), now=later)
    dead = later + STALE_AFTER_SECONDS
    results.claim(store, [asked("b", at=dead)], now=dead, most=1)


def test_past_the_most_asks_at_once_another_model_is_refused_with_a_retry(store: Store) -> None:
    results.claim(store, [asked("a")], now=1000.0, most=2)
    results.claim(store, [asked("b", model_ref="cnn@v1")], now=1000.0, most=2)
    with pytest.raises(QueueFull) as refused:
        results.claim(store, [asked("c", model_ref="bert@v1")], now=1000.0, most=2)
    assert refused.value.retry_after >= 1
