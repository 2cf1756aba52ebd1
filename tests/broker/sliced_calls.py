"""Callers of a sliced script (a job's fill or stop, `job_slices.ENQUEUE_SLICE` items a call) that die part-way,
or that another caller overtakes, for the tests of what the reaper completes. The real script runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from broker.jobs import records as jobs
from broker.jobs import slices as job_slices
from broker.state.store import Store

SLICE = 3
"""Items a sliced call takes in these tests, so that a few chunks take several calls."""


@pytest.fixture(autouse=True)
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """`job_slices.ENQUEUE_SLICE` is `SLICE` (autouse in the modules that import it)."""
    monkeypatch.setattr(job_slices, "ENQUEUE_SLICE", SLICE)


def chunk_ids(job_id: str, indexes: range) -> list[str]:
    """The item ids of the job's chunks `indexes`."""
    return [jobs.chunk_item_id(job_id, index) for index in indexes]


class CallerDied(Exception):
    """The process making a sliced call died (SIGKILL) before its next call."""


@contextmanager
def dying_after_first_call(store: Store, script: str) -> Iterator[None]:
    """Within: `script` runs its first call, then its caller dies (`CallerDied` is swallowed)."""
    registered = getattr(store.scripts, script)
    calls: list[int] = []

    def first_only(*, keys: list[str], args: list[object]) -> object:
        calls.append(1)
        if len(calls) > 1:
            raise CallerDied
        return registered(keys=keys, args=args)

    setattr(store.scripts, script, first_only)
    try:
        yield
    except CallerDied:
        pass
    finally:
        setattr(store.scripts, script, registered)
    assert len(calls) == 2, "the caller was to die after its first call"


@contextmanager
def before_first_call(store: Store, script: str, action: Callable[[], object]) -> Iterator[None]:
    """Within: `action` runs once, just before the first call of `script` (another caller's turn)."""
    registered = getattr(store.scripts, script)
    pending = [action]

    def delayed(*, keys: list[str], args: list[object]) -> object:
        while pending:
            pending.pop()()
        return registered(keys=keys, args=args)

    setattr(store.scripts, script, delayed)
    try:
        yield
    finally:
        setattr(store.scripts, script, registered)
