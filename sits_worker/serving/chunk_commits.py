"""Committing job chunks in the background: their part files made durable, then their ack.

A chunk's outputs must be on disk before its ack (after a crash nothing is
lost and nothing is counted twice), but waiting for the disk holds the
stream slot while the device idles: profiled on 2 cores, the fsync of one
MLP chunk's 20 MB part took 100-140 ms against 500 ms of compute. So a
stream slot hands a finished chunk to this process's commit threads and
leases its next batch at once; a thread writes the parts, fsyncs them and
acks the chunk, while the device computes the next one. A job's last chunks
are the exception: their slot waits for the commit, so that the finalize step
the last ack queues is leased next, not after a chunk of other work
(`execution.among_last_chunks`). There are as many commit threads as stream
slots, so those last chunks, which the slots finish at about the same time,
are written side by side rather than one after the other: on 2 cores, the
time from a 1M-row MLP job's last run to its finalize step fell from a
median of 29 to 13 ms.

While `max_pending` commits (the worker's stream count) are queued or
running, each holding its chunk's outputs in host memory, a slot leases no
job chunk: it serves online requests, or waits for room holding no device
memory (slots checking at the same moment may each add one more). A commit
first extends its chunk's lease (a lease of `lease_timeout`, 60 s by
default, outlasts any reasonable queue of commits).
A worker killed with commits pending loses no data: their chunks were never
acked, so their leases run out and they run again (an attempt counted each).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from broker.tracing import spans

log = logging.getLogger(__name__)


class Commits:
    """One worker process's commit threads, one per stream slot, with back-pressure on the slots that
    queue work for them."""

    def __init__(self, max_pending: int) -> None:
        self._max_pending = max(1, max_pending)
        self._executor = ThreadPoolExecutor(self._max_pending, thread_name_prefix="sits-commit")
        self._pending: set[Future[object]] = set()
        self._room = threading.Condition()

    def has_room(self) -> bool:
        """Fewer than `max_pending` commits queued or running: a stream slot may lease a job chunk."""
        with self._room:
            return len(self._pending) < self._max_pending

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Block while `max_pending` commits are queued or running (at most `timeout`); True if there
        is room. A slot without room leases online requests only, and waits here (holding no device
        memory) when nothing else is to be done."""
        with self._room:
            return self._room.wait_for(lambda: len(self._pending) < self._max_pending, timeout=timeout)

    def submit(self, commit: Callable[[], object]) -> Future[object]:
        """Queue `commit` (it handles its own errors: whatever escapes is logged); never blocks."""
        with self._room:
            future = self._executor.submit(spans.bind_current(commit))  # (its ack a child of its batch's span)
            self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[object]) -> None:
        with self._room:
            self._pending.discard(future)
            self._room.notify_all()
        if not future.cancelled() and (error := future.exception()) is not None:
            log.error("a chunk commit failed unexpectedly; its lease will run out and it runs again",
                      exc_info=error)

    def pending(self) -> int:
        """Commits queued or running now."""
        with self._room:
            return len(self._pending)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every commit queued so far is done; False if `timeout` passed first."""
        with self._room:
            pending = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in pending:
            try:
                future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            except Exception:  # noqa: S110 - already logged by `_done`
                pass
        return True
