"""The drain loop's bounds (real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from worker_helpers import mlp_worker_context

from broker import queues
from broker.config import Settings
from broker.store import Store
from sits_worker import drain_loop


@pytest.mark.timeout(30)  # (without the bound the loop never returns)
def test_a_loop_that_sees_no_work_while_release_says_work_waits_yields_at_its_slice_end(
        store: Store, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work that came in between the snapshot and the release is looked for again at once; but were the
    two ever to disagree for good (a watcher missing a queue, as one could before), the loop must not
    spin on Redis with its ticket for ever: it yields at the end of its time slice."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        scheduler={"ticket_time_slice": 0.2, "ticket_linger": 0}))
    [ticket] = queues.top_up_tickets(store, now=time.time(), target=1)
    calls: list[float] = []

    def work_waits(store: Store, ticket: str) -> bool:
        calls.append(time.monotonic())
        return False

    monkeypatch.setattr(queues, "release_ticket", work_waits)
    began = time.monotonic()

    assert drain_loop.drain(ctx, ticket) == "yield"
    assert 0.2 <= time.monotonic() - began < 5 and len(calls) > 1
