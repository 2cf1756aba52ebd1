"""The drain loop's bounds (real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from broker.config.settings import Settings
from broker.queueing import tickets
from broker.state.store import Store
from sits_worker.serving import drain_loop
from tests.worker.worker_helpers import mlp_worker_context


@pytest.mark.timeout(30)  # (without the bound the loop never returns)
def test_a_loop_that_sees_no_work_while_release_says_work_waits_yields_at_its_slice_end(
        store: Store, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work that came in between the snapshot and the release is looked for again at once; but were the
    two ever to disagree for good (a watcher missing a queue, as one could before), the loop must not
    spin on Redis with its ticket for ever: it yields at the end of its time slice."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        scheduler={"ticket_time_slice": 0.2, "ticket_linger": 0}))
    [ticket] = tickets.top_up_tickets(store, now=time.time(), target=1)
    calls: list[float] = []

    def work_waits(store: Store, ticket: str) -> bool:
        calls.append(time.monotonic())
        return False

    monkeypatch.setattr(tickets, "release_ticket", work_waits)
    began = time.monotonic()

    assert drain_loop.drain(ctx, ticket) == "yield"
    assert 0.2 <= time.monotonic() - began < 5 and len(calls) > 1


def test_a_paused_slot_passes_on_a_ring_it_could_not_use_to_the_next_waiter_once_a_second(store: Store) -> None:
    """Redis hands a ring to the client that blocked first: a calm worker's slot waiting meanwhile gets
    the ring a paused slot was woken by, and the paused slot passes on no more than once a second."""
    got: list[object] = []

    def calm_slot() -> None:  # (its own thread: its own connection)
        got.append(store.client.blpop([store.keys.doorbell], timeout=2))

    paused = drain_loop.PausedRing()
    paused.woken = True  # its last wait was ended by a ring, and its lease found only paused work again
    blocked_before = store.client.info("clients")["blocked_clients"]
    waiter = threading.Thread(target=calm_slot)
    waiter.start()
    while store.client.info("clients")["blocked_clients"] <= blocked_before:  # (the calm slot blocks first)
        time.sleep(0.005)

    paused.wait(store, "")
    waiter.join(3)

    assert got and got[0] is not None  # the calm slot got the passed ring
    assert not paused.woken  # and the paused slot's own wait timed out
    tickets.ring_doorbell(store)
    paused.wait(store, "")  # woken by a ring again ...
    assert paused.woken
    paused.wait(store, "")  # ... but within a second of passing one on: no ring passed, the wait times out
    assert not paused.woken and store.client.llen(store.keys.doorbell) == 0
